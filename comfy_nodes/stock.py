"""Where stock ComfyUI functions decide by ComfyUI's own model classes, the pack's model takes part.

* `comfy.lora.model_lora_keys_unet` builds the LoRA key map the stock loaders read files through;
  beyond the generic `diffusion_model.` and `lora_unet_` forms it maps a form only for the model
  classes it names (`transformer.` keys for its QwenImage, ...). For a model carrying
  `gmlx_lora_keys` (the pack's) the wrapper adds those: every form the server's own loader reads,
  in place of ComfyUI's entry for the same key where that lands on none of the model's weights
  (ComfyUI's Lumina2 maps diffusers keys onto its own fused qkv names, which the model lacks)
  or on a placeholder of the manifest's aliases (`gmlx_alias_weights`: ComfyUI's Flux maps
  diffusers keys onto BFL's names, norm_out.linear through a function swapping its halves).
* `comfy.sample.fix_empty_latent_channels` widens an all-zero latent to the model's channels and,
  on ComfyUI releases whose empty latents carry `downscale_ratio_spacial`, rescales it to the
  model's `spacial_downscale_ratio`. ComfyUI 0.3.64's empty latents do not say their stride, so a
  stock empty latent (EmptyLatentImage, EmptySD3LatentImage: 1/8 of the pixels) would sample the
  pack's model (1/16) at twice the size asked for: for a model whose latent format carries
  `gmlx_stride` other than 8 (Z-Image's 8 fits a stock latent), the wrapper refuses such a
  latent and names the node to use, and says when a rescaled one lands on another size than
  asked for.

Each wrapper is installed once, calls the original and changes nothing for other models. Pure:
the ComfyUI modules are handed to `install`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .errors import GmlxError
from .request import EMPTY_LATENT_NODE

log = logging.getLogger("gmlx_comfy")

# Pixels a side of one cell of ComfyUI's stock empty latents (EmptyLatentImage, EmptySD3...).
STOCK_EMPTY_LATENT_STRIDE = 8


def install(lora_module: ModuleType, sample_module: ModuleType) -> None:
    """Wrap the stock functions (once per process)."""
    _wrap(lora_module, "model_lora_keys_unet", with_gmlx_lora_keys)
    _wrap(sample_module, "fix_empty_latent_channels", with_gmlx_empty_latents)


def _wrap(module: ModuleType, name: str, make: Callable[[Callable], Callable]) -> None:
    original = getattr(module, name)
    if getattr(original, "gmlx_wrapped", False):
        return
    wrapper = make(original)
    wrapper.gmlx_wrapped = True  # type: ignore[attr-defined]
    setattr(module, name, wrapper)


def with_gmlx_lora_keys(original: Callable) -> Callable:
    @functools.wraps(original)
    def model_lora_keys_unet(model: Any, *args: Any, **kwargs: Any) -> dict:
        key_map = original(model, *args, **kwargs)
        gmlx_keys = getattr(model, "gmlx_lora_keys", None) or {}
        weights = set(model.state_dict()) if gmlx_keys else set()
        weights -= getattr(model, "gmlx_alias_weights", frozenset())
        for stem, key in gmlx_keys.items():
            if _target(key_map.get(stem)) not in weights:
                key_map[stem] = key
        return key_map

    return model_lora_keys_unet


def _target(entry: Any) -> Any:
    """The weight a key-map entry patches: the key itself, or its first member, as ComfyUI's
    (key, offset) entries into fused weights are."""
    return entry[0] if isinstance(entry, tuple) else entry


def with_gmlx_empty_latents(original: Callable) -> Callable:
    @functools.wraps(original)
    def fix_empty_latent_channels(model: Any, latent_image: Any, *args: Any, **kwargs: Any):
        latent_format = model.get_model_object("latent_format")
        stride = getattr(latent_format, "gmlx_stride", None)
        if stride is None:
            return original(model, latent_image, *args, **kwargs)
        ratio = args[0] if args else kwargs.get("downscale_ratio_spacial")
        empty = latent_image.ndim == 4 and not bool(latent_image.any())
        unsized = ratio is None and stride != STOCK_EMPTY_LATENT_STRIDE
        if empty and unsized and latent_image.shape[1] != latent_format.latent_channels:
            raise GmlxError(
                unsized_empty_latent_text(latent_image.shape, latent_format.latent_channels, stride)
            )
        fixed = original(model, latent_image, *args, **kwargs)
        if empty and ratio is not None:
            note_rescaled(latent_image.shape, int(ratio), fixed.shape, stride)
        return fixed

    return fix_empty_latent_channels


def unsized_empty_latent_text(shape: Any, channels: int, stride: int) -> str:
    return (
        f"gmlx: this empty latent ({shape[1]} channels, {shape[-1]}×{shape[-2]} cells) is not "
        f"the model's format ({channels} channels, one cell per {stride}×{stride} pixels), and "
        "this ComfyUI's empty latents do not say how many pixels a cell is: a stock empty "
        "latent (EmptyLatentImage, EmptySD3LatentImage: 8 pixels a cell) would sample at "
        f"{stride / 8:g} times the width and height asked for. Make it with the "
        f"{EMPTY_LATENT_NODE} node"
    )


def note_rescaled(shape: Any, ratio: int, fixed_shape: Any, stride: int) -> None:
    """Log when a rescaled empty latent gives other pixel sizes than its node was asked for."""
    asked = (shape[-1] * ratio, shape[-2] * ratio)
    given = (fixed_shape[-1] * stride, fixed_shape[-2] * stride)
    if asked != given:
        log.warning(
            "gmlx: the empty latent of %d×%d pixels samples at %d×%d (the model's latent cell is "
            "%d pixels; %s takes sizes in steps of %d)",
            *asked,
            *given,
            stride,
            EMPTY_LATENT_NODE,
            stride,
        )
