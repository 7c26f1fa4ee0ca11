"""Image files (PNG, JPEG, WebP, GIF) as the uint8 arrays the models take: the one decoder of
the encode route, the OpenAI image routes and `gmlx image sample`'s images; and masks."""

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


def mask_of(image: np.ndarray) -> np.ndarray:
    """An inpainting mask from an image file's pixels: uint8 (H, W), 255 where to paint. An image
    with alpha is read as OpenAI's edit masks are, transparent where to paint (255 - alpha);
    one without, as diffusers' inpaint pipelines read theirs, white where to paint (its
    luminance, Pillow's "L" conversion)."""
    from PIL import Image

    image = np.asarray(image, dtype=np.uint8)
    if image.ndim == 3 and image.shape[2] == 4:
        return (255 - image[..., 3]).astype(np.uint8)
    if image.ndim == 2:
        return image
    return np.asarray(Image.fromarray(np.ascontiguousarray(image[..., :3]), "RGB").convert("L"))
