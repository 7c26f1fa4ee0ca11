"""LoRA on FLUX.2 klein: files in the three key forms (diffusers/PEFT, kohya, ComfyUI) mapped
onto the manifest's names equal diffusers' transformer with the same LoRA as peft adapters,
and BFL's names (ComfyUI's Flux2 model: each stream's q/k/v fused, bands picking the parts)
patch the same weights as the diffusers names."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gmlx_contract.hashing import tensor_hash
from gmlx_contract.lora_keys import linear_layers
from gmlx_server.engine.base import StepRow
from gmlx_server.engine.families.flux2_klein import family as klein

from tests.compare import rel_l2
from tests.families.flux2_klein.reference import reference_dit
from tests.families.flux2_klein.tiny.folder import build_tiny_folder
from tests.lora.forms import FORMS, client_table, random_lora, write_form
from tests.lora.reference import layer_shapes, make_table

LAYERS = (
    "transformer_blocks.0.attn.to_q",
    "transformer_blocks.0.attn.to_v",
    "transformer_blocks.1.attn.add_k_proj",
    "transformer_blocks.1.attn.to_out.0",
    "transformer_blocks.0.attn.to_add_out",
    "transformer_blocks.0.ff.linear_in",
    "transformer_blocks.1.ff_context.linear_out",
    "single_transformer_blocks.0.attn.to_qkv_mlp_proj",
    "single_transformer_blocks.1.attn.to_out",
    "x_embedder",
    "context_embedder",
    "time_guidance_embed.timestep_embedder.linear_1",
    "double_stream_modulation_txt.linear",
    "norm_out.linear",
    "proj_out",
)
DIM = 64


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flux2_lora") / "klein-tiny"
    base = build_tiny_folder(folder, family="flux2_klein")
    engine = klein.FLUX2_KLEIN.load(folder, "klein-tiny")
    return folder, base, engine


def peft_model(folder, lora):
    from diffusers import Flux2Transformer2DModel
    from peft import LoraConfig

    model = Flux2Transformer2DModel.from_pretrained(str(folder / "transformer")).eval()
    alpha = lora.rank if lora.alpha is None else lora.alpha
    config = LoraConfig(
        r=lora.rank, lora_alpha=alpha, target_modules=list(lora.pairs), init_lora_weights=False
    )
    model.add_adapter(config, adapter_name="lora")
    with torch.no_grad():
        for layer, (a, b) in lora.pairs.items():
            module = model.get_submodule(layer)
            module.lora_A["lora"].weight.copy_(torch.from_numpy(a))
            module.lora_B["lora"].weight.copy_(torch.from_numpy(b))
    return model


def inputs(seed: int):
    rng = np.random.default_rng(seed)
    cond = rng.standard_normal((7, 96)).astype(np.float32)
    x = rng.standard_normal((1, 128, 3, 4)).astype(np.float32)
    refs = [rng.standard_normal((128, 2, 2)).astype(np.float32)]
    return cond, x, refs


def engine_step(engine, cond, x, refs, table=None) -> np.ndarray:
    row = StepRow(
        cond=cond,
        cond_key="wire:" + tensor_hash(cond),
        ref_latents=tuple(refs),
        ref_keys=tuple(tensor_hash(r) for r in refs),
    )
    return engine.denoise_step(x, np.array([0.6], np.float32), [row], table=table).out


@pytest.mark.parametrize("form", FORMS)
def test_each_key_form_equals_peft(setup, form):
    folder, base, engine = setup
    lora = random_lora(
        layer_shapes(base), seed=1, alpha=None if form == "diffusers" else 8.0, layers=LAYERS
    )
    layers = linear_layers(engine.manifest())
    doc, adapters = client_table(engine.model_id, [(write_form(lora, form), 1.0)], layers)
    table = make_table(engine, doc, adapters)
    cond, x, refs = inputs(2)
    ours = engine_step(engine, cond, x, refs, table)
    theirs = reference_dit(peft_model(folder, lora), x, [0.6], cond[None], refs)
    assert rel_l2(ours, theirs) <= 1e-4
    assert rel_l2(theirs, reference_dit(base, x, [0.6], cond[None], refs)) > 0.05


def entry(key: str, up: np.ndarray, down: np.ndarray, band=None) -> dict:
    patch = {"up": tensor_hash(up), "down": tensor_hash(down), "alpha": None, "strength": 1.0}
    return {"key": f"diffusion_model.{key}.weight", "band": band, "patches": [patch]}


def table_of(engine, entries, arrays):
    adapters = {tensor_hash(a): a for a in arrays}
    return make_table(engine, {"model": engine.model_id, "entries": entries}, adapters)


def test_bfl_names_with_bands_patch_the_diffusers_layers(setup):
    """A BFL LoRA on the fused img_attn.qkv (one pair over q, k and v) equals the same pair
    split onto to_q, to_k and to_v; a band of txt_attn.qkv equals add_k_proj; linear1 is
    to_qkv_mlp_proj, img_mlp.0 ff.linear_in."""
    _, _, engine = setup
    rng = np.random.default_rng(5)
    down = rng.standard_normal((2, DIM)).astype(np.float32)
    up = rng.standard_normal((3 * DIM, 2)).astype(np.float32)
    band_up = rng.standard_normal((DIM, 2)).astype(np.float32)
    mlp_down = rng.standard_normal((2, DIM)).astype(np.float32)
    mlp_up = rng.standard_normal((2 * 192, 2)).astype(np.float32)
    linear1_up = rng.standard_normal((3 * DIM + 2 * 192, 2)).astype(np.float32)
    arrays = [down, up, band_up, mlp_down, mlp_up, linear1_up, *np.split(up, 3)]
    bfl = table_of(
        engine,
        [
            entry("double_blocks.0.img_attn.qkv", up, down),
            entry("double_blocks.1.txt_attn.qkv", band_up, down, band=[0, DIM, DIM]),
            entry("double_blocks.1.img_mlp.0", mlp_up, mlp_down),
            entry("single_blocks.0.linear1", linear1_up, down),
        ],
        arrays,
    )
    q, k, v = np.split(up, 3)
    diffusers = table_of(
        engine,
        [
            entry("transformer_blocks.0.attn.to_q", q, down),
            entry("transformer_blocks.0.attn.to_k", k, down),
            entry("transformer_blocks.0.attn.to_v", v, down),
            entry("transformer_blocks.1.attn.add_k_proj", band_up, down),
            entry("transformer_blocks.1.ff.linear_in", mlp_up, mlp_down),
            entry("single_transformer_blocks.0.attn.to_qkv_mlp_proj", linear1_up, down),
        ],
        arrays,
    )
    cond, x, refs = inputs(6)
    a = engine_step(engine, cond, x, refs, bfl)
    b = engine_step(engine, cond, x, refs, diffusers)
    assert rel_l2(a, b) <= 1e-5
    assert rel_l2(a, engine_step(engine, cond, x, refs)) > 0.01
