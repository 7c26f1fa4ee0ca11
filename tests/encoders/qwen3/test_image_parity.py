"""Prompt encoding with reference images: MLX vs diffusers' pipeline (float32), and the image
preprocessing vs transformers' Qwen2-VL image processor."""

from __future__ import annotations

import numpy as np
import pytest
from gmlx_server.engine.encoders.qwen3.processor import VisionPreprocessor
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from tests.compare import rel_l2
from tests.encoders.qwen3.reference import reference_encode


def picture(height: int, width: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    """A smooth gradient with noise (and a soft alpha when channels is 4)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x / width, y / height, (x + y) / (width + height)], axis=-1) * 200
    image = base + rng.normal(0, 25, base.shape)
    if channels == 4:
        alpha = 255 * (x / width)[..., None]
        alpha[: height // 4] = 0  # a fully transparent band
        image = np.concatenate([image, alpha], axis=-1)
    return np.clip(image, 0, 255).astype(np.uint8)


CASES = {
    "one": ("Replace the background.", [picture(256, 256)]),
    "three_sizes": (
        "Replace the background of picture 1 with the sky of picture 2.",
        [picture(224, 320, 4, seed=1), picture(400, 200, seed=2), picture(300, 260, seed=3)],
    ),
    "empty_prompt": ("", [picture(288, 256, seed=4)]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_with_images_matches_pipeline(encoder, pipe, name):
    text, images = CASES[name]
    ours = encoder.encode(text, images)
    cond, slots, vae_images, ids, _ = reference_encode(pipe, text, images)
    np.testing.assert_array_equal(ours.token_ids, ids)
    assert ours.image_slots == slots
    assert ours.cond.shape == (1, *cond.shape)
    assert rel_l2(ours.cond[0], cond) <= 1e-4
    assert len(ours.vae_images) == len(vae_images)
    for mine, theirs in zip(ours.vae_images, vae_images, strict=True):
        assert mine.shape == theirs.shape and mine.shape[2] == 4
        np.testing.assert_allclose(mine, theirs, atol=1e-6)


def test_slots_are_ascending_text_rows(encoder):
    text, images = CASES["three_sizes"]
    ours = encoder.encode(text, images)
    assert ours.image_slots == sorted(ours.image_slots)
    assert all(0 < slot < ours.cond.shape[1] for slot in ours.image_slots)


def test_image_changes_conditioning(encoder):
    """Guards the parity above against a vision path whose features never reach the text rows."""
    a = encoder.encode("describe", [picture(256, 256, seed=5)]).cond[0]
    b = encoder.encode("describe", [picture(256, 256, seed=6)]).cond[0]
    slot = encoder.encode("describe", [picture(256, 256, seed=5)]).image_slots[0]
    assert rel_l2(a[slot:], b[slot:]) > 1e-2
    np.testing.assert_array_equal(a[:slot], b[:slot])  # causal: rows before the image are equal


def test_rgb_reference_gets_opaque_alpha(encoder):
    ours = encoder.encode("x", [picture(256, 320)])
    assert ours.vae_images[0].shape == (256, 320, 4)
    assert np.all(ours.vae_images[0][..., 3] == 1.0)


@pytest.mark.parametrize(
    ("height", "width", "size"),
    [
        (100, 150, {"shortest_edge": 65536, "longest_edge": 16777216}),  # upscaled
        (300, 500, {"shortest_edge": 1024, "longest_edge": 64 * 64}),  # downscaled
        (333, 257, {"shortest_edge": 1024, "longest_edge": 1048576}),  # rounded
        (256, 256, {"shortest_edge": 1024, "longest_edge": 1048576}),  # as is
    ],
)
def test_vision_preprocessing_matches_image_processor(height, width, size):
    image = Image.fromarray(picture(height, width, seed=7))
    theirs = Qwen2VLImageProcessorPil(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        size=size,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )(images=[image], return_tensors="np")
    mine = VisionPreprocessor(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=size["shortest_edge"],
        max_pixels=size["longest_edge"],
    )
    pixel_values, grid = mine.preprocess(image)
    assert list(grid) == theirs["image_grid_thw"][0].tolist()
    np.testing.assert_array_equal(pixel_values, theirs["pixel_values"])
