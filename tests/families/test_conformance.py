"""What every family served from a folder must do, checked the same way for each (the family's
own tests keep what is its own: parity against its reference pipeline). A family takes part
through a `conformance.py` in its test folder, found here by itself.

Each family's tiny folder is served over HTTP by the product registry, beside the same folder
under a DiT from a GGUF file and `gmlx model quantize`'s 4-bit copy. For each:

- the status read from the files is the loaded status, apart from what is held; each part
  holds the bytes its headers estimate (at most those, for the parts a case names); the
  memory row's file sizes agree and, loaded, its resident bytes are the arrays plus the
  reserve, and its activation reserve what it holds beyond the files;
- the manifest read from the files is the loaded manifest;
- the VAE routes round trip: an image to latents of the published channels at the VAE's
  stride, and back to an image of its sides;
- an image's reference latents are its VAE route latents in the step's model space, as the
  status's `vae` members take them there;
- the spec says what the status and the capabilities publish;
- an empty prompt encodes as the status's `empty_prompt`;
- parts of other widths than the DiT reads (text encoder, VAE) are refused, naming both;
- a step's dry run refuses the rows the step refuses (x's channels and sides, the
  conditioning's width, a reference's channels), in the same words;
- a stored quantized folder (the family's `quantized_files`) steps and encodes bit for bit as
  a quantized load of the float folder, and a quantized load (4 and 8 bits) steps, encodes
  and takes a LoRA table as the same networks on its weights dequantized;
- a LoRA table on fused and unfused layers steps as the checkpoint with it merged, and on a
  GGUF DiT as on its dequantized weights;
- a GGUF DiT steps as the same network on `gguf.quants.dequantize`'s weights;
- a truncated GGUF DiT is refused (400, naming the file) before the resident model goes, as
  are folders damaged in place (a DiT tensor of another shape than its config gives, a VAE
  file cut short, a text encoder file whose header holds no tensors), while a DiT tensor the
  config does not read loads and is named in the log;
- a released text encoder frees its weights, and the next encode loads it again with the
  same conditioning;
- the encoder and the VAE at the entry's `encoder_vae_dtype` bf16 stay within bf16's
  tolerance of float32, in about half the bytes, and the DiT keeps its own dtype.
"""

from __future__ import annotations

import gc
import importlib
import json
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gmlx_server.config import ImageConfig, ServerConfig
from gmlx_server.engine import file_headers
from gmlx_server.engine.family import LoadedParts
from gmlx_server.engine.gguf import READABLE
from gmlx_server.engine.load_settings import LoadSettings
from gmlx_server.engine.precision import Quantization
from gmlx_server.engine.quantize import BIASES, SCALES
from gmlx_server.engine.registry import ModelRegistry
from gmlx_server.engine.spec import family_specs
from gmlx_server.engine.weights import quantize_folder
from safetensors.numpy import load_file, save_file

from tests.compare import rel_l2
from tests.contract.frames import frame
from tests.engine.gguf_files import encoded, reference, write_gguf
from tests.lora.over_http import lora_table, put_table
from tests.server.conftest import answer_tensors, out_of, serve

TOLERANCE = 1e-4
# bf16 keeps 8 significant bits (unit roundoff 2**-9, about 2e-3) and every weight and
# activation of the encoder and the VAE rounds to it, so their outputs move by a few units of
# roundoff a layer (measured on the embedded Qwen-Image 2.1, bench/lean_dtypes.py: 1.5e-2 for
# the conditioning, 0.8e-2 a decode, 1.2e-2 an encode). The bounds are about 3x those, far
# below a wrong network's (near 1); the floor shows the bf16 path ran (float32 against itself
# differs by about 1e-7).
BF16_ENCODE_TOLERANCE = 0.05
BF16_VAE_TOLERANCE = 0.03
BF16_FLOOR = 1e-4
HERE = Path(__file__).resolve().parent
# The status's `vae` members that take the VAE's own latents z to the step's model space.
LATENT_STATS = ("latents_mean", "latents_std")
# The quantized loads every case is checked at: the default, and 8 bits in groups of 32.
QUANTIZED = {"q4": Quantization(4), "q8": Quantization(8, 32)}


def cases() -> dict:
    """Every family's case, by family name: each test folder's `conformance.py` (FAMILY, the
    family's name; write_folder(folder), its tiny folder; FAMILY_OBJECT, the Family of a family
    of the tests alone, which the product's specs do not list; BF16_ENCODE_TOLERANCE, where the
    tiny encoder's bf16 is measured to need a wider bound than BF16_ENCODE_TOLERANCE;
    HELD_BELOW_ESTIMATE, the parts a load holds fewer bytes of than their headers say (none
    by default); LORA_LAYERS, the layers its LoRA table patches (file name less `.weight` -> band or None;
    default `patched_layers`))."""
    found = {}
    for folder in sorted(HERE.iterdir()):
        if (folder / "conformance.py").is_file():
            case = importlib.import_module(f"tests.families.{folder.name}.conformance")
            found[case.FAMILY] = case
    return found


CASES = cases()


def write_gguf_dit(transformer, path, dequantized) -> dict[str, int]:
    """The DiT's weights as a GGUF file in diffusers' names, its matrices of every type in
    turn (READABLE's, of those whose blocks divide the matrix's input: so q, k and v of one
    fused weight differ), its vectors F32, and into `dequantized` (a transformer/ folder) what
    the file holds, as gguf dequantizes it. Returns how many tensors of each type it holds."""
    weights = {}
    for file in sorted(transformer.glob("*.safetensors")):
        weights.update(load_file(file))
    rng = np.random.default_rng(0)
    tensors, held, counts = {}, {}, {}
    for index, (name, value) in enumerate(sorted(weights.items())):
        value = value.astype(np.float32)
        kind = T.F32
        if value.ndim == 2:
            fits = [k for k in READABLE if value.shape[1] % GGML_QUANT_SIZES[k][0] == 0]
            kind = fits[index % len(fits)]
        tensors[name] = (kind, encoded(kind, value, rng))
        held[name] = reference(kind, tensors[name][1]).reshape(value.shape)
        counts[kind.name] = counts.get(kind.name, 0) + 1
    write_gguf(path, tensors, arch=None)
    dequantized.mkdir(parents=True)
    shutil.copy(transformer / "config.json", dequantized / "config.json")
    save_file(held, str(dequantized / "diffusion_pytorch_model.safetensors"))
    return counts


def write_dequantized(stored: Path, out: Path) -> None:
    """`stored` (a `gmlx model quantize` folder) again in `out`, every quantized matrix
    dequantized to float32 (`mx.dequantize` of its packed weight, scales and biases at the
    recorded bits and group size): the same networks on the weights a quantized load holds."""
    shutil.copytree(stored, out)
    for config_file in out.glob("*/config.json"):
        component = config_file.parent
        config = json.loads(config_file.read_text())
        held = config.pop("quantization", None)
        if held is None:
            continue
        for shard in sorted(component.glob("*.safetensors")):
            tensors = load_file(shard)
            for scales in [n for n in tensors if n.endswith(SCALES)]:
                base = scales[: -len(SCALES)]
                weight = mx.dequantize(
                    *(
                        mx.array(tensors.pop(base + suffix))
                        for suffix in (".weight", SCALES, BIASES)
                    ),
                    group_size=held["group_size"],
                    bits=held["bits"],
                )
                tensors[base + ".weight"] = np.array(weight.astype(mx.float32))
            save_file(tensors, str(shard), metadata={"format": "pt"})
        for index in component.glob("*.safetensors.index.json"):
            doc = json.loads(index.read_text())
            kept = {n: f for n, f in doc["weight_map"].items() if not n.endswith((SCALES, BIASES))}
            index.write_text(json.dumps({**doc, "weight_map": kept}))
        config_file.write_text(json.dumps(config, indent=2))


def patched_layers(shapes: dict[str, tuple[int, ...]]) -> dict:
    """The layers a conformance table patches, by the DiT's file names (`shapes`: each
    weight's shape): q, k and v of the first block (parts of one fused weight) whole, and the
    first half of another layer's output rows."""
    qkv = [
        n
        for n in shapes
        if n.endswith((".to_q", ".to_k", ".to_v", ".proj.q", ".proj.k", ".proj.v"))
    ][:3]
    other = next(n for n in shapes if n.endswith((".to_out.0", ".to_out", ".proj.o")))
    return {**dict.fromkeys(qkv), other: [0, 0, shapes[other][0] // 2]}


def write_merged_dit(transformer, merged, deltas: dict[str, np.ndarray]) -> None:
    """`transformer`'s folder again in `merged` with `deltas` (file name less `.weight` ->
    whole-weight delta) added to its weights: what a checkpoint with the LoRA merged holds."""
    weights = {}
    for file in sorted(transformer.glob("*.safetensors")):
        weights.update(load_file(file))
    for layer, delta in deltas.items():
        weights[layer + ".weight"] = weights[layer + ".weight"] + delta
    merged.mkdir(parents=True)
    shutil.copy(transformer / "config.json", merged / "config.json")
    save_file(weights, str(merged / "diffusion_pytorch_model.safetensors"))


def dit_shapes(transformer) -> dict[str, tuple[int, ...]]:
    """The DiT file's matrices by name less `.weight`: their shapes."""
    shapes = {}
    for file in sorted(transformer.glob("*.safetensors")):
        shapes |= {n: s for n, s in file_headers.read(file).shapes.items() if len(s) == 2}
    return {name[: -len(".weight")]: shape for name, shape in shapes.items()}


# Each case's conformance LoRA: (table entries, adapters), kept while its server runs.
_LORA: dict[str, tuple[list, dict]] = {}


@pytest.fixture(scope="module", params=sorted(CASES))
def served(request, tmp_path_factory):
    """(server, family name): the family's folder as `plain`, `gguf` (its DiT from a GGUF
    file), `dequantized` (the GGUF's weights as safetensors), `q4` and `q8` (quantized at
    load, QUANTIZED), `stored` (`gmlx model quantize`'s 4-bit copy), `q4_dequantized` and
    `q8_dequantized` (the quantized weights dequantized, as safetensors), `merged` (its DiT
    with the case's LoRA merged) and `lean` (its encoder and VAE in bf16)."""
    name = request.param
    case = CASES[name]
    families = {**family_specs()}
    if hasattr(case, "FAMILY_OBJECT"):  # a family of the tests alone
        families[name] = case.FAMILY_OBJECT
    root = tmp_path_factory.mktemp(name)
    models = root / "models"
    plain = models / "plain"
    case.write_folder(plain)
    dequantized = models / "dequantized"
    shutil.copytree(plain, dequantized, ignore=shutil.ignore_patterns("transformer"))
    types = write_gguf_dit(plain / "transformer", root / "dit.gguf", dequantized / "transformer")
    print(f"{name}: GGUF DiT of {types}")
    merged = models / "merged"
    shutil.copytree(plain, merged, ignore=shutil.ignore_patterns("transformer"))
    shapes = dit_shapes(plain / "transformer")
    layers = getattr(case, "LORA_LAYERS", None) or patched_layers(shapes)
    entries, adapters, deltas = lora_table(shapes, layers, 3, 0.8, alpha=2.0)
    write_merged_dit(plain / "transformer", merged / "transformer", deltas)
    _LORA[name] = (entries, adapters)
    for alias in ("gguf", *QUANTIZED, "lean"):
        (models / alias).symlink_to(plain)
    family = ModelRegistry(extra_models=[plain], families=families).family(name)
    quantize_folder(plain, models / "stored", QUANTIZED["q4"], family.quantized_files(plain))
    write_dequantized(models / "stored", models / "q4_dequantized")
    quantize_folder(plain, root / "stored_q8", QUANTIZED["q8"], family.quantized_files(plain))
    write_dequantized(root / "stored_q8", models / "q8_dequantized")
    settings = {
        "gguf": LoadSettings(dit=root / "dit.gguf"),
        **{name: LoadSettings(quantization=q) for name, q in QUANTIZED.items()},
        "lean": LoadSettings(encoder_vae_dtype="bf16"),
    }
    registry = ModelRegistry(
        [models],
        "plain",
        families=families,
        max_resident=10,  # every model of the case stays loaded: no test reloads one
        settings=lambda m: settings.get(m, LoadSettings()),
    )
    config = replace(ServerConfig(host="127.0.0.1", port=0), model_dirs=[models])
    live = serve(replace(config, image=ImageConfig()), registry)
    yield live, name
    live.close()
    _ENCODED.clear()  # a later case's server may take this one's id
    _LORA.pop(name, None)


def status(live, model):
    r = live.call("GET", f"models/{model}/status")
    assert r.status_code == 200, r.text
    return r.json()


# Each model's encodings, kept while the case's server runs (`served` clears them): an encode is
# deterministic, and FLUX.2 klein's (a 512-token prompt through 27 layers) takes about a second
# on the CPU backend.
_ENCODED: dict[tuple[int, str, str], np.ndarray] = {}


def encoding(live, model: str, text: str) -> np.ndarray:
    key = (id(live), model, text)
    if key not in _ENCODED:
        _ENCODED[key] = answer_tensors(live.post_json("encode", {"model": model, "text": text}))[
            "cond"
        ]
    return _ENCODED[key]


def step(live, model, text="a red fox", table=None) -> np.ndarray:
    """One guided-looking step: two rows (the prompt and the empty prompt) at two sigmas,
    under the LoRA patch table `table` (an id) when given (a flow map's along a schedule)."""
    conds = [encoding(live, model, prompt) for prompt in (text, "")]
    published = status(live, model)
    channels = published["latent"]["channels"]
    x = np.random.default_rng(5).standard_normal((2, channels, 4, 6)).astype(np.float32)
    rows = [{"cond": live.put_tensor(cond)} for cond in conds]
    arrays = {"x": x, "timestep": np.array([0.8, 0.3], np.float32)}
    if published["sampling"].get("flow_map"):  # a flow map's step names its schedule
        arrays["sample_sigmas"] = np.array([1.0, 0.8, 0.55, 0.3, 0.0], np.float32)
    fields = {"model": model, "rows": rows, **({"patch_table": table} if table else {})}
    return out_of(live.post_container("step", arrays, fields))


def test_the_status_from_the_files_is_the_loaded_status(served):
    """Each part's residency as the headers estimate it (its bytes exactly; a part of the
    case's HELD_BELOW_ESTIMATE in at most the bytes estimated), and the memory row: the file
    sizes, the reserve and the resident bytes."""
    live, name = served
    held_below = getattr(CASES[name], "HELD_BELOW_ESTIMATE", ())
    for model in ("plain", "gguf", "stored"):
        live.post_json("models/unload", {"model": model})
        unloaded = status(live, model)
        assert live.post_json("models/load", {"model": model}).status_code == 200
        loaded = status(live, model)
        held = ("resident", "residency", "memory")
        assert {k: v for k, v in loaded.items() if k not in held} == {
            k: v for k, v in unloaded.items() if k not in held
        }, model
        assert loaded["resident"] is True and unloaded["resident"] is False
        for part, row in loaded["residency"].items():
            estimate = unloaded["residency"][part]
            assert row["resident"] and not estimate["resident"], (model, part)
            assert (row["dtype"], row["quantization"]) == (
                estimate["dtype"],
                estimate["quantization"],
            )
            if part in held_below:
                assert 0 < row["bytes"] <= estimate["bytes"], (model, part)
            else:
                assert row["bytes"] == estimate["bytes"], (model, part)
        files = ("dit_bytes", "encoder_bytes", "vae_bytes")
        assert {k: loaded["memory"][k] for k in files} == {k: unloaded["memory"][k] for k in files}
        assert all(loaded["memory"][k] > 0 for k in files), model
        held_model = live.ctx.registry.loaded(model).model
        reserve = live.ctx.registry.family(loaded["family"]).activation_reserve(
            held_model.model_dir, held_model.dit.dtype
        )
        assert reserve > 0 and unloaded["memory"]["resident_bytes"] == 0
        assert loaded["memory"]["resident_bytes"] == held_model.weight_bytes + reserve
        beyond_files = loaded["memory"]["resident_bytes"] - sum(loaded["memory"][k] for k in files)
        assert loaded["memory"]["activation_reserve_bytes"] == beyond_files, model
        live.post_json("models/unload", {"model": model})


def test_the_manifest_from_the_files_is_the_loaded_manifest(served):
    live, _ = served
    for model in ("plain", "gguf", "stored"):
        live.post_json("models/unload", {"model": model})
        unloaded = live.call("GET", f"models/{model}/manifest").json()
        live.post_json("models/load", {"model": model})
        assert live.call("GET", f"models/{model}/manifest").json() == unloaded, model
        assert unloaded["count"] == len(unloaded["tensors"]) > 0
        live.post_json("models/unload", {"model": model})


def test_a_released_encoder_frees_its_weights_and_loads_again_with_the_same_conditioning(served):
    """The text encoder's residency (`[server.image] encoder_residency`, server/memory.py):
    released, it frees its weights' memory, the status says so, and the next encode loads it
    again with the same conditioning."""
    live, _ = served
    assert live.post_json("models/load", {"model": "plain"}).status_code == 200
    model, worker = live.ctx.registry.loaded("plain").model, live.ctx.service.worker
    fields = {"model": "plain", "text": "a red fox"}
    first = answer_tensors(live.post_json("encode", fields))["cond"]
    encoder_bytes, all_bytes = model.encoder_bytes, model.weight_bytes

    def release() -> tuple[int, int]:
        gc.collect()
        before = mx.get_active_memory()
        released = model.release_encoder()
        gc.collect()
        return released, before - mx.get_active_memory()

    released, freed = worker.call(release)
    assert released == encoder_bytes > 0
    assert freed >= encoder_bytes
    assert not model.encoder_resident and model.weight_bytes == all_bytes - encoder_bytes
    assert status(live, "plain")["residency"]["encoder"]["resident"] is False
    assert worker.call(model.release_encoder) == 0  # released already
    again = answer_tensors(live.post_json("encode", fields))["cond"]
    assert model.encoder_resident and model.weight_bytes == all_bytes
    assert again.tobytes() == first.tobytes()


def test_the_vae_routes_round_trip_at_the_published_stride(served):
    """An image encodes to latents of the status's channels at the VAE's stride, and those
    decode to an image of its sides."""
    live, _ = served
    published = status(live, "plain")
    stride, channels = published["vae"]["stride"], published["latent"]["channels"]
    image = np.random.default_rng(2).random((1, 2 * stride, 3 * stride, 3)).astype(np.float32)
    latents = vae(live, "encode", "plain", image=image)["latents"]
    assert latents.shape == (1, channels, 2, 3)
    assert vae(live, "decode", "plain", latents=latents)["image"].shape == image.shape


def test_reference_latents_are_the_vae_routes_latents_in_the_steps_model_space(served):
    """An image's reference latents (what a step's `ref_latents` take) are its vae/encode
    latents brought into the step's model space as a client brings them with the status: as
    they are where `vae.space` is "model", else (z - latents_mean) / latents_std."""
    live, _ = served
    published = status(live, "plain")["vae"]
    stride = published["stride"]
    image = np.random.default_rng(4).integers(0, 256, (2 * stride, 3 * stride, 3), np.uint8)
    latents = vae(live, "encode", "plain", image=image[None].astype(np.float32) / 255)["latents"]
    if published.get("space") != "model":
        mean, std = (np.float32(published[k])[None, :, None, None] for k in LATENT_STATS)
        latents = (latents - mean) / std
    model, worker = live.ctx.registry.loaded("plain").model, live.ctx.service.worker
    references = worker.call(model.reference_latents, image)
    assert references.shape == latents.shape
    assert rel_l2(references, latents) < TOLERANCE


def test_an_empty_prompt_encodes_as_the_published_empty_prompt(served):
    """The status's `conditioning.empty_prompt` is what the encoder reads for an empty prompt
    (the pack sends it as it is)."""
    live, _ = served
    published = status(live, "plain")["conditioning"]["empty_prompt"]
    assert encoding(live, "plain", published).tobytes() == encoding(live, "plain", "").tobytes()


def test_the_spec_is_what_the_status_and_the_capabilities_say(served):
    live, name = served
    spec = live.ctx.registry.families[name]
    published = status(live, "plain")
    assert published["family"] == spec.name
    assert published["comfy"] == spec.comfy
    assert published["conditioning"] == spec.conditioning_status()
    assert published["edit_capable"] is spec.edit_capable
    assert published["latent"]["patch"] == spec.latent_patch
    assert {k: published["sampling"][k] for k in spec.sampling[published["variant"]]} == (
        spec.sampling[published["variant"]]
    )
    capabilities = live.call("GET", "capabilities", versioned=False).json()
    assert name in capabilities["families"]
    assert set(spec.features) <= set(capabilities["features"])
    live.post_json("models/load", {"model": "plain"})
    model = live.ctx.registry.loaded("plain").model
    assert tuple(model.capabilities.conventions) == spec.conventions
    assert model.capabilities.max_refs == spec.max_refs


def test_parts_that_do_not_fit_are_refused_naming_both_widths(served, tmp_path):
    """The family's `fits`: the folder's own parts fit; a text encoder of another width, or a
    VAE whose latents have other channels than the DiT takes (where the VAE's part names its
    latents), is refused with a ValueError naming both."""
    live, name = served
    live.post_json("models/load", {"model": "plain"})
    model = live.ctx.registry.loaded("plain").model
    family = live.ctx.registry.family(name)
    parts = LoadedParts(name, model.variant, model.dit, model.vae, model.encoder)
    family.fits(parts, model.model_dir)
    width = model.encoder.hidden_size
    wider = replace(parts, encoder=SimpleNamespace(hidden_size=width + 8))
    with pytest.raises(ValueError, match=f"{width + 8} wide; the DiT reads conditioning {width}"):
        family.fits(wider, model.model_dir)
    config = json.loads((model.model_dir / "vae" / "config.json").read_text())
    narrower = {k: v // 2 if k in ("latent_channels", "z_dim") else v for k, v in config.items()}
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text(json.dumps(narrower))
    named = family.vae.latent(narrower)
    if named is None:  # the VAE names no latents of its own: the DiT's are the status'
        family.fits(parts, tmp_path)
        return
    channels = model.dit.config.latent_channels
    with pytest.raises(ValueError, match=f"{named['channels']} channels; the DiT takes {channels}"):
        family.fits(parts, tmp_path)


def test_a_stored_quantized_folder_steps_as_a_quantized_load(served):
    """The weights `quantized_files` picks are the ones a quantized load quantizes: the
    stored folder's step and encode equal the 4-bit load's, bit for bit."""
    live, _ = served
    for model in ("stored", "q4"):
        live.post_json("models/load", {"model": model})
    np.testing.assert_array_equal(step(live, "stored"), step(live, "q4"))
    stored = status(live, "stored")["quantization"]
    assert stored == status(live, "q4")["quantization"]
    assert stored["dit"] is not None and stored["encoder"] is not None
    assert rel_l2(step(live, "q4"), step(live, "plain")) > 1e-4  # quantizing moved the step


@pytest.mark.parametrize("quantized", sorted(QUANTIZED))
def test_a_quantized_load_steps_and_encodes_as_its_dequantized_weights(served, quantized):
    """The quantized load's DiT and text encoder compute as the same networks in float32 on
    the weights it holds, dequantized (a stored folder's, which are the load's), a LoRA table
    on its quantized base as on the dequantized one."""
    live, name = served
    dequantized = quantized + "_dequantized"
    got = step(live, quantized)
    assert rel_l2(got, step(live, dequantized)) <= TOLERANCE
    assert rel_l2(got, step(live, "plain")) > 10 * TOLERANCE  # the quantization is real
    for text in ("a red fox", ""):
        expected = encoding(live, dequantized, text)
        assert rel_l2(encoding(live, quantized, text), expected) <= TOLERANCE, text
    assert status(live, dequantized)["quantization"]["dit"] is None
    entries, adapters = _LORA[name]
    outs = {}
    for model in (quantized, dequantized):
        r, table = put_table(live, model, entries, adapters)
        assert r.status_code == 200, r.text
        outs[model] = step(live, model, table=table)
    assert rel_l2(outs[quantized], outs[dequantized]) <= TOLERANCE
    assert rel_l2(outs[quantized], got) > 1e-3  # the table moved the step


def test_a_gguf_dit_steps_as_its_dequantized_weights(served):
    """Every type the DiT's widths allow, mixed within its fused weights: held as the file's
    blocks, at the file's bits a weight."""
    live, _ = served
    assert rel_l2(step(live, "gguf"), step(live, "dequantized")) <= TOLERANCE
    held = status(live, "gguf")["quantization"]["dit"]
    assert held["weights"] == "blocks" and held["bits_per_weight"] < 16
    assert len(held["types"]) >= 8


def test_a_lora_table_steps_as_the_checkpoint_with_it_merged(served):
    """A table on fused and unfused layers, whole and in bands (the case's `LORA_LAYERS`, else
    q, k and v of the first block and a band of another layer) steps as the folder whose DiT
    weights hold the same LoRA merged."""
    live, name = served
    entries, adapters = _LORA[name]
    r, table = put_table(live, "plain", entries, adapters)
    assert r.status_code == 200, r.text
    patched = step(live, "plain", table=table)
    assert rel_l2(patched, step(live, "merged")) <= TOLERANCE
    assert rel_l2(patched, step(live, "plain")) > 1e-3  # the table moved the step


def test_a_lora_table_on_a_gguf_dit_steps_as_on_its_dequantized_weights(served):
    """The pairs stay in float beside the file's blocks (the same table: fused weights of
    mixed types among its layers)."""
    live, name = served
    entries, adapters = _LORA[name]
    outs = {}
    for model in ("gguf", "dequantized"):
        r, table = put_table(live, model, entries, adapters)
        assert r.status_code == 200, r.text
        outs[model] = step(live, model, table=table)
    assert rel_l2(outs["gguf"], outs["dequantized"]) <= TOLERANCE
    assert rel_l2(outs["gguf"], step(live, "gguf")) > 1e-3  # the table moved the step


def test_a_truncated_gguf_dit_is_refused_before_the_resident_model_goes(served, tmp_path):
    live, name = served
    assert live.post_json("models/load", {"model": "plain"}).status_code == 200
    source = live.ctx.registry.settings_for(live.ctx.registry.resolve("gguf")).dit
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(source.read_bytes()[: source.stat().st_size // 2])
    registry = live.ctx.registry
    keep = registry.settings
    registry.settings = lambda m: LoadSettings(dit=cut) if m == "gguf" else keep(m)
    try:
        live.post_json("models/unload", {"model": "gguf"})
        r = live.post_json("models/load", {"model": "gguf"})
        assert r.status_code == 400 and str(cut) in r.text, r.text
        assert "plain" in registry.resident_ids()
    finally:
        registry.settings = keep


def copy_of_plain(registry, model_id: str) -> Path:
    """A fresh copy of the family's folder beside `plain`, served as `model_id`."""
    plain = registry.resolve("plain").path
    target = plain.parent / model_id
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(plain, target)
    return target


def _damaged_copies(registry, name: str) -> dict:
    """Copies of the family's folder beside `plain`, each damaged one way, by model id: the
    refusal's words each must name."""
    made = {}
    folder = copy_of_plain(registry, "narrow-dit")
    family = registry.family(name)
    config = family.dit.config.from_dict(
        json.loads((folder / "transformer" / "config.json").read_text())
    )
    tensor = next(n for n, s in family.dit.tensor_shapes(config).items() if len(s) == 2)
    for path in sorted((folder / "transformer").glob("*.safetensors")):
        state = load_file(str(path))
        if tensor in state:
            state[tensor] = state[tensor][: state[tensor].shape[0] // 2]
            save_file(state, str(path))
    made["narrow-dit"] = ("transformer", f"tensor {tensor} has shape")
    folder = copy_of_plain(registry, "cut-vae")
    (path,) = sorted((folder / "vae").glob("*.safetensors"))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    made["cut-vae"] = (str(path), "cut short")
    folder = copy_of_plain(registry, "list-header-encoder")
    path = sorted((folder / "text_encoder").glob("*.safetensors"))[0]
    path.write_bytes(frame([1, 2, 3]))
    made["list-header-encoder"] = (str(path), "not a JSON object of tensors")
    return made


def test_a_damaged_folder_is_refused_before_the_resident_model_goes(served):
    """A DiT tensor of another shape than the config gives, a VAE file cut short, a text
    encoder file whose header is no object of tensors: each load is refused 400, naming the
    file or the tensor, and the resident model stays."""
    live, name = served
    registry = live.ctx.registry
    assert live.post_json("models/load", {"model": "plain"}).status_code == 200
    for model_id, words in _damaged_copies(registry, name).items():
        for route in ("models/load", "encode"):
            body = {"model": model_id, **({"text": "a boat"} if route == "encode" else {})}
            r = live.post_json(route, body)
            assert r.status_code == 400 and all(w in r.text for w in words), (model_id, r.text)
        status = live.call("GET", f"models/{model_id}/status")
        assert status.status_code in (200, 400), (model_id, status.text)
        assert "plain" in registry.resident_ids(), model_id


def test_a_conditioning_of_another_width_is_refused_saying_where_it_came_from(served):
    """A prompt encoded by another model's text encoder (one column wider): the step is
    refused 400 naming the row, both widths and the fix."""
    live, _ = served
    cond = encoding(live, "plain", "a red fox")
    wider = np.concatenate([cond, cond[..., :1]], axis=-1)
    published = status(live, "plain")
    x = np.zeros((1, published["latent"]["channels"], 4, 6), np.float32)
    arrays = {"x": x, "timestep": np.array([0.5], np.float32)}
    if published["sampling"].get("flow_map"):
        arrays["sample_sigmas"] = np.array([1.0, 0.5, 0.0], np.float32)
    fields = {"model": "plain", "rows": [{"cond": live.put_tensor(wider)}]}
    r = live.post_container("step", arrays, fields)
    width = cond.shape[-1]
    assert r.status_code == 400, r.text
    said = r.json()["error"]
    assert f"rows[0]: conditioning must be (1, L, {width})" in said, said
    assert f"one {width + 1} wide is another model's text encoder's" in said, said


def test_a_dry_run_refuses_the_rows_the_step_refuses(served):
    """x of other channels (or of sides no multiple of the patch), a conditioning of another
    width, a reference of other channels: the step's `dry_run` answers the same 400 as the step
    (docs/contract.md §2.11: it runs the same checks)."""
    live, _ = served
    published = status(live, "plain")
    channels, patch = published["latent"]["channels"], published["latent"]["patch"]
    cond = encoding(live, "plain", "a red fox")
    x = np.zeros((1, channels, 2 * patch, 2 * patch), np.float32)
    cases = {
        "x channels": (np.zeros((1, channels + 1, 2 * patch, 2 * patch), np.float32), cond, []),
        "cond width": (x, cond[..., :-1], []),
    }
    if patch > 1:
        cases["x sides"] = (np.zeros((1, channels, patch + 1, 2 * patch), np.float32), cond, [])
    if published["edit_capable"]:
        cases["reference"] = (x, cond, [np.zeros((1, channels + 1, 2, 2), np.float32)])
    for case, (latents, conditioning, refs) in cases.items():
        arrays = {"x": latents, "timestep": np.array([0.5], np.float32)}
        if published["sampling"].get("flow_map"):
            arrays["sample_sigmas"] = np.array([1.0, 0.5, 0.0], np.float32)
        row = {"cond": live.put_tensor(conditioning)}
        if refs:
            row["ref_latents"] = [live.put_tensor(ref) for ref in refs]
        fields = {"model": "plain", "rows": [row]}
        dry = live.post_container("step", arrays, {**fields, "dry_run": True})
        real = live.post_container("step", arrays, fields)
        assert (dry.status_code, real.status_code) == (400, 400), (case, dry.text, real.text)
        assert dry.json() == real.json(), case


def test_a_tokenizer_missing_or_unreadable_is_refused_naming_it(served):
    live, _ = served
    for model_id, damage, status in (
        ("no-tokenizer", Path.unlink, 404),
        ("bad-tokenizer", "{", 400),
    ):
        folder = copy_of_plain(live.ctx.registry, model_id)
        (path,) = [p for p in folder.rglob("tokenizer.json") if "text_encoder" not in p.parts]
        if callable(damage):
            damage(path)
        else:
            path.write_text(damage)
        r = live.post_json("models/load", {"model": model_id})
        assert r.status_code == status and str(path) in r.text, (model_id, r.text)


def test_a_dit_tensor_its_config_does_not_read_is_said_in_the_log(served, caplog):
    """A tensor no forward reads (a config naming fewer blocks than its weights hold, or a
    release's stray tensor) loads, and the log names it."""
    live, _ = served
    folder = copy_of_plain(live.ctx.registry, "unread-tensor")
    path = sorted((folder / "transformer").glob("*.safetensors"))[0]
    state = load_file(str(path))
    save_file({**state, "unread.weight": np.zeros((2, 2), np.float32)}, str(path))
    with caplog.at_level("WARNING", logger="gmlx.server"):
        assert live.post_json("models/load", {"model": "unread-tensor"}).status_code == 200
    said = [r.getMessage() for r in caplog.records if "does not read" in r.getMessage()]
    assert len(said) == 1 and "1 tensors" in said[0] and "unread.weight" in said[0], said
    live.post_json("models/unload", {"model": "unread-tensor"})


def test_the_encoder_and_the_vae_in_bf16_stay_within_its_tolerance(served):
    """`encoder_vae_dtype` bf16 (float32 is the CPU backend's rule, so the bf16 path is run
    by the setting): the conditioning, a decode and an encode within bf16's tolerance of
    float32, the encoder and the VAE in about half the bytes (a few float32 statistics may
    stay), the DiT as it was."""
    live, name = served
    encode_tolerance = getattr(CASES[name], "BF16_ENCODE_TOLERANCE", BF16_ENCODE_TOLERANCE)
    for model in ("plain", "lean"):
        assert live.post_json("models/load", {"model": model}).status_code == 200
    plain, lean = status(live, "plain")["residency"], status(live, "lean")["residency"]
    assert {part: row["dtype"] for part, row in plain.items()} == dict.fromkeys(plain, "f32")
    assert {part: row["dtype"] for part, row in lean.items()} == {
        **dict.fromkeys(lean, "bf16"),
        "dit": plain["dit"]["dtype"],
    }
    assert lean["dit"]["bytes"] == plain["dit"]["bytes"]
    for part in ("encoder", "vae"):
        assert plain[part]["bytes"] * 0.5 <= lean[part]["bytes"] <= plain[part]["bytes"] * 0.51
    want, got = encoding(live, "plain", "a red fox"), encoding(live, "lean", "a red fox")
    assert got.dtype == np.float32 and got.shape == want.shape
    assert BF16_FLOOR < rel_l2(got, want) <= encode_tolerance
    channels = status(live, "plain")["latent"]["channels"]
    latents = np.random.default_rng(3).standard_normal((1, channels, 4, 6)).astype(np.float32)
    decoded = [vae(live, "decode", model, latents=latents)["image"] for model in ("plain", "lean")]
    assert BF16_FLOOR < rel_l2(decoded[1], decoded[0]) <= BF16_VAE_TOLERANCE
    image = np.random.default_rng(4).random(decoded[0].shape).astype(np.float32)
    encoded = [vae(live, "encode", model, image=image)["latents"] for model in ("plain", "lean")]
    assert encoded[0].shape == latents.shape
    assert BF16_FLOOR < rel_l2(encoded[1], encoded[0]) <= BF16_VAE_TOLERANCE


def vae(live, route: str, model: str, **arrays) -> dict:
    return answer_tensors(live.post_container(f"vae/{route}", arrays, {"model": model}))
