"""Reference images for Qwen-Image 2.1: the docs/contract.md §2.6 size rules, then the Qwen3-VL
image processor (encoders/qwen3/processor.py), with Pillow and numpy.

One resize (Lanczos, at the image's own area, sides rounded to multiples of 32) feeds both the VAE
and the vision encoder, as in diffusers' `QwenImage21Pipeline`: the VAE reads all four channels of
the resized RGBA image; the vision encoder reads it composited over white, then the Qwen3-VL image
processor's steps (smart resize, rescale, normalise, patchify into pixel_values and grid_thw).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from ...base import EngineInputError
from ...encoders.qwen3.processor import MAX_ASPECT, VisionPreprocessor
from .spec import REFERENCE_SIZES

MIN_REFERENCE_AREA = REFERENCE_SIZES.min_area
MAX_REFERENCE_AREA = REFERENCE_SIZES.max_area
SIDE_MULTIPLE = REFERENCE_SIZES.side_multiple


def reference_size(width: int, height: int) -> tuple[int, int]:
    """The size a reference image is resized to (docs/contract.md §2.6), or EngineInputError.

    Same arithmetic as diffusers' `calculate_dimensions(area, ratio)` at the image's own area,
    so the sides come out exactly as the pipeline rounds them (Python's round, half to even).
    """
    area = width * height
    if not MIN_REFERENCE_AREA <= area <= MAX_REFERENCE_AREA:
        raise EngineInputError(
            f"a reference image of {width}x{height} has {area} pixels; it must have between "
            f"{MIN_REFERENCE_AREA} (256x256) and {MAX_REFERENCE_AREA} (1024x1024)"
        )
    ratio = width / height
    new_width = math.sqrt(area * ratio)
    new_height = new_width / ratio
    new_width = round(new_width / SIDE_MULTIPLE) * SIDE_MULTIPLE
    new_height = round(new_height / SIDE_MULTIPLE) * SIDE_MULTIPLE
    if min(new_width, new_height) < SIDE_MULTIPLE:
        raise EngineInputError(
            f"a reference image of {width}x{height} rounds to {new_width}x{new_height}: "
            f"a side is below {SIDE_MULTIPLE} pixels"
        )
    if max(new_width, new_height) / min(new_width, new_height) > MAX_ASPECT:
        raise EngineInputError(
            f"a reference image of {width}x{height} has an aspect ratio above {MAX_ASPECT}"
        )
    if new_width * new_height < MIN_REFERENCE_AREA:
        raise EngineInputError(
            f"a reference image of {width}x{height} rounds to {new_width}x{new_height}, "
            f"below {MIN_REFERENCE_AREA} pixels; send a larger image"
        )
    return new_width, new_height


def image_from_array(array: np.ndarray) -> Image.Image:
    """A client's uint8 (H, W, 3|4) array as an RGBA PIL image (alpha 255 where it had none)."""
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[2] not in (3, 4):
        raise EngineInputError(
            f"a reference image must be uint8 (H, W, 3 or 4), got {array.dtype} {array.shape}"
        )
    image = Image.fromarray(np.ascontiguousarray(array), "RGBA" if array.shape[2] == 4 else "RGB")
    return image.convert("RGBA")


def flatten_over_white(image: Image.Image) -> Image.Image:
    """RGBA composited over white, as the pipeline hands references to the vision encoder."""
    white = Image.new("RGB", image.size, (255, 255, 255))
    white.paste(image, mask=image.getchannel("A"))
    return white


@dataclass(frozen=True)
class ReferenceImage:
    vae_image: np.ndarray  # (H, W, 4) float32 in [0, 1], the resized RGBA image
    pixel_values: np.ndarray  # (N, C*T*P*P) float32 for the vision encoder
    grid_thw: tuple[int, int, int]
    merge_size: int

    @property
    def slot_count(self) -> int:
        """Image-pad tokens (merged patches) this image takes in the prompt."""
        _, grid_h, grid_w = self.grid_thw
        return grid_h * grid_w // (self.merge_size * self.merge_size)


def prepare_reference(array: np.ndarray, preprocessor: VisionPreprocessor) -> ReferenceImage:
    """A client's uint8 image -> the VAE's RGBA image and the vision encoder's patches."""
    image = image_from_array(array)
    width, height = reference_size(image.width, image.height)
    resized = image.resize((width, height), resample=Image.Resampling.LANCZOS)
    vae_image = np.asarray(resized, dtype=np.float32) / 255.0
    pixel_values, grid_thw = preprocessor.preprocess(flatten_over_white(resized))
    return ReferenceImage(vae_image, pixel_values, grid_thw, preprocessor.merge_size)
