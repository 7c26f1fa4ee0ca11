"""The pack's error as ComfyUI shows it: ComfyUI names a failed node's exception type by the
class's module and qualified name (`execution.full_type_name`), and loads the pack from
custom_nodes/ under a module name that is the folder's path; the type must still read as the
pack's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gmlx_comfy


def test_the_error_type_reads_as_the_packs_when_loaded_from_custom_nodes(tmp_path):
    path = Path(gmlx_comfy.__file__).parent / "errors.py"
    name = str(tmp_path / "custom_nodes" / "gmlx_steps") + ".errors"  # as ComfyUI names it
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    error = module.GmlxError("no model")
    kind = type(error)
    assert f"{kind.__module__}.{kind.__qualname__}" == "gmlx_comfy.errors.GmlxError"
    assert str(error) == "gmlx: no model"
