"""LoRA files for the in-process sampler (gmlx_server.lora_files): each key form read from a
safetensors file, against peft on the same LoRA; stacking; refusals; the CLI flags."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from gmlx_contract import wire
from gmlx_server.lora_files import AdapterSpec, adapter_spec, adapter_table

from tests.compare import rel_l2
from tests.families.qwen_image21.dit.reference import reference_row
from tests.lora.forms import FORMS, Lora, random_lora, write_form, write_lora_file
from tests.lora.reference import engine_step, layer_shapes, peft_model, plain_model

TOLERANCE = 1e-4
MOVES = 0.05  # a LoRA that did nothing fails the test


@pytest.fixture(scope="module")
def shapes(tiny_folder):
    return layer_shapes(plain_model(tiny_folder[1]))


def loaded(engine):
    return SimpleNamespace(model_id=engine.model_id, model=engine)


def inputs(engine, seed: int):
    config = engine.dit.config
    rng = np.random.default_rng(seed)
    cond = rng.standard_normal((6, config.context_in_dim)).astype(np.float32)
    x = rng.standard_normal((config.in_channels, 4, 4)).astype(np.float32)
    return cond, x


@pytest.mark.parametrize("form", FORMS)
def test_a_file_in_each_key_form_runs_as_peft_does(tmp_path, tiny_folder, engine, shapes, form):
    lora = random_lora(shapes, seed=11, alpha=None if form == "diffusers" else 8.0)
    table = adapter_table(loaded(engine), [AdapterSpec(write_lora_file(tmp_path, lora, form), 0.7)])
    cond, x = inputs(engine, 12)
    ours = engine_step(engine, cond, x, 0.6, table)
    theirs = reference_row(peft_model(tiny_folder[1], [(lora, 0.7)]), cond, x, 0.6, [], [])
    assert rel_l2(ours, theirs) <= TOLERANCE
    assert rel_l2(ours, engine_step(engine, cond, x, 0.6)) > MOVES


def test_files_stack_at_their_strengths(tmp_path, tiny_folder, engine, shapes):
    first = random_lora(shapes, seed=13, alpha=4.0)
    second = random_lora(shapes, seed=14, alpha=16.0, rank=8, layers=sorted(shapes)[::2])
    specs = [
        AdapterSpec(write_lora_file(tmp_path, first, "kohya"), 0.8),
        AdapterSpec(write_lora_file(tmp_path, second, "comfy"), -0.35),
    ]
    table = adapter_table(loaded(engine), specs)
    cond, x = inputs(engine, 15)
    reference = peft_model(tiny_folder[1], [(first, 0.8), (second, -0.35)])
    ours = engine_step(engine, cond, x, 0.4, table)
    assert rel_l2(ours, reference_row(reference, cond, x, 0.4, [], [])) <= TOLERANCE


def diffusers_file(tmp_path, lora, config: dict, name="pytorch_lora_weights.safetensors"):
    """The LoRA as diffusers' `save_lora_weights` writes it: transformer.-prefixed pairs and the
    LoraConfig in the metadata, its keys prefixed too."""
    from safetensors.numpy import save_file

    metadata = {f"transformer.{key}": value for key, value in config.items()}
    path = tmp_path / name
    save_file(
        write_form(lora, "diffusers"),
        str(path),
        metadata={"format": "pt", "lora_adapter_metadata": json.dumps(metadata)},
    )
    return path


@pytest.mark.parametrize(
    "config",
    [
        {"r": 4, "lora_alpha": 12, "alpha_pattern": {"img_in": 2, "attn.to_k": 6}},
        {"r": 4, "lora_alpha": 3, "use_rslora": True},
    ],
)
def test_a_diffusers_file_scales_by_its_saved_config_as_diffusers_loads_it(
    tmp_path, tiny_folder, engine, shapes, config
):
    """The reference is diffusers' own loader on the same file (`load_lora_adapter`)."""
    lora = random_lora(shapes, seed=21, alpha=None)
    path = diffusers_file(tmp_path, lora, {**config, "target_modules": sorted(lora.pairs)})
    table = adapter_table(loaded(engine), [AdapterSpec(path, 0.6)])
    reference = plain_model(tiny_folder[1])
    reference.load_lora_adapter(
        str(tmp_path), weight_name=path.name, prefix="transformer", adapter_name="file"
    )
    reference.set_adapters(["file"], weights=[0.6])
    cond, x = inputs(engine, 22)
    ours = engine_step(engine, cond, x, 0.5, table)
    assert rel_l2(ours, reference_row(reference, cond, x, 0.5, [], [])) <= TOLERANCE
    at_scale_one = adapter_table(
        loaded(engine), [AdapterSpec(write_lora_file(tmp_path, lora, "diffusers"), 0.6)]
    )
    assert rel_l2(ours, engine_step(engine, cond, x, 0.5, at_scale_one)) > MOVES


def test_a_file_saved_by_the_models_own_save_lora_adapter(tmp_path, tiny_folder, engine, shapes):
    """diffusers' `save_lora_adapter` writes bare keys and a bare LoraConfig in the metadata
    (no `transformer.` prefix on either)."""
    lora = random_lora(shapes, seed=25, alpha=10.0)
    reference = peft_model(tiny_folder[1], [(lora, 1.0)])
    reference.save_lora_adapter(str(tmp_path), adapter_name="lora0")
    (path,) = tmp_path.glob("*.safetensors")
    table = adapter_table(loaded(engine), [AdapterSpec(path)])
    cond, x = inputs(engine, 26)
    theirs = reference_row(reference, cond, x, 0.7, [], [])
    assert rel_l2(engine_step(engine, cond, x, 0.7, table), theirs) <= TOLERANCE


def test_a_peft_adapter_file_takes_the_config_beside_it(tmp_path, tiny_folder, engine, shapes):
    """PEFT's save_pretrained: adapter_model.safetensors with base_model.model. keys, and
    adapter_config.json beside it."""
    lora = random_lora(shapes, seed=23, alpha=12.0)
    state = {
        key.replace("transformer.", "base_model.model.", 1): value
        for key, value in write_form(Lora(lora.pairs, None, lora.rank), "diffusers").items()
    }
    path = tmp_path / "adapter_model.safetensors"
    path.write_bytes(wire.write_container(state))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        adapter_table(loaded(engine), [AdapterSpec(path)])

    config = {"r": lora.rank, "lora_alpha": 12, "target_modules": sorted(lora.pairs)}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    table = adapter_table(loaded(engine), [AdapterSpec(path, 0.9)])
    cond, x = inputs(engine, 24)
    theirs = reference_row(peft_model(tiny_folder[1], [(lora, 0.9)]), cond, x, 0.3, [], [])
    assert rel_l2(engine_step(engine, cond, x, 0.3, table), theirs) <= TOLERANCE

    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="DoRA"):
        adapter_table(loaded(engine), [AdapterSpec(path)])
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "alpha_pattern": ["x"]}))
    with pytest.raises(ValueError, match="alpha_pattern is not an object"):
        adapter_table(loaded(engine), [AdapterSpec(path)])


def test_unreadable_files_are_refused_by_name(tmp_path, engine):
    absent = tmp_path / "gone.safetensors"
    with pytest.raises(ValueError, match="gone.safetensors: cannot read it"):
        adapter_table(loaded(engine), [AdapterSpec(absent)])
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ValueError, match="garbage.safetensors: container header is not JSON"):
        adapter_table(loaded(engine), [AdapterSpec(garbage)])


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: {**s, "lora_unet_nowhere.lora_down.weight": np.ones((4, 4), np.float32)},
         "names no linear layer"),
        (lambda s: {**s, "diffusion_model.img_in.weight": np.ones((4, 4), np.float32)},
         "not a LoRA key"),
        (lambda s: {k: v for k, v in s.items() if not k.endswith("img_in.lora_up.weight")},
         "no up matrix for img_in"),
        (lambda s: {**s, "diffusion_model.img_in.alpha": np.ones(2, np.float32)},
         "one number"),
        (lambda s: {**s, "diffusion_model.img_in.lora_magnitude_vector": np.ones(4, np.float32)},
         "DoRA"),
    ],
)  # fmt: skip
def test_refusals_name_the_file_and_key(tmp_path, engine, shapes, edit, message):
    state = edit(write_form(random_lora(shapes, seed=16), "comfy"))
    path = tmp_path / "bad.safetensors"
    path.write_bytes(wire.write_container(state))
    with pytest.raises(ValueError, match=message) as raised:
        adapter_table(loaded(engine), [AdapterSpec(path)])
    assert "bad.safetensors" in str(raised.value)


def test_adapter_spec_reads_an_optional_strength(tmp_path):
    path = tmp_path / "style:v2.safetensors"
    path.write_bytes(len(b"{}").to_bytes(8, "little") + b"{}")  # a safetensors file, empty
    assert adapter_spec(f"{path}:0.5") == AdapterSpec(path, 0.5)
    assert adapter_spec(str(path)) == AdapterSpec(path, 1.0)  # the colon is the file's own
    with pytest.raises(argparse.ArgumentTypeError, match="no LoRA file"):
        adapter_spec(str(tmp_path / "absent.safetensors:0.5"))
    with pytest.raises(argparse.ArgumentTypeError, match=r"the strength 'abc' of .* not a number"):
        adapter_spec(f"{path}:abc")  # the file is there; its strength is what is wrong


def test_a_file_that_is_no_safetensors_is_refused_as_an_argument(tmp_path):
    """With the other arguments (argparse's exit 2), before any model is chosen or loaded."""
    picture = tmp_path / "a.png"
    picture.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    with pytest.raises(argparse.ArgumentTypeError, match="not a safetensors LoRA file: .*a.png"):
        adapter_spec(f"{picture}:0.5")


def gmlx_image(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "gmlx_server", "image", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)


def test_sample_and_bench_take_adapters_in_process(tmp_path, tiny_folder, shapes):
    lora = random_lora(shapes, seed=17, alpha=8.0)
    path = write_lora_file(tmp_path, lora, "comfy")
    common = ["--model", str(tiny_folder[1]), "--width", "64", "--height", "64", "--steps", "2"]
    prompt = ["--prompt", "a red fox"]
    plain = gmlx_image(tmp_path, "sample", *prompt, *common, "--out", str(tmp_path / "a.png"))
    assert plain.returncode == 0, plain.stderr[-2000:]
    styled = gmlx_image(
        tmp_path, "sample", *prompt, *common, "--adapter", f"{path}:0.9",
        "--out", str(tmp_path / "b.png"),
    )  # fmt: skip
    assert styled.returncode == 0, styled.stderr[-2000:]
    assert (tmp_path / "a.png").read_bytes() != (tmp_path / "b.png").read_bytes()

    bench = gmlx_image(
        tmp_path, "bench", *common, "--runs", "1", "--warmup", "0", "--adapter", f"{path}:0.9",
        "--json-out", str(tmp_path / "bench.json"),
    )  # fmt: skip
    assert bench.returncode == 0, bench.stderr[-2000:]
    record = json.loads((tmp_path / "bench.json").read_text())
    assert record["settings"]["adapters"] == [
        {"file": path.name, "bytes": path.stat().st_size, "strength": 0.9}
    ]

    refused = gmlx_image(tmp_path, "bench", *common, "--via-steps", "--adapter", str(path))
    assert refused.returncode == 2 and "--adapter" in refused.stderr, refused.stderr


def test_sample_via_the_step_routes_defines_the_table_as_a_client(tmp_path, tiny_folder, shapes):
    """Through the routes the file's matrices go up as F32 adapters and a patch table names
    them: the image equals the in-process one bit for bit, here for a BF16 file."""
    lora = random_lora(shapes, seed=18, alpha=4.0)
    state = write_form(lora, "kohya")
    bits = {k: v.view(np.uint32) >> 16 for k, v in state.items() if v.ndim == 2}
    body = wire.write_container(
        {
            **{k: v.astype(np.uint16) for k, v in bits.items()},
            **{k: v for k, v in state.items() if v.ndim < 2},
        },
        dtypes={k: "BF16" for k in bits},
    )
    path = tmp_path / "bf16.safetensors"
    path.write_bytes(body)
    common = ["--model", str(tiny_folder[1]), "--width", "64", "--height", "64", "--steps", "2"]
    common += ["--prompt", "a red fox", "--cfg", "3", "--adapter", f"{path}:0.6"]
    direct = gmlx_image(tmp_path, "sample", *common, "--out", str(tmp_path / "d.png"))
    assert direct.returncode == 0, direct.stderr[-2000:]
    routed = gmlx_image(
        tmp_path, "sample", *common, "--via-steps", "--out", str(tmp_path / "r.png")
    )
    assert routed.returncode == 0, routed.stderr[-2000:]
    assert (tmp_path / "d.png").read_bytes() == (tmp_path / "r.png").read_bytes()


def test_a_models_configured_adapters_apply_in_process_via_steps_and_in_the_bench(
    tmp_path, tiny_folder, shapes
):
    """`[models."id"] adapters` in the config: `gmlx image sample` runs under them in process
    and through the routes (there the server's own table for steps naming none), as it would
    with the same files given as --adapter; the bench records them."""
    path = write_lora_file(tmp_path, random_lora(shapes, seed=19, alpha=8.0), "comfy")
    root, folder = tiny_folder
    config = tmp_path / "config.toml"
    config.write_text(
        f'[server]\nmodel_dirs = ["{root}"]\ndefault_model = "{folder.name}"\n'
        f'[models."{folder.name}"]\nadapters = ["{path}:0.8"]\n'
    )
    size = ["--width", "64", "--height", "64", "--steps", "2", "--prompt", "a red fox"]
    configured = ["--config", str(config), *size]
    runs = {
        "given": ["--model", str(folder), *size, "--adapter", f"{path}:0.8"],
        "plain": ["--model", str(folder), *size],
        "configured": configured,
        "configured-via-steps": [*configured, "--via-steps"],
    }
    for name, args in runs.items():
        result = gmlx_image(tmp_path, "sample", *args, "--out", str(tmp_path / f"{name}.png"))
        assert result.returncode == 0, result.stderr[-2000:]
    png = {name: (tmp_path / f"{name}.png").read_bytes() for name in runs}
    assert png["configured"] == png["given"] == png["configured-via-steps"]
    assert png["configured"] != png["plain"]

    for via in ([], ["--via-steps"]):
        out = tmp_path / "bench.json"
        bench = gmlx_image(
            tmp_path, "bench", *configured, *via, "--runs", "1", "--warmup", "0",
            "--json-out", str(out),
        )  # fmt: skip
        assert bench.returncode == 0, bench.stderr[-2000:]
        record = json.loads(out.read_text())
        assert record["settings"]["adapters"] == [
            {"file": path.name, "bytes": path.stat().st_size, "strength": 0.8}
        ]
        if via:
            assert record["transport"]["equal_to_direct"] is True
