"""Image-file decoding (server/imagefiles.py): the encode route's, the OpenAI edits' and the
CLI's references."""

from __future__ import annotations

import io

import numpy as np
import pytest
from gmlx_server.engine.base import EngineInputError
from gmlx_server.imagefiles import decode_image_file, read_image_file
from PIL import Image


def _file(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_decode_formats(fmt):
    image = Image.fromarray(np.full((40, 30, 3), 128, np.uint8))
    decoded = decode_image_file(_file(image, fmt))
    assert decoded.dtype == np.uint8 and decoded.shape == (40, 30, 3)


def test_decode_keeps_alpha():
    array = np.zeros((8, 6, 4), np.uint8)
    array[..., 3] = 77
    decoded = decode_image_file(_file(Image.fromarray(array, "RGBA"), "PNG"))
    assert decoded.shape == (8, 6, 4)
    assert np.all(decoded[..., 3] == 77)


def test_decode_applies_exif_orientation():
    image = Image.fromarray(np.zeros((20, 10, 3), np.uint8))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    decoded = decode_image_file(_file(image, "JPEG", exif=exif))
    assert decoded.shape == (10, 20, 3)


@pytest.mark.parametrize(
    "data",
    [b"", b"not an image", b"\x89PNG\r\n\x1a\n" + b"\x00" * 20],
)
def test_decode_refuses_garbage(data):
    with pytest.raises(EngineInputError) as refused:
        decode_image_file(data)
    assert "object at 0x" not in str(refused.value)  # no repr of Pillow's buffer
    if data == b"not an image":
        assert str(refused.value).endswith("it is not a PNG, JPEG, WebP or GIF file")


def test_a_16_bit_grayscale_png_is_scaled_to_8_bits():
    """Pillow opens it as "I;16", whose own conversion to RGB clips every value over 255."""
    from gmlx_server.imagefiles import mask_of

    levels = np.array([0, 257, 200, 32896, 65535], np.uint16)
    image = Image.fromarray(np.tile(levels, (3, 1)))
    assert image.mode == "I;16"
    decoded = decode_image_file(_file(image, "PNG"))
    assert decoded.shape == (3, 5, 3)
    np.testing.assert_array_equal(decoded[0, :, 0], [0, 1, 1, 128, 255])
    np.testing.assert_array_equal(mask_of(decoded)[0], [0, 1, 1, 128, 255])


def test_decode_refuses_other_formats():
    image = Image.fromarray(np.zeros((4, 4, 3), np.uint8))
    with pytest.raises(EngineInputError, match="PNG, JPEG, WebP or GIF"):
        decode_image_file(_file(image, "BMP"))


def test_decode_refuses_too_many_pixels():
    # A PNG header claiming 8193 x 8193 pixels: refused from the size, before decoding.
    big = Image.new("1", (8193, 8193))
    with pytest.raises(EngineInputError, match="more than"):
        decode_image_file(_file(big, "PNG"))


def test_read_image_file(tmp_path):
    path = tmp_path / "ref.png"
    path.write_bytes(_file(Image.fromarray(np.full((5, 7, 3), 9, np.uint8)), "PNG"))
    np.testing.assert_array_equal(read_image_file(path), np.full((5, 7, 3), 9, np.uint8))
    with pytest.raises(OSError):
        read_image_file(tmp_path / "nowhere.png")
