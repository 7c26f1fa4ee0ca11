"""FLUX.2 klein LoRA files keyed by BFL's names (ComfyUI-trained, ai-toolkit, kohya), loaded by
the server's loader (`--adapter`, a model entry's adapters) through the manifest's
`lora_aliases`, against diffusers' own loading of the same file (`Flux2LoraLoaderMixin`: its
BFL-to-diffusers conversion, then peft): each stream's fused q/k/v split by rows onto to_q, to_k
and to_v with one shared down matrix, linear1 as to_qkv_mlp_proj (q, k, v and the MLP's input).
The final modulation, whose halves BFL stores swapped against diffusers' norm_out.linear,
patches norm_out.linear's halves swapped back (diffusers' LoRA conversion maps it unswapped)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gmlx_contract.lora_keys import layer_aliases
from gmlx_server.config import AdapterSpec
from gmlx_server.engine.families.flux2_klein import family as klein
from gmlx_server.lora_files import adapter_table
from safetensors.numpy import save_file

from tests.compare import rel_l2
from tests.families.flux2_klein.reference import reference_dit
from tests.families.flux2_klein.test_lora import engine_step, inputs
from tests.families.flux2_klein.tiny.folder import build_tiny_folder
from tests.lora.forms import Lora, random_lora

TOLERANCE = 1e-4
MOVES = 0.05  # a LoRA that did nothing fails the test
STRENGTH = 0.7
FINAL_MOD = "final_layer.adaLN_modulation.1"
# The BFL layers diffusers' kohya conversion maps (its Flux2 table has no modulations).
KOHYA_LAYERS = (
    "double_blocks.0.img_attn.qkv",
    "double_blocks.1.txt_attn.qkv",
    "double_blocks.0.img_attn.proj",
    "double_blocks.1.txt_attn.proj",
    "double_blocks.0.img_mlp.0",
    "double_blocks.1.img_mlp.2",
    "double_blocks.0.txt_mlp.0",
    "double_blocks.1.txt_mlp.2",
    "single_blocks.0.linear1",
    "single_blocks.1.linear2",
    "img_in",
    "txt_in",
    "time_in.in_layer",
    "time_in.out_layer",
    "final_layer.linear",
)
LAYERS = KOHYA_LAYERS + (
    "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.lin",
    "single_stream_modulation.lin",
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flux2_bfl_lora") / "klein-tiny"
    base = build_tiny_folder(folder, family="flux2_klein")
    return folder, base, klein.FLUX2_KLEIN.load(folder, "klein-tiny")


def loaded(engine):
    return SimpleNamespace(model_id=engine.model_id, model=engine)


def bfl_shapes(manifest: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of every BFL layer: its pieces' rows together, their layers' columns."""
    columns = {t["name"].removesuffix(".weight"): t["shape"][-1] for t in manifest["tensors"]}
    return {
        alias: (sum(p.length for p in pieces), columns[pieces[0].layer])
        for alias, pieces in layer_aliases(manifest).items()
    }


def bfl_file(tmp_path, lora: Lora, form: str) -> str:
    """The LoRA as a file of BFL names in one form:
    ai-toolkit  diffusion_model.<name>.lora_A.weight / .lora_B.weight (no alpha)
    peft        base_model.model.<name>.lora_A.weight / .lora_B.weight, adapter_config.json
    kohya       lora_unet_<name, dots as underscores>.lora_down.weight / .lora_up.weight / .alpha
    comfy       diffusion_model.<name>.lora_down.weight / .lora_up.weight / .alpha"""
    state = {}
    for name, (a, b) in lora.pairs.items():
        if form in ("ai-toolkit", "peft"):
            stem = ("diffusion_model." if form == "ai-toolkit" else "base_model.model.") + name
            state[f"{stem}.lora_A.weight"], state[f"{stem}.lora_B.weight"] = a, b
            continue
        stem = (
            "lora_unet_" + name.replace(".", "_") if form == "kohya" else "diffusion_model." + name
        )
        state[f"{stem}.lora_down.weight"], state[f"{stem}.lora_up.weight"] = a, b
        if lora.alpha is not None:
            state[f"{stem}.alpha"] = np.array(lora.alpha, np.float32)
    folder = tmp_path / form
    folder.mkdir()
    path = folder / ("adapter_model.safetensors" if form == "peft" else "lora.safetensors")
    save_file(state, str(path))
    if form == "peft":  # diffusers reads no config: scale 1 there, so lora_alpha = r here
        config = {"r": lora.rank, "lora_alpha": lora.rank}
        (folder / "adapter_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


def diffusers_loaded(folder, path, strength: float):
    """The tiny transformer with the file loaded as diffusers loads a FLUX.2 LoRA
    (`Flux2LoraLoaderMixin.lora_state_dict`, then `load_lora_into_transformer`: peft)."""
    from diffusers import Flux2Transformer2DModel
    from diffusers.loaders.lora_pipeline import Flux2LoraLoaderMixin

    model = Flux2Transformer2DModel.from_pretrained(str(folder / "transformer")).eval()
    state = Flux2LoraLoaderMixin.lora_state_dict(str(path))
    Flux2LoraLoaderMixin.load_lora_into_transformer(state, transformer=model, adapter_name="bfl")
    model.set_adapters(["bfl"], weights=[strength])
    return model


def qkv_blockwise(lora: Lora, dim: int) -> Lora:
    """The LoRA with every fused q/k/v up matrix block-diagonal (rank split in three, one third
    per part): the case diffusers' kohya conversion splits the rank of (its `is_sparse`)."""
    pairs = dict(lora.pairs)
    third = lora.rank // 3
    for name, (a, b) in lora.pairs.items():
        if name.endswith(".qkv"):
            mask = np.zeros_like(b)
            for part in range(3):
                mask[part * dim : (part + 1) * dim, part * third : (part + 1) * third] = 1
            pairs[name] = (a, b * mask)
    return Lora(pairs, lora.alpha, lora.rank)


CASES = {
    # form, alpha, rank, layers, block-diagonal qkv
    "ai-toolkit": ("ai-toolkit", None, 4, LAYERS, False),
    "peft": ("peft", None, 4, LAYERS, False),
    "kohya": ("kohya", 8.0, 4, KOHYA_LAYERS, False),
    "kohya-blockwise-qkv": ("kohya", 3.0, 6, KOHYA_LAYERS, True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bfl_file_runs_as_diffusers_loads_it(tmp_path, setup, case):
    folder, base, engine = setup
    form, alpha, rank, layers, blockwise = CASES[case]
    lora = random_lora(
        bfl_shapes(engine.manifest()), seed=21, rank=rank, alpha=alpha, layers=layers
    )
    if blockwise:
        lora = qkv_blockwise(lora, engine.dit.config.dim)
    path = bfl_file(tmp_path, lora, form)
    table = adapter_table(loaded(engine), [AdapterSpec(path, STRENGTH)])
    cond, x, refs = inputs(22)
    ours = engine_step(engine, cond, x, refs, table)
    theirs = reference_dit(diffusers_loaded(folder, path, STRENGTH), x, [0.6], cond[None], refs)
    assert rel_l2(ours, theirs) <= TOLERANCE
    assert rel_l2(ours, engine_step(engine, cond, x, refs)) > MOVES


def test_comfyuis_own_form_equals_the_same_pairs_scaled_in_the_ai_toolkit_form(tmp_path, setup):
    """diffusion_model.<BFL name>.lora_down/.lora_up/.alpha (what ComfyUI saves and reads; a
    form diffusers takes for kohya's and drops) runs as the ai-toolkit file of the same pairs
    with alpha / rank folded into up, loaded by diffusers."""
    folder, _, engine = setup
    lora = random_lora(bfl_shapes(engine.manifest()), seed=23, alpha=2.0, layers=LAYERS)
    folded = Lora({n: (a, b * lora.scale) for n, (a, b) in lora.pairs.items()}, None, lora.rank)
    table = adapter_table(loaded(engine), [AdapterSpec(bfl_file(tmp_path, lora, "comfy"), 1.0)])
    cond, x, refs = inputs(24)
    ours = engine_step(engine, cond, x, refs, table)
    reference = diffusers_loaded(folder, bfl_file(tmp_path, folded, "ai-toolkit"), 1.0)
    assert rel_l2(ours, reference_dit(reference, x, [0.6], cond[None], refs)) <= TOLERANCE


def test_the_final_modulation_patches_norm_out_with_its_halves_swapped(tmp_path, setup):
    """BFL's final_layer.adaLN_modulation.1 is (shift, scale), diffusers' norm_out.linear
    (scale, shift): a BFL pair on it equals peft's pair on norm_out.linear with the up
    matrix's halves swapped (ComfyUI's `swap_scale_shift`)."""
    from peft import LoraConfig

    folder, base, engine = setup
    lora = random_lora(bfl_shapes(engine.manifest()), seed=25, alpha=8.0, layers=(FINAL_MOD,))
    down, up = lora.pairs[FINAL_MOD]
    table = adapter_table(loaded(engine), [AdapterSpec(bfl_file(tmp_path, lora, "kohya"), 0.5)])
    model = type(base).from_pretrained(str(folder / "transformer")).eval()
    model.add_adapter(
        LoraConfig(r=4, lora_alpha=8.0, target_modules=["norm_out.linear"]), adapter_name="x"
    )
    shift, scale = np.split(up, 2)
    with torch.no_grad():
        module = model.get_submodule("norm_out.linear")
        module.lora_A["x"].weight.copy_(torch.from_numpy(down))
        module.lora_B["x"].weight.copy_(torch.from_numpy(np.concatenate([scale, shift])))
    model.set_adapters(["x"], weights=[0.5])
    cond, x, refs = inputs(26)
    ours = engine_step(engine, cond, x, refs, table)
    assert rel_l2(ours, reference_dit(model, x, [0.6], cond[None], refs)) <= TOLERANCE
    assert rel_l2(ours, engine_step(engine, cond, x, refs)) > MOVES


def test_the_table_splits_a_fused_pair_by_rows_and_shares_down(tmp_path, setup):
    _, _, engine = setup
    dim = engine.dit.config.dim
    names = ("double_blocks.0.img_attn.qkv", FINAL_MOD)
    lora = random_lora(bfl_shapes(engine.manifest()), seed=27, alpha=None, layers=names)
    table = adapter_table(loaded(engine), [AdapterSpec(bfl_file(tmp_path, lora, "comfy"), 1.0)])
    placed = {(e.key, tuple(e.band or ())): e.patches[0] for e in table.entries}
    down, up = lora.pairs["double_blocks.0.img_attn.qkv"]
    for part, layer in enumerate(("to_q", "to_k", "to_v")):
        patch = placed[(f"diffusion_model.transformer_blocks.0.attn.{layer}.weight", ())]
        np.testing.assert_array_equal(patch.up, up[part * dim : (part + 1) * dim])
        np.testing.assert_array_equal(patch.down, down)
    final_up = lora.pairs[FINAL_MOD][1]
    shift = placed[("diffusion_model.norm_out.linear.weight", (0, dim, dim))]
    scale = placed[("diffusion_model.norm_out.linear.weight", (0, 0, dim))]
    np.testing.assert_array_equal(shift.up, final_up[:dim])
    np.testing.assert_array_equal(scale.up, final_up[dim:])
    assert len(placed) == 5


@pytest.mark.parametrize(
    ("state", "reason"),
    [
        (
            {"diffusion_model.double_blocks.7.img_attn.qkv.lora_A.weight": (4, 64)},
            "'diffusion_model.double_blocks.7.img_attn.qkv.lora_A.weight' names no linear layer",
        ),
        (
            {
                "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": (4, 64),
                "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": (64, 4),
            },
            "double_blocks.0.img_attn.qkv: up has 64 rows, the layer has 192",
        ),
        (
            {
                "diffusion_model.single_blocks.1.linear1.lora_A.weight": (4, 32),
                "diffusion_model.single_blocks.1.linear1.lora_B.weight": (576, 4),
            },
            "single_transformer_blocks.1.attn.to_qkv_mlp_proj",
        ),
        (
            {
                "diffusion_model.double_blocks.0.txt_attn.qkv.lora_A.weight": (4, 64),
                "diffusion_model.double_blocks.0.txt_attn.qkv.lora_B.weight": (192, 2),
            },
            "up (64, 2) and down (4, 64) disagree on the rank",
        ),
    ],
    ids=["unknown block", "qkv rows", "linear1 columns", "ranks disagree"],
)
def test_bad_bfl_files_are_refused_naming_the_file(tmp_path, setup, state, reason):
    _, _, engine = setup
    path = tmp_path / "bad.safetensors"
    rng = np.random.default_rng(0)
    save_file({k: rng.standard_normal(s).astype(np.float32) for k, s in state.items()}, str(path))
    with pytest.raises(ValueError, match="LoRA file bad.safetensors") as error:
        adapter_table(loaded(engine), [AdapterSpec(path, 1.0)])
    assert reason in str(error.value)


def test_the_aliases_are_bfls_checkpoint_layout(setup):
    """The manifest's aliases assemble BFL's checkpoint from the diffusers weights: diffusers'
    own single-file conversion of it (`convert_flux2_transformer_checkpoint_to_diffusers`)
    gives back every linear weight."""
    from diffusers.loaders.single_file_utils import (
        convert_flux2_transformer_checkpoint_to_diffusers,
    )

    _, base, engine = setup
    weights = {name: tensor.detach().clone() for name, tensor in base.state_dict().items()}
    checkpoint = {
        f"{alias}.weight": torch.cat(
            [weights[f"{p.layer}.weight"][p.start : p.start + p.length] for p in pieces]
        )
        for alias, pieces in layer_aliases(engine.manifest()).items()
    }
    converted = convert_flux2_transformer_checkpoint_to_diffusers(checkpoint)
    linears = {t["name"] for t in engine.manifest()["tensors"] if len(t["shape"]) == 2}
    assert set(converted) == linears
    for name in linears:
        torch.testing.assert_close(converted[name], weights[name], rtol=0, atol=0)


def test_an_entrys_bfl_adapters_run_over_http_and_a_bad_file_is_400(tmp_path, setup):
    """A klein entry configured with a BFL-named LoRA (`[models."id"] adapters`): a step naming
    no table runs under it, as `--adapter` builds it; an entry whose file's fused pair has the
    wrong rows fails the load with 400 naming the model and the file, before the weights load."""
    from gmlx_contract.hashing import tensor_hash
    from gmlx_server.config import ModelSettings
    from gmlx_server.engine.base import StepRow

    from tests.lora.conftest import MODEL_ID
    from tests.lora.test_http import Server, out_of

    _, _, engine = setup
    root = tmp_path / "models"
    build_tiny_folder(root / MODEL_ID, family="flux2_klein")
    lora = random_lora(bfl_shapes(engine.manifest()), seed=29, alpha=2.0, layers=LAYERS)
    spec = AdapterSpec(bfl_file(tmp_path, lora, "comfy"), 0.8)
    cond, x, _ = inputs(30)
    live = Server(root, {MODEL_ID: ModelSettings(adapters=(spec,))})
    try:
        served = out_of(live.step(x, 0.6, live.upload("tensors", cond[None])))
        loaded = live.ctx.registry.loaded(MODEL_ID)
        row = StepRow(cond=cond, cond_key="wire:" + tensor_hash(cond[None]))

        def direct(table):
            return loaded.model.denoise_step(x, np.array([0.6], np.float32), [row], table=table).out

        worker = live.ctx.service.worker
        np.testing.assert_array_equal(
            served, worker.call(direct, worker.call(adapter_table, loaded, [spec]))
        )
        assert rel_l2(served, worker.call(direct, None)) > MOVES
    finally:
        live.close()

    bad = tmp_path / "bad-qkv.safetensors"
    rows = np.ones((64, 4), np.float32)
    stem = "diffusion_model.double_blocks.0.img_attn.qkv"
    save_file(
        {f"{stem}.lora_down.weight": np.ones((4, 64), np.float32), f"{stem}.lora_up.weight": rows},
        str(bad),
    )
    live = Server(root, {MODEL_ID: ModelSettings(adapters=(AdapterSpec(bad),))})
    try:
        r = live.step(x, 0.6, live.upload("tensors", cond[None]))
        assert r.status_code == 400, r.text
        message = r.json()["error"]
        assert MODEL_ID in message and "bad-qkv.safetensors" in message
        assert "up has 64 rows, the layer has 192" in message
        assert live.ctx.registry.loaded(MODEL_ID) is None
    finally:
        live.close()
