"""Qwen-Image 2.1's DiT from a GGUF file (a transformer/ folder's one `.gguf`, or a model
entry's `dit` elsewhere): for every GGUF type the server reads, the step equals the same
networks run in float32 with the weights `gguf.quants.dequantize` gives (relative L2 <= 1e-4;
the types with no exact MLX form equal their own dequantized weights' networks, and stay
within their measured distance of gguf's); prefixed names, ComfyUI's fused `gate_up`,
orig_shape and mixed widths in one fused weight; status, manifest and memory; and the
refusals over HTTP (a file of another family, one cut short, a tensor of the wrong shape),
each naming the file and the tensor with the resident model still loaded."""

from __future__ import annotations

import json
import re
import shutil

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gmlx_server.config import ModelSettings, ServerConfig
from gmlx_server.engine.embedded import DIFFUSERS_WEIGHTS, draw
from gmlx_server.engine.families.qwen_image21 import embedded, family
from gmlx_server.engine.families.qwen_image21.dit import (
    BLOCK_PREFIX,
    DiTConfig,
    QwenImage21DiT,
    dit_file,
    linear_slots,
    tensor_shapes,
)
from gmlx_server.engine.families.qwen_image21.embedded import ensure_embedded_model
from gmlx_server.engine.family import LoadedParts
from gmlx_server.engine.ggml_blocks import LAYOUT, BlockLayout
from gmlx_server.engine.gguf import HELD_SETTING, READABLE
from gmlx_server.engine.gguf_affine import EXACT, NEAREST
from gmlx_server.engine.registry import ModelRegistry
from safetensors.numpy import save_file

from tests.compare import rel_l2
from tests.engine.gguf_files import write_dit, write_gguf
from tests.engine.quantized import dequantized_tree
from tests.families.qwen_image21.test_quantized import latents, rows_of
from tests.server.conftest import serve

TOLERANCE = 1e-4
# Wide enough that every block linear's input (256 and 768) takes a K-quant's 256-blocks.
CONFIG = {**embedded.TRANSFORMER_CONFIG, "attention_head_dim": 128, "axes_dims_rope": [32, 48, 48]}
TYPES = list(READABLE)
# The step's distance from the gguf-dequantized networks' for the types the affine setting
# quantizes again (docs/benchmarks.md, "GGUF types", at the step).
NEAREST_STEP_BOUND = {T.Q6_K: 0.005, T.Q3_K: 0.03, T.Q2_K: 0.03}
GATE_UP = "img_mlp.gate_up.weight"


def draw_weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    return draw(
        embedded.transformer_tensors(config),
        np.random.default_rng(seed),
        embedded.CONSTANT_NOISE,
    )


def types_for(kind: T, config: dict) -> dict[str, T]:
    """`kind` for the blocks' linears; the other linears Q8_0 (a float kind: `kind`), the norms
    F32: a mixed file, as real conversions are."""
    dit_config = DiTConfig.from_dict(config)
    types = {}
    for name, shape in tensor_shapes(dit_config).items():
        if len(shape) == 1:
            continue
        block = name.startswith("transformer_blocks.")
        types[name] = kind if block or kind in (T.F16, T.BF16) else T.Q8_0
    return types


def type_counts(types: dict[str, T], config: dict) -> dict[str, int]:
    """How many tensors of each type the file of `types` holds (unnamed ones: F32)."""
    counts: dict[str, int] = {}
    for name in tensor_shapes(DiTConfig.from_dict(config)):
        kind = types.get(name, T.F32).name
        counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items()))


def model_folder(base, target, config: dict) -> None:
    """A copy of the embedded folder whose transformer/ holds `config` and no weights yet."""
    shutil.copytree(base, target, ignore=shutil.ignore_patterns("transformer"))
    (target / "transformer").mkdir()
    (target / "transformer" / "config.json").write_text(json.dumps(config))


def reference_folder(base, target, held: dict[str, np.ndarray], config=CONFIG):
    """The same model with the file's weights as gguf dequantizes them, in float32 safetensors."""
    model_folder(base, target, config)
    weights = {name: np.ascontiguousarray(value, np.float32) for name, value in held.items()}
    save_file(weights, str(target / "transformer" / DIFFUSERS_WEIGHTS))
    return target


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return ensure_embedded_model(tmp_path_factory.mktemp("embedded"))


def gguf_model(base, root, kind: T, **write):
    """(folder with a GGUF DiT of `kind`, its float reference folder)."""
    folder = root / f"gguf-{kind.name}"
    model_folder(base, folder, CONFIG)
    rng = np.random.default_rng(int(kind))
    weights = draw_weights(CONFIG, int(kind))
    path = folder / "transformer" / "dit.gguf"
    held = write_dit(path, weights, types_for(kind, CONFIG), rng, **write)
    return folder, reference_folder(base, root / f"reference-{kind.name}", held)


@pytest.fixture(scope="module")
def cond_rows(base):
    model = family.QWEN_IMAGE21.load(base, "encoder")
    return rows_of(model.encode("a red boat at dawn", [], refs=False))


def step(model, rows, seed=2):
    x, sigma = latents(seed), np.array([0.7], np.float32)
    return model.denoise_step(x, sigma, rows).out


def dequantized_model(model: family.QwenImage21Model, folder) -> family.QwenImage21Model:
    dit = model.dit
    plain = QwenImage21DiT(dit.config, dequantized_tree(dit.weights), dit.dtype)
    parts = LoadedParts(model.family, model.variant, plain, model.vae, model.encoder)
    return family.QWEN_IMAGE21.build(folder, "plain", parts)


@pytest.mark.parametrize("kind", TYPES, ids=lambda kind: kind.name)
def test_step_equals_the_dequantized_weights_networks(kind, base, tmp_path, cond_rows):
    folder, reference = gguf_model(base, tmp_path, kind)
    model = family.QWEN_IMAGE21.load(folder, "gguf")
    expected = step(family.QWEN_IMAGE21.load(reference, "reference"), cond_rows)
    assert rel_l2(step(model, cond_rows), expected) <= TOLERANCE
    block = model.dit.weights["blocks"][0]
    if kind in EXACT or kind in NEAREST:
        assert block["qkv"].dtype == mx.uint8  # held as the file's blocks, never as float
    status = model.status()["quantization"]["dit"]
    assert status["format"] == "gguf" and status["file"] == "dit.gguf"
    assert status["types"] == type_counts(types_for(kind, CONFIG), CONFIG)
    assert status["weights"] == "blocks"
    assert status == family.QWEN_IMAGE21.describe(folder)["quantization"]["dit"]


def test_a_file_mixing_every_type_steps_as_its_dequantized_weights(base, tmp_path, cond_rows):
    """Every type in one file, in turn over the matrices, so each fused q/k/v and gate/up mixes
    types (random K-quant blocks: every sub-block's scale its own)."""
    folder = tmp_path / "mixed"
    model_folder(base, folder, CONFIG)
    weights = draw_weights(CONFIG, 11)
    matrices = sorted(name for name, value in weights.items() if value.ndim == 2)
    types = {name: TYPES[index % len(TYPES)] for index, name in enumerate(matrices)}
    held = write_dit(folder / "transformer" / "dit.gguf", weights, types, np.random.default_rng(12))
    reference = reference_folder(base, tmp_path / "reference", held)
    model = family.QWEN_IMAGE21.load(folder, "mixed")
    expected = step(family.QWEN_IMAGE21.load(reference, "reference"), cond_rows)
    assert rel_l2(step(model, cond_rows), expected) <= TOLERANCE
    assert set(model.status()["quantization"]["dit"]["types"]) == {kind.name for kind in TYPES}
    mixed = [BlockLayout.of(b["qkv" + LAYOUT]).types for b in model.dit.weights["blocks"]]
    assert all(len(kinds) > 1 for kinds in mixed)


@pytest.mark.parametrize("kind", [T.Q4_K, T.Q6_K], ids=lambda kind: kind.name)
def test_the_affine_setting_holds_mlx_quantization(kind, base, tmp_path, cond_rows, monkeypatch):
    """`GMLX_GGUF_WEIGHTS=affine`: MLX's affine form, exact for Q4_K and quantized again (two
    bits wider) for Q6_K."""
    monkeypatch.setenv(HELD_SETTING, "affine")
    folder, reference = gguf_model(base, tmp_path, kind)
    model = family.QWEN_IMAGE21.load(folder, "gguf")
    expected = step(family.QWEN_IMAGE21.load(reference, "reference"), cond_rows)
    got = step(model, cond_rows)
    assert model.dit.weights["blocks"][0]["qkv"].dtype == mx.uint32
    if kind in NEAREST:
        # exactly the networks of its own (MLX) weights, near gguf's
        assert rel_l2(got, step(dequantized_model(model, folder), cond_rows)) <= TOLERANCE
        assert TOLERANCE < rel_l2(got, expected) <= NEAREST_STEP_BOUND[kind]
    else:
        assert rel_l2(got, expected) <= TOLERANCE
    status = model.status()["quantization"]["dit"]
    assert status["weights"] == "affine"
    assert status == family.QWEN_IMAGE21.describe(folder)["quantization"]["dit"]
    monkeypatch.delenv(HELD_SETTING)
    blocks = family.QWEN_IMAGE21.describe(folder)["quantization"]["dit"]
    if kind in EXACT:  # float32 scale and bias per 32 weights over the file's blocks
        assert status["bits_per_weight"] == blocks["bits_per_weight"] + 1.5


def test_prefixes_fused_gate_up_orig_shape_and_mixed_widths(base, tmp_path, cond_rows):
    """ComfyUI's form of a file: `model.diffusion_model.` names, the SwiGLU's gate and up as one
    `gate_up` weight, img_in flattened to rows of 256; and one fused q/k/v whose parts are of
    three types (each part's blocks held as they are)."""
    weights = draw_weights(CONFIG, 5)
    types = types_for(T.Q4_K, CONFIG)
    p = BLOCK_PREFIX.format(0)
    types[p + "attn.to_k.weight"] = T.Q8_0
    types[p + "attn.to_v.weight"] = T.Q5_0
    fused = {
        BLOCK_PREFIX.format(i) + GATE_UP: (
            BLOCK_PREFIX.format(i) + "img_mlp.gate_layer.weight",
            BLOCK_PREFIX.format(i) + "img_mlp.proj.weight",
        )
        for i in range(CONFIG["num_layers"])
    }
    folder = tmp_path / "comfy"
    model_folder(base, folder, CONFIG)
    held = write_dit(
        folder / "transformer" / "dit.gguf",
        weights,
        types,
        np.random.default_rng(6),
        prefix="model.diffusion_model.",
        fused=fused,
        flattened=("img_in.weight",),
    )
    reference = reference_folder(base, tmp_path / "reference", held)
    model = family.QWEN_IMAGE21.load(folder, "comfy")
    layout = BlockLayout.of(model.dit.weights["blocks"][0]["qkv" + LAYOUT])
    assert layout.runs == ((T.Q4_K, 256), (T.Q8_0, 256), (T.Q5_0, 256))
    expected = step(family.QWEN_IMAGE21.load(reference, "reference"), cond_rows)
    assert rel_l2(step(model, cond_rows), expected) <= TOLERANCE
    # the manifest names the diffusers tensors with their logical shapes
    manifest, plain = model.manifest(), family.QWEN_IMAGE21.manifest(reference)
    assert [(t["name"], t["shape"]) for t in manifest["tensors"]] == [
        (t["name"], t["shape"]) for t in plain["tensors"]
    ]
    dtypes = {t["name"]: t["dtype"] for t in manifest["tensors"]}
    assert dtypes[p + "img_mlp.gate_layer.weight"] == "quant"
    assert dtypes[p + "attn.norm_q.weight"] == "f32"
    assert manifest == family.QWEN_IMAGE21.manifest(folder)


def test_memory_counts_the_held_blocks(base, tmp_path):
    folder, reference = gguf_model(base, tmp_path, T.Q4_K)
    model, plain = (
        family.QWEN_IMAGE21.load(folder, "gguf"),
        family.QWEN_IMAGE21.load(reference, "float"),
    )
    assert model.dit.weight_bytes < 0.5 * plain.dit.weight_bytes
    # no bigger than the file's tensors
    stored = dit_file(folder / "transformer").stored_bytes()
    assert stored <= model.dit.weight_bytes <= 1.01 * stored, model.dit.weight_bytes / stored
    memory = model.status()["memory"]
    gguf_bytes = (folder / "transformer" / "dit.gguf").stat().st_size
    assert 0.9 * gguf_bytes < memory["dit_bytes"] <= gguf_bytes
    # the estimate for the folder unloaded counts the DiT as it loads
    dtype = model.dit.dtype
    assert dit_file(folder / "transformer").estimated_bytes(dtype.size) == model.dit.weight_bytes
    estimate = family.QWEN_IMAGE21.estimated_weight_bytes(folder, dtype) - model.weight_bytes
    assert (
        estimate
        == family.QWEN_IMAGE21.estimated_weight_bytes(reference, dtype) - plain.weight_bytes
    )


# ---------------------------------------------------------------------------------------------
# A model entry's `dit`, and the refusals


def bad_files(base, root):
    """Folders whose DiT file the family refuses, and what the refusal must name."""
    rng = np.random.default_rng(9)
    # another family's file: FLUX.1's names, ComfyUI-GGUF's architecture string
    flux = root / "flux"
    model_folder(base, flux, CONFIG)
    tensors = {"double_blocks.0.img_attn.proj.weight": (T.F16, np.ones((256, 256), np.float16))}
    write_gguf(flux / "transformer" / "flux.gguf", tensors, arch="flux")
    # a file cut short
    cut = root / "cut"
    model_folder(base, cut, CONFIG)
    path = cut / "transformer" / "cut.gguf"
    write_dit(path, draw_weights(CONFIG, 1), types_for(T.Q8_0, CONFIG), rng)
    path.write_bytes(path.read_bytes()[:-4096])
    # a file of another width than the config's (mlp_ratio 4 against 3)
    wrong = root / "wrong"
    model_folder(base, wrong, CONFIG)
    wider = {**CONFIG, "mlp_ratio": 4}
    write_dit(wrong / "transformer" / "wide.gguf", draw_weights(wider, 2), {}, rng)
    return {
        "flux": r"flux\.gguf is not a Qwen-Image 2\.1 DiT \(its architecture: flux\): it has no"
        r" tensor time_text_embed\.timestep_embedder\.linear_1\.weight",
        "cut": r"cut\.gguf is not a readable GGUF file: it is cut short: tensor"
        r" txt_in\.out_layer\.weight ends at byte",  # the last tensor written
        "wrong": r"wide\.gguf: tensor transformer_blocks\.0\.img_mlp\.(gate_layer|proj)\.weight"
        r" has shape \[1024, 256\] where Qwen-Image 2\.1's config gives",
    }


def test_refusals_name_the_file_and_tensor_and_keep_the_loaded_model(base, tmp_path):
    root = tmp_path / "models"
    root.mkdir()
    good, _ = gguf_model(base, tmp_path, T.Q4_K)
    shutil.copytree(good, root / "good")
    expected = bad_files(base, root)
    registry = ModelRegistry([root], "good")
    server = serve(ServerConfig(host="127.0.0.1", port=0), registry)
    try:
        assert server.post_json("models/load", {"model": "good"}).status_code == 200
        for model_id, message in expected.items():
            answer = server.post_json("models/load", {"model": model_id})
            assert answer.status_code == 400, answer.text
            assert re.search(message, answer.json()["error"]), answer.text
            assert registry.loaded("good") is not None, model_id  # nothing was evicted
            assert registry.loaded(model_id) is None
    finally:
        server.close()


def test_a_model_entrys_dit_file_replaces_the_folders_weights(base, tmp_path, cond_rows):
    folder, reference = gguf_model(base, tmp_path, T.Q5_K)
    elsewhere = tmp_path / "gguf" / "qwen-image-2.1-Q5_K.gguf"
    elsewhere.parent.mkdir()
    shutil.move(folder / "transformer" / "dit.gguf", elsewhere)
    config = ServerConfig(host="127.0.0.1", port=0)
    config.models[reference.name] = ModelSettings(dit=elsewhere)
    registry = ModelRegistry(
        [], reference.name, extra_models=[reference], settings=config.load_settings_for
    )
    server = serve(config, registry)
    try:
        name = reference.name
        before = server.call("GET", f"models/{name}/status").json()
        assert before["quantization"]["dit"]["file"] == elsewhere.name
        unloaded = server.call("GET", f"models/{name}/manifest").json()
        assert server.post_json("models/load", {"model": name}).status_code == 200
        loaded = registry.loaded(name).model
        types = loaded.status()["quantization"]["dit"]["types"]
        assert types == type_counts(types_for(T.Q5_K, CONFIG), CONFIG)
        assert server.call("GET", f"models/{name}/manifest").json() == unloaded
        # the folder's own safetensors hold gguf's dequantized weights: the same step
        expected = step(family.QWEN_IMAGE21.load(reference, "float"), cond_rows)
        got = server.ctx.service.worker.call(step, loaded, cond_rows)  # MLX's own thread
        assert rel_l2(got, expected) <= TOLERANCE
    finally:
        server.close()


def test_the_family_refuses_a_dit_file_for_a_folder_it_cannot_read(base, tmp_path):
    folder, _ = gguf_model(base, tmp_path, T.Q8_0)
    extra = folder / "transformer" / "second.gguf"
    shutil.copy(folder / "transformer" / "dit.gguf", extra)
    with pytest.raises(ValueError, match="more than one GGUF file"):
        family.QWEN_IMAGE21.check(folder)
    assert len(linear_slots(DiTConfig.from_dict(CONFIG))) == 8 + 2 * 7


def test_the_qwen3_vl_gguf_pair_comes_whole(base):
    with pytest.raises(ValueError, match="mmproj is set without text_encoder"):
        family.QWEN_IMAGE21.check(base, mmproj=base / "mmproj.gguf")
    with pytest.raises(ValueError, match="text_encoder is set without mmproj"):
        family.QWEN_IMAGE21.check(base, text_encoder=base / "model.gguf")
