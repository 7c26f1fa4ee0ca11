"""Reference images for Qwen-Image 2.1: the docs/contract.md §2.6 size rules, and the Qwen3-VL
image processor's preprocessing, with Pillow and numpy.

One resize (Lanczos, at the image's own area, sides rounded to multiples of 32) feeds both the VAE
and the vision encoder, as in diffusers' `QwenImage21Pipeline`: the VAE reads all four channels of
the resized RGBA image; the vision encoder reads it composited over white, then the Qwen3-VL image
processor's steps (smart resize, rescale, normalise, patchify into pixel_values and grid_thw).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from ...base import EngineInputError

MIN_REFERENCE_AREA = 256 * 256
MAX_REFERENCE_AREA = 1024 * 1024
SIDE_MULTIPLE = 32
MAX_ASPECT = 200


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
class VisionPreprocessor:
    """The Qwen3-VL (Qwen2-VL) image processor's settings, from preprocessor_config.json."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536
    max_pixels: int = 16777216
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = int(Image.Resampling.BICUBIC)

    @classmethod
    def load(cls, processor_dir: Path) -> VisionPreprocessor:
        path = Path(processor_dir) / "preprocessor_config.json"
        config = json.loads(path.read_text()) if path.exists() else {}
        size = config.get("size") or {}
        fields = {
            "min_pixels": config.get("min_pixels") or size.get("shortest_edge"),
            "max_pixels": config.get("max_pixels") or size.get("longest_edge"),
        }
        for name in ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor"):
            fields[name] = config.get(name)
        for name in ("do_resize", "do_rescale", "do_normalize", "resample"):
            fields[name] = config.get(name)
        for name in ("image_mean", "image_std"):
            if config.get(name) is not None:
                fields[name] = tuple(config[name])
        return cls(**{k: v for k, v in fields.items() if v is not None})

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def smart_resize(self, height: int, width: int) -> tuple[int, int]:
        """Qwen2-VL's `smart_resize`: sides multiples of the factor, area within the limits."""
        factor = self.factor
        if max(height, width) / min(height, width) > MAX_ASPECT:
            raise EngineInputError(f"an image's aspect ratio must not exceed {MAX_ASPECT}")
        h_bar = round(height / factor) * factor
        w_bar = round(width / factor) * factor
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt((height * width) / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def preprocess(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """An RGB image -> (pixel_values (N, C*T*P*P) float32, grid_thw (1, gh, gw))."""
        image = image.convert("RGB")
        if self.do_resize:
            height, width = self.smart_resize(image.height, image.width)
            if (width, height) != image.size:
                image = image.resize((width, height), resample=self.resample)
        pixels = np.asarray(image).transpose(2, 0, 1)  # (C, H, W) uint8
        if self.do_rescale:
            pixels = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        pixels = pixels.astype(np.float32)
        if self.do_normalize:
            mean = np.asarray(self.image_mean, dtype=np.float32)[:, None, None]
            std = np.asarray(self.image_std, dtype=np.float32)[:, None, None]
            pixels = (pixels - mean) / std
        return self.patchify(pixels)

    def patchify(self, pixels: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """(C, H, W) -> rows of (C, T, P, P) patches in merge-block order, as the processor lays
        them out (each 2x2 block of patches consecutive; the still image repeated T times)."""
        channels, height, width = pixels.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        grid_h, grid_w = height // p, width // p
        patches = pixels.reshape(channels, grid_h // m, m, p, grid_w // m, m, p)
        patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)  # (gh/m, gw/m, m, m, C, P, P)
        patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
        rows = patches.reshape(grid_h * grid_w, channels * t * p * p)
        return np.ascontiguousarray(rows, dtype=np.float32), (1, grid_h, grid_w)


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
