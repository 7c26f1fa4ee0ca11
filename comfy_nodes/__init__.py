"""gmlx steps for ComfyUI: loaders whose MODEL, CLIP and VAE run on a gmlx server.

ComfyUI loads this folder (linked as custom_nodes/gmlx_steps) and reads
NODE_CLASS_MAPPINGS / NODE_DISPLAY_NAME_MAPPINGS. They are resolved lazily (PEP 562), so that
`import gmlx_comfy.settings` or `gmlx_comfy.install` (used by the `gmlx` command line, which
must not import torch) loads neither torch nor ComfyUI.
"""

from __future__ import annotations

from typing import Any

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import nodes

        return getattr(nodes, name)
    raise AttributeError(name)
