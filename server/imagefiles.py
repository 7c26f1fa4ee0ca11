"""Image files (PNG, JPEG, WebP, GIF) as the uint8 arrays the models take: the one decoder of
the encode route, the OpenAI image edits and `gmlx image sample --ref`."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from .engine.base import EngineInputError

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
# Checked from the file's header, before the pixels are decoded: a small file may claim a huge
# size, and its decoded pixels would be held in memory.
MAX_DECODED_PIXELS = 64 * 1024 * 1024


def decode_image_file(data: bytes) -> np.ndarray:
    """A PNG, JPEG, WebP or GIF file (first frame) -> uint8 (H, W, 3), or (H, W, 4) when it has
    alpha, EXIF orientation applied. EngineInputError (answered 400) when it is none of these,
    is too large or cannot be decoded."""
    from PIL import Image, ImageOps  # here: the commands that decode no image run without it

    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format not in IMAGE_FORMATS:
                raise EngineInputError(
                    f"images must be PNG, JPEG, WebP or GIF files, not {image.format or 'unknown'}"
                )
            width, height = image.size
            if width * height > MAX_DECODED_PIXELS:
                raise EngineInputError(
                    f"an image of {width}x{height} has more than {MAX_DECODED_PIXELS} pixels"
                )
            upright = ImageOps.exif_transpose(image)
            mode = "RGBA" if _has_alpha(upright) else "RGB"
            return np.array(upright.convert(mode), dtype=np.uint8)
    except EngineInputError:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise EngineInputError(f"an image could not be decoded: {exc}") from None


def read_image_file(path: str | Path) -> np.ndarray:
    """`decode_image_file` of a file on disk (OSError when it cannot be read)."""
    return decode_image_file(Path(path).read_bytes())


def _has_alpha(image) -> bool:
    return image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info
