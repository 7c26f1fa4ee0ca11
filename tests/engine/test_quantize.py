"""Quantization at load (engine/quantize.py, weights.load_tree): the quantized linear computes
exactly the function of its dequantized weight, the family's predicate picks the layers, LoRA
pairs stay in float beside a quantized weight, a quantized load never holds the float model
whole, and a sharded component written quantized loads as stored."""

from __future__ import annotations

import json
import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gmlx_server.engine import quantize
from gmlx_server.engine.lora import LORA_DOWN, LORA_UP, LinearSlot, project
from gmlx_server.engine.nn.dtypes import tree_bytes
from gmlx_server.engine.precision import BITS, GROUP_SIZES, Quantization
from gmlx_server.engine.quantize import (
    BIASES,
    SCALES,
    SPEC,
    linear,
    logical_shape,
    quantization_of,
    quantize_module,
    quantize_tree,
)
from gmlx_server.engine.weights import (
    QUANTIZED,
    load_tree,
    quantize_folder,
    stored_quantization,
    tensor_infos,
)
from safetensors.numpy import save_file

from tests.compare import rel_l2


def dequantized(node: dict, name: str) -> mx.array:
    bits, group_size = node[name + SPEC]
    return mx.dequantize(
        node[name], node[name + SCALES], node[name + BIASES], group_size=group_size, bits=bits
    )


def random(shape, seed=0) -> mx.array:
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def test_settings_are_checked():
    assert Quantization(4).group_size == 64
    assert Quantization(8, 32).status() == {"bits": 8, "group_size": 32, "mode": "affine"}
    for bits in (2, 7, 16, True, 4.0):
        with pytest.raises(ValueError, match="quantize must be one of 3, 4, 5, 6, 8 bits"):
            Quantization(bits)
    for group_size in (16, 100, 256):
        with pytest.raises(ValueError, match="group_size must be one of 32, 64, 128"):
            Quantization(4, group_size)


@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("bits", BITS)
def test_quantized_linear_is_its_dequantized_weight(bits, group_size):
    weight = random((96, 256))
    node = {"w": weight}
    quantize_tree(node, Quantization(bits, group_size), lambda path: True)
    assert node["w"].dtype == mx.uint32 and node["w" + SPEC] == (bits, group_size)
    assert logical_shape(node, "w") == (96, 256)
    x = random((3, 7, 256), seed=1)
    exact = x @ dequantized(node, "w").T
    assert rel_l2(linear(node, "w", x), exact) <= 1e-6
    # ... and the quantization loses something, more at fewer bits
    assert rel_l2(dequantized(node, "w"), weight) > 0


def test_the_predicate_and_the_group_size_pick_the_layers():
    tree = {
        "embed": random((64, 64)),
        "blocks": [{"qkv": random((96, 64)), "odd": random((32, 48)), "norm": random((64,))}],
    }
    picked = []
    quantize_tree(tree, Quantization(4), lambda path: picked.append(path) or path != "embed")
    assert picked == ["embed", "blocks.0.qkv"]  # 48 columns: no group of 64; 1-D: never
    assert tree["embed"].dtype == mx.float32 and SPEC not in "".join(tree)
    block = tree["blocks"][0]
    assert block["qkv"].dtype == mx.uint32
    assert block["odd"].dtype == mx.float32 and block["norm"].dtype == mx.float32
    assert quantization_of(tree) == Quantization(4)
    assert quantization_of({"embed": tree["embed"]}) is None
    # bytes are the arrays' own: packed words, scales and biases
    packed = block["qkv"].nbytes + block["qkv" + SCALES].nbytes + block["qkv" + BIASES].nbytes
    assert packed == 96 * 64 // 2 + 2 * 96 * 4  # 4 bits a weight, one f32 scale and bias a row
    assert tree_bytes(tree) == packed + (64 * 64 + 32 * 48 + 64) * 4


def test_lora_pairs_stay_float_beside_a_quantized_weight():
    node = {"w": random((64, 128))}
    quantize_tree(node, Quantization(3), lambda path: True)
    down, up = random((4, 128), seed=2), random((64, 4), seed=3)
    node["w" + LORA_DOWN], node["w" + LORA_UP] = down, up
    x = random((5, 128), seed=4)
    expected = x @ (dequantized(node, "w") + up @ down).T
    assert rel_l2(project(node, "w", x), expected) <= 1e-5
    assert LinearSlot("w", parts=2).layer_shape(node) == (32, 128)


def test_a_module_is_quantized_with_its_weights():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(64, 64)
            self.layers = [nn.Linear(64, 128), nn.Linear(128, 64, bias=False)]

    net = Net()
    weights = {
        "embed.weight": random((64, 64)),
        "embed.bias": random((64,), 1),
        "layers.0.weight": random((128, 64), 2),
        "layers.0.bias": random((128,), 3),
        "layers.1.weight": random((64, 128), 4),
    }
    floats = dict(weights)
    quantize_module(net, weights, Quantization(5, 32), lambda path: path.startswith("layers."))
    net.load_weights(list(weights.items()), strict=True)
    assert isinstance(net.embed, nn.Linear)
    assert all(isinstance(layer, nn.QuantizedLinear) for layer in net.layers)
    assert quantization_of(net) == Quantization(5, 32)
    first = net.layers[0]
    node = {"w": first.weight, "w" + SCALES: first.scales, "w" + BIASES: first.biases}
    node["w" + SPEC] = (5, 32)
    x = random((2, 64), 5)
    expected = x @ dequantized(node, "w").T + floats["layers.0.bias"]
    assert rel_l2(first(x), expected) <= 1e-6


@pytest.mark.parametrize("bits", BITS)
def test_the_cpu_path_equals_the_quantized_kernel(monkeypatch, bits):
    """On the CPU backend a quantized linear dequantizes, then runs the float GEMM; MLX's
    quantized kernel (the GPU backends' path) gives the same result, for a tree's weight and a
    module's layer (float32 scales and biases)."""
    on_cpu = mx.default_device() == mx.cpu
    assert quantize.dequantize_first(quantize.DEQUANTIZE_MIN_ROWS) == on_cpu
    assert not quantize.dequantize_first(quantize.DEQUANTIZE_MIN_ROWS - 1)
    node = {"w": random((192, 256))}
    quantize_tree(node, Quantization(bits, 64), lambda path: True)
    holder = nn.Sequential(nn.Linear(256, 192, bias=False))
    quantize.swap_quantized(holder, lambda *_: Quantization(bits))
    layer = holder.layers[0]
    assert isinstance(layer, quantize.QuantizedLinear)
    layer.update({"weight": node["w"], "scales": node["w" + SCALES], "biases": node["w" + BIASES]})
    x = random((2, 9, 256), seed=6)
    exact = x @ dequantized(node, "w").T
    for dequantizing in (True, False):
        monkeypatch.setattr(quantize, "dequantize_first", lambda rows, d=dequantizing: d)
        assert rel_l2(linear(node, "w", x), exact) <= 1e-6
        assert rel_l2(layer(x), exact) <= 1e-6


def test_dequantized_weights_are_alive_one_at_a_time(monkeypatch):
    """A chain of quantized linears on the dequantizing path holds a few dequantized weights
    at a time, however long the chain, eager and compiled; without ordering each dequantize
    after its input, 16 linears held 17-18 weights' worth (each dequantize holds 2 weights'
    worth while it runs, and the CPU stream frees a buffer only when its task ends: 4 eager,
    7 compiled were measured)."""
    monkeypatch.setattr(quantize, "dequantize_first", lambda rows: True)
    count, width = 16, 1024
    tree = {f"w{i}": random((width, width), seed=i) * width**-0.5 for i in range(count)}
    quantize_tree(tree, Quantization(4), lambda path: True)
    x = random((16, width), seed=9)
    mx.eval(tree, x)

    def chain(x):
        for i in range(count):
            x = linear(tree, f"w{i}", x)
        return x

    weight_bytes = width * width * 4
    for run in (chain, mx.compile(chain)):
        mx.synchronize()
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(run(x))
        assert mx.get_peak_memory() - base <= 8 * weight_bytes


def test_a_quantized_load_never_holds_the_float_weights_whole(tmp_path):
    tensors = {f"blocks.{i}.w": np.ones((1024, 1024), np.float32) * i for i in range(12)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    one = 1024 * 1024 * 4

    def sanitize(files):
        return {"blocks": [{"w": files[f"blocks.{i}.w"]} for i in range(12)]}

    def peak_of(quantization):
        mx.clear_cache()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        tree = load_tree(tmp_path, sanitize, mx.float32, None, quantization, lambda p: True)
        return mx.get_peak_memory() - before, tree_bytes(tree)

    float_peak, float_bytes = peak_of(None)
    quantized_peak, quantized_bytes = peak_of(Quantization(4))
    assert float_bytes == 12 * one and float_peak >= float_bytes
    assert quantized_bytes < 12 * one // 6
    # the quantized tree, plus one float tensor and its quantization in flight
    assert quantized_peak <= quantized_bytes + 2 * one


def test_a_sharded_component_is_written_quantized_and_loads_as_stored(tmp_path):
    source = tmp_path / "model" / "transformer"
    source.mkdir(parents=True)
    (tmp_path / "model" / "model_index.json").write_text("{}")
    (source / "config.json").write_text(json.dumps({"width": 64}))
    shards = {
        "part-1.safetensors": {"a.weight": np.ones((32, 64), np.float32) * 0.5},
        "part-2.safetensors": {
            "b.weight": np.arange(64 * 128, dtype=np.float32).reshape(64, 128) / 1000,
            "norm.weight": np.ones(64, np.float32),
        },
    }
    weight_map = {}
    for shard, tensors in shards.items():
        save_file(tensors, str(source / shard))
        weight_map |= dict.fromkeys(tensors, shard)
    index = source / "diffusion_pytorch_model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    written = tmp_path / "q8"
    quantize_folder(
        tmp_path / "model", written, Quantization(8, 32), {"transformer": lambda n: n == "b.weight"}
    )
    assert (written / "model_index.json").read_text() == "{}"
    umask = os.umask(0)
    os.umask(umask)
    assert written.stat().st_mode & 0o777 == 0o777 & ~umask  # as any folder: others may read
    component = written / "transformer"
    assert stored_quantization(component) == Quantization(8, 32)
    new_map = json.loads((component / index.name).read_text())["weight_map"]
    assert new_map == {
        "a.weight": "part-1.safetensors",
        "b.weight": "part-2.safetensors",
        "b.scales": "part-2.safetensors",
        "b.biases": "part-2.safetensors",
        "norm.weight": "part-2.safetensors",
    }
    infos = {info.name: (info.shape, info.dtype) for info in tensor_infos(component)}
    assert infos == {
        "a.weight": ((32, 64), "F32"),
        "b.weight": ((64, 128), QUANTIZED),
        "norm.weight": ((64,), "F32"),
    }

    def sanitize(files):
        return {"a": files["a.weight"], "b": files["b.weight"], "norm": files["norm.weight"]}

    tree = load_tree(component, sanitize, mx.float32)
    assert tree["b"].dtype == mx.uint32 and tree["b" + SPEC] == (8, 32)
    assert tree["a"].dtype == mx.float32 and "a" + SPEC not in tree
    expected = mx.array(shards["part-2.safetensors"]["b.weight"])
    assert rel_l2(dequantized(tree, "b"), expected) < 1e-2
    with pytest.raises(ValueError, match="stored quantized .8-bit, groups of 32.; load it"):
        load_tree(component, sanitize, mx.float32, None, Quantization(4), lambda p: True)
    again = load_tree(component, sanitize, mx.float32, None, Quantization(8, 32), lambda p: True)
    assert again["a"].dtype == mx.float32  # loaded as stored, nothing quantized again


def test_a_component_too_narrow_to_quantize_stays_float_and_says_so(tmp_path):
    """`gmlx model quantize` on a DiT whose every width the group size leaves whole: its copy
    records no quantization (the text encoder, wide enough, does), so the status read from the
    files and the loaded model's agree."""
    from gmlx_server.engine.registry import ModelRegistry
    from gmlx_server.engine.weights import quantize_folder

    from tests.families.flux3_klein.tiny import build_tiny_folder

    plain = build_tiny_folder(tmp_path / "plain", num_attention_heads=2)  # 32 wide
    family = ModelRegistry(extra_models=[plain]).family("flux3_klein")
    stored = tmp_path / "stored"
    quantize_folder(plain, stored, Quantization(4, 64), family.quantized_files(plain))
    assert "quantization" not in json.loads((stored / "transformer" / "config.json").read_text())
    assert "quantization" in json.loads((stored / "text_encoder" / "config.json").read_text())
    registry = ModelRegistry(extra_models=[stored])
    unloaded = registry.describe("stored")["quantization"]
    loaded = registry.acquire("stored").model.status()["quantization"]
    assert unloaded["dit"] is None and loaded["dit"] is None
    assert unloaded["encoder"] == loaded["encoder"] is not None


def test_a_quantize_that_fails_leaves_no_folder_behind(tmp_path, monkeypatch):
    """A write that fails midway (a full disk, an interrupt) takes the half-written copy with
    it: nothing at the destination, nothing hidden beside it; and a registry lists no hidden
    folder, the one a copy is written in until it is whole."""
    from gmlx_server.engine import weights
    from gmlx_server.engine.registry import ModelRegistry

    source = tmp_path / "models" / "m"
    (source / "transformer").mkdir(parents=True)
    (source / "model_index.json").write_text("{}")

    def full_disk(item, destination, quantization, include):
        destination.mkdir()
        (destination / "part.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(weights, "write_quantized", full_disk)
    written = tmp_path / "models" / "m-q4"
    with pytest.raises(OSError, match="No space left"):
        weights.quantize_folder(source, written, Quantization(4, 32), {"transformer": bool})
    assert sorted(p.name for p in written.parent.iterdir()) == ["m"]

    building = tmp_path / "models" / ".m-q4-abc"
    building.mkdir()
    (building / "model_index.json").write_text("{}")
    assert list(ModelRegistry([tmp_path / "models"]).folders()) == ["m"]

    # a build killed outright (no cleanup ran) left one: it goes at the next build of that
    # destination on this host; a build whose process runs keeps its own
    import subprocess
    import sys

    from gmlx_server.engine.processes import this_host

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    killed = tmp_path / "models" / f".m-q4-{this_host()}-{gone}-{'a' * 8}"
    running = tmp_path / "models" / f".m-q4-{this_host()}-{os.getppid()}-{'b' * 8}"
    for folder in (killed, running):
        folder.mkdir()
    with pytest.raises(OSError, match="No space left"):
        weights.quantize_folder(source, written, Quantization(4, 32), {"transformer": bool})
    assert not killed.exists() and running.is_dir()


def test_quantize_refuses_a_destination_it_cannot_make_before_any_work(tmp_path, capsys):
    from gmlx_server import cli

    afile = tmp_path / "a.png"
    afile.write_text("")
    assert cli.main(["model", "quantize", "--bits", "4", "any-model", str(afile / "q4")]) == 2
    said = capsys.readouterr().err
    assert f"gmlx model quantize: destination {afile / 'q4'}: {afile} is a file, not a" in said
