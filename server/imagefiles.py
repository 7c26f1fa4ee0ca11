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
WIDE_GRAY_MODES = ("I;16", "I;16B", "I;16L", "I")  # how Pillow opens a 16-bit grayscale PNG


# The formats images are answered in (the OpenAI routes' `output_format`) and written in (the
# image commands' files, by their suffix: a name without one is a PNG).
OUTPUT_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}
FILE_SUFFIXES = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".webp": "webp", "": "png"}


def encode_picture(picture: np.ndarray, output_format: str) -> bytes:
    """A picture (uint8 (H, W, 3)) as a file of `output_format` (a key of OUTPUT_FORMATS)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(picture).save(buffer, format=OUTPUT_FORMATS[output_format])
    return buffer.getvalue()


def file_format(path: Path) -> str | None:
    """The format a picture written to `path` takes from its suffix (None: no format's)."""
    return FILE_SUFFIXES.get(Path(path).suffix.lower())


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
            upright = _eight_bit(ImageOps.exif_transpose(image))
            mode = "RGBA" if _has_alpha(upright) else "RGB"
            return np.array(upright.convert(mode), dtype=np.uint8)
    except EngineInputError:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise EngineInputError(f"an image could not be decoded: {_reason(exc)}") from None


def _reason(exc: Exception) -> str:
    """Why Pillow could not decode a file, in words for the client (Pillow names the buffer it
    read from, which says nothing to them)."""
    from PIL import UnidentifiedImageError

    if isinstance(exc, UnidentifiedImageError):
        return "it is not a PNG, JPEG, WebP or GIF file"
    return str(exc)


def read_image_file(path: str | Path) -> np.ndarray:
    """`decode_image_file` of a file on disk (OSError when it cannot be read)."""
    return decode_image_file(Path(path).read_bytes())


def _eight_bit(image):
    """A 16-bit grayscale image (a PNG's: Pillow's "I;16" modes, or "I") scaled to 8 bits, 65535
    to 255; Pillow's own conversion to RGB clips it, every value over 255 white."""
    from PIL import Image

    if image.mode not in WIDE_GRAY_MODES:
        return image
    gray = np.asarray(image, dtype=np.float64) / 257.0
    return Image.fromarray(np.clip(np.rint(gray), 0, 255).astype(np.uint8), "L")


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
