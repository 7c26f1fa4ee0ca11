"""LoRA files on MOSS-Image through `--adapter` (gmlx_server.lora_files): each key form
(diffusers, kohya, ComfyUI's `diffusion_model.` form, the form MOSS-Image's published adapters
take) against the MLX port's unmerged LoRA (moss_image_mlx.lora.apply_lora, on its DiT, in
float32), on q, k and v (fused here), the text blocks' fused qkv and their SITU halves (fused
here), a main block's fused up/gate, and the modulations and head outside the blocks."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gmlx_server.engine.base import StepRow
from gmlx_server.engine.families.moss_image.layout import DiTConfig, tensor_shapes
from gmlx_server.engine.weights import read_config
from gmlx_server.lora_files import AdapterSpec, adapter_table

from tests.compare import rel_l2
from tests.families.moss_image.tiny import build_tiny_folder, reference_dit
from tests.families.routes import loaded_folder
from tests.lora.forms import FORMS, random_lora, write_lora_file

LAYERS = (
    "layers.0.proj.q",
    "layers.0.proj.k",
    "layers.0.proj.v",
    "layers.0.proj.o",
    "layers.1.proj.ffn_up_gate",
    "layers.23.proj.ffn_down",
    "text_embedder.blocks.0.qkv",
    "text_embedder.blocks.1.ffn_gate",
    "text_embedder.blocks.1.ffn_up",
    "shared_block_modulation",
    "video_head_modulation",
    "final_linear_video",
)
# (the port reads the dtype of video_embedder, text_embedder.proj and time_embedding.0 from
# their weights, which its LoRA wrapper hides, so the port cannot check a LoRA on those three)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = build_tiny_folder(tmp_path_factory.mktemp("moss_lora") / "moss-tiny")
    return folder, loaded_folder(folder)


def layer_shapes(folder) -> dict[str, tuple[int, int]]:
    shapes = tensor_shapes(DiTConfig.from_dict(read_config(folder / "transformer")))
    return {name[: -len(".weight")]: s for name, s in shapes.items() if len(s) == 2}


@pytest.mark.parametrize("form", FORMS)
def test_a_file_in_each_key_form_runs_as_the_ports_lora(tmp_path, tiny, form):
    from moss_image_mlx.lora import apply_lora

    folder, loaded = tiny
    lora = random_lora(
        layer_shapes(folder), seed=11, alpha=None if form == "diffusers" else 8.0, layers=LAYERS
    )
    table = adapter_table(loaded, [AdapterSpec(write_lora_file(tmp_path, lora, form), 0.7)])
    rng = np.random.default_rng(12)
    config = loaded.model.dit.config
    cond = rng.standard_normal((1, 5, config.text_dim)).astype(np.float32)
    x = rng.standard_normal((1, config.latent_channels, 4, 6)).astype(np.float32)
    row = StepRow(cond, "wire:c")

    def ours(table):
        return loaded.model.denoise_step(x, np.float32([600.0]), [row], table=table).out

    # the port reads the ComfyUI form (its published adapters'), whatever form ours was given
    comfy = write_lora_file(tmp_path / "port", lora, "comfy")
    port = reference_dit(folder)
    apply_lora(port, str(comfy), 0.7, mx.float32)  # its scale: 0.7 alpha / rank, as ours
    theirs = np.array(port(mx.array(x), 600.0, mx.array(cond)))
    assert rel_l2(ours(table), theirs) <= 1e-4
    assert rel_l2(ours(table), ours(None)) > 0.05  # the LoRA moved the output
