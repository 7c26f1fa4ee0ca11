"""CONTRACT 2.6 reference-image rules and image-file decoding."""

from __future__ import annotations

import io

import numpy as np
import pytest
from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions
from gmlx_server.engine.base import EngineInputError
from gmlx_server.engine.families.qwen_image21.images import (
    VisionPreprocessor,
    decode_image_file,
    prepare_reference,
    reference_size,
)
from PIL import Image


@pytest.mark.parametrize(
    ("width", "height", "expected"),
    [
        (256, 256, (256, 256)),
        (1024, 1024, (1024, 1024)),
        (300, 260, (288, 256)),
        (200, 400, (192, 384)),  # 12.5 rounds half to even, as the pipeline's round() does
        (1000, 1048, (992, 1056)),
        (6400, 17, (6400, 32)),  # aspect exactly 200 is allowed
    ],
)
def test_reference_size(width, height, expected):
    assert reference_size(width, height) == expected


@pytest.mark.parametrize("seed", range(5))
def test_reference_size_is_the_pipelines_rounding(seed):
    rng = np.random.default_rng(seed)
    for _ in range(200):
        width = int(rng.integers(64, 4096))
        height = int(rng.integers(max(1, 65536 // width), max(2, 1048576 // width) + 1))
        if not 65536 <= width * height <= 1048576:
            continue
        pw, ph, _ = calculate_dimensions(width * height, width / height)
        try:
            assert reference_size(width, height) == (pw, ph)
        except EngineInputError:
            assert min(pw, ph) < 32 or max(pw, ph) / min(pw, ph) > 200 or pw * ph < 65536


@pytest.mark.parametrize(
    ("width", "height", "words"),
    [
        (255, 256, "between"),  # area below 65,536
        (1025, 1024, "between"),  # area above 1,048,576
        (65536, 1, "below 32"),
        (6400, 16, "below 32"),  # 0.5 rounds to 0
        (7000, 24, "aspect"),  # 7008 x 32: aspect 219
        (300, 220, "below 65536"),  # 288 x 224 = 64,512
    ],
)
def test_reference_size_refusals(width, height, words):
    with pytest.raises(EngineInputError, match=words):
        reference_size(width, height)


def test_prepare_reference_refuses_bad_arrays():
    pre = VisionPreprocessor()
    with pytest.raises(EngineInputError):
        prepare_reference(np.zeros((256, 256, 3), np.float32), pre)
    with pytest.raises(EngineInputError):
        prepare_reference(np.zeros((256, 256, 2), np.uint8), pre)
    with pytest.raises(EngineInputError):
        prepare_reference(np.zeros((100, 100, 3), np.uint8), pre)


def test_prepare_reference_resizes_with_lanczos():
    rng = np.random.default_rng(0)
    array = rng.integers(0, 256, (300, 260, 3), dtype=np.uint8)
    ref = prepare_reference(array, VisionPreprocessor(min_pixels=1024))
    expected = Image.fromarray(array).convert("RGBA").resize((256, 288), Image.Resampling.LANCZOS)
    np.testing.assert_array_equal(ref.vae_image, np.asarray(expected, np.float32) / 255.0)
    assert ref.grid_thw == (1, 18, 16)
    assert ref.slot_count == 72


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
    with pytest.raises(EngineInputError):
        decode_image_file(data)


def test_decode_refuses_other_formats():
    image = Image.fromarray(np.zeros((4, 4, 3), np.uint8))
    with pytest.raises(EngineInputError, match="PNG, JPEG, WebP or GIF"):
        decode_image_file(_file(image, "BMP"))


def test_decode_refuses_too_many_pixels():
    # A PNG header claiming 8193 x 8193 pixels: refused from the size, before decoding.
    big = Image.new("1", (8193, 8193))
    with pytest.raises(EngineInputError, match="more than"):
        decode_image_file(_file(big, "PNG"))
