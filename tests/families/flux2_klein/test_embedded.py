"""The embedded FLUX.2 klein: a real-format Flux2KleinPipeline folder generated without torch,
whose inventories are diffusers' and transformers' own parameters, which the family serves as
the distilled 4B and whose prompt visibly moves the output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gmlx_contract.hashing import tensor_hash
from gmlx_server.engine import embedded as shared
from gmlx_server.engine.base import StepRow
from gmlx_server.engine.embedded import STAMP_FILE
from gmlx_server.engine.families.flux2_klein import embedded, family

from tests.families.flux2_klein.reference import rel_l2
from tests.families.z_image.test_embedded import _files


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return embedded.ensure_embedded_model(tmp_path_factory.mktemp("cache"))


def test_folder_is_named_and_laid_out_as_the_pipeline(model_dir):
    assert model_dir.name == embedded.MODEL_NAME == "flux2-klein-random-tiny"
    assert set(_files(model_dir)) == {
        "model_index.json",
        "scheduler/scheduler_config.json",
        "transformer/config.json",
        "transformer/diffusion_pytorch_model.safetensors",
        "vae/config.json",
        "vae/diffusion_pytorch_model.safetensors",
        "text_encoder/config.json",
        "text_encoder/model.safetensors",
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
        STAMP_FILE,
    }
    assert family.FLUX2_KLEIN.spec.identify(model_dir) == ("flux2_klein", "distilled")
    assert sum(len(data) for data in _files(model_dir).values()) < 6_000_000


def test_the_pipeline_loads_it_with_every_parameter(model_dir):
    """diffusers' Flux2KleinPipeline reads the folder as it is, and every component's
    parameters (and the VAE's batch-norm buffers) are the inventory's, by name and shape."""
    from diffusers import Flux2KleinPipeline

    pipe = Flux2KleinPipeline.from_pretrained(str(model_dir))
    vae = {**shared.flux2_vae_tensors(), "bn.num_batches_tracked": ((), None)}
    inventories = {
        "transformer": embedded.TRANSFORMER.inventory,
        "vae": vae,
        "text_encoder": shared.qwen3_tensors(pipe.text_encoder.config.to_dict()),
    }
    for name, inventory in inventories.items():
        state = getattr(pipe, name).state_dict()
        assert {key: tuple(value.shape) for key, value in state.items()} == {
            key: shape for key, (shape, _) in inventory.items()
        }, name
    assert pipe.config.is_distilled and pipe.transformer.config.joint_attention_dim == 96


def test_the_prompt_moves_the_output(model_dir):
    model = family.FLUX2_KLEIN.load(model_dir, embedded.MODEL_NAME)
    try:
        x = np.random.default_rng(0).standard_normal((1, 128, 4, 4)).astype(np.float32)
        t = np.array([0.6], np.float32)
        outs = []
        for text in ("a red fox in the snow", "an oil painting of a book"):
            cond = model.encode(text, [], False).cond[0]
            row = StepRow(cond=cond, cond_key="wire:" + tensor_hash(cond[None]))
            outs.append(model.denoise_step(x, t, [row]).out)
    finally:
        model.close()
    assert rel_l2(outs[0], outs[1]) > 0.05
