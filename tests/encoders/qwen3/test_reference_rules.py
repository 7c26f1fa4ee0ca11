"""docs/contract.md §2.6 reference-image rules (image-file decoding: tests/server/test_imagefiles.py)."""

from __future__ import annotations

import numpy as np
import pytest
from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions
from gmlx_server.engine.base import EngineInputError
from gmlx_server.engine.encoders.qwen3.processor import VisionPreprocessor
from gmlx_server.engine.families.qwen_image21.images import prepare_reference, reference_size
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
