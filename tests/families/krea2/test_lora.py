"""LoRA files on Krea 2 through `--adapter` (gmlx_server.lora_files): each key form (diffusers
and PEFT, the trainer's output; kohya; ComfyUI's) against peft on diffusers' Krea2Transformer2DModel,
on q with its gate and k with v (fused here), the unfused projections, the text fusion and the
layers outside the blocks."""

from __future__ import annotations

import numpy as np
import pytest
from gmlx_server.engine.base import StepRow
from gmlx_server.lora_files import AdapterSpec, adapter_table

from tests.compare import rel_l2
from tests.families.krea2.reference import reference_dit
from tests.families.krea2.tiny import build_tiny_folder
from tests.families.routes import loaded_folder
from tests.lora.forms import FORMS, random_lora, write_lora_file
from tests.lora.reference import layer_shapes, peft_model

LAYERS = (
    "transformer_blocks.0.attn.to_q",
    "transformer_blocks.0.attn.to_gate",
    "transformer_blocks.0.attn.to_k",
    "transformer_blocks.0.attn.to_v",
    "transformer_blocks.0.attn.to_out.0",
    "transformer_blocks.1.ff.gate",
    "transformer_blocks.1.ff.down",
    "text_fusion.layerwise_blocks.0.attn.to_q",
    "text_fusion.refiner_blocks.1.ff.up",
    "img_in",
    "time_mod_proj",
    "txt_in.linear_1",
    "final_layer.linear",
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = build_tiny_folder(tmp_path_factory.mktemp("krea2_lora") / "krea2-tiny")
    return folder, loaded_folder(folder)


def transformer(folder):
    from diffusers import Krea2Transformer2DModel

    return Krea2Transformer2DModel.from_pretrained(str(folder / "transformer")).eval()


@pytest.mark.parametrize("form", [*FORMS, "peft"])
def test_a_file_in_each_key_form_runs_as_peft_does(tmp_path, tiny, form):
    folder, loaded = tiny
    shapes = layer_shapes(transformer(folder))
    lora = random_lora(
        shapes, seed=11, alpha=None if form in ("diffusers", "peft") else 8.0, layers=LAYERS
    )
    table = adapter_table(loaded, [AdapterSpec(write_lora_file(tmp_path, lora, form), 0.7)])
    rng = np.random.default_rng(12)
    config = loaded.model.dit.config
    cond = rng.standard_normal((5, config.num_text_layers, config.text_dim)).astype(np.float32)
    x = rng.standard_normal((1, config.latent_channels, 4, 6)).astype(np.float32)
    row = StepRow(cond.reshape(1, 5, -1), "wire:c")

    def ours(table):
        return loaded.model.denoise_step(x, np.float32([0.6]), [row], table=table).out

    theirs = reference_dit(peft_model(folder, [(lora, 0.7)], transformer(folder)), x, [0.6], [cond])
    assert rel_l2(ours(table), theirs) <= 1e-4
    assert rel_l2(ours(table), ours(None)) > 0.05  # the LoRA moved the output
