"""The Qwen3-VL (Qwen2-VL) image processor's preprocessing, with Pillow and numpy: smart resize,
rescale, normalise, patchify into pixel_values and grid_thw."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from ...base import EngineInputError

MAX_ASPECT = 200


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
