"""tests/families/qwen_image21/tiny/folder.py builds a folder that diffusers' pipeline and the server both accept."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.families.qwen_image21.tiny.folder import TURBO_SIGMAS, build_tiny_folder

torch = pytest.importorskip("torch")


def test_tiny_folder_runs_in_the_diffusers_pipeline(tmp_path):
    from diffusers import QwenImage21Pipeline

    from tests.encoders.qwen3.reference import load_processor

    root = build_tiny_folder(tmp_path / "tiny", seed=3)
    pipe = QwenImage21Pipeline.from_pretrained(
        root, processor=load_processor(root), dtype=torch.float32
    )
    image = pipe(
        "a red fox",
        height=64,
        width=64,
        num_inference_steps=2,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).images
    assert image.shape == (1, 64, 64, 4) and np.isfinite(image).all()


@pytest.mark.parametrize("variant", ["base", "turbo"])
def test_tiny_folder_variants_are_identified(tmp_path, variant):
    from gmlx_server.engine.families.qwen_image21 import family

    root = build_tiny_folder(tmp_path / variant, variant=variant)
    assert family.QWEN_IMAGE21.spec.identify(root) == ("qwen_image21", variant)
    index = json.loads((root / "model_index.json").read_text())
    assert index["sample_sigmas"] == (TURBO_SIGMAS if variant == "turbo" else None)
    assert (root / "scheduler" / "scheduler_config.json").is_file()


def test_unknown_variant_is_refused(tmp_path):
    with pytest.raises(ValueError, match="variant"):
        build_tiny_folder(tmp_path, variant="distilled")
