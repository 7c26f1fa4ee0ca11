"""`gmlx model quantize --kquant` (engine/kquant_folder.py): the preset's mix of types, a folder
the server loads and steps as the same network on gguf's dequantized weights of its file, and
the loss against MLX's affine quantization; where mlx-kquant is not installed, the command says
how to get it."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gmlx_server import cli
from gmlx_server.engine.base import StepRow
from gmlx_server.engine.embedded import DIFFUSERS_WEIGHTS, draw
from gmlx_server.engine.families.qwen_image21 import embedded, family
from gmlx_server.engine.families.qwen_image21.embedded import ensure_embedded_model
from gmlx_server.engine.kquant_folder import preset_types
from gmlx_server.engine.precision import Quantization
from safetensors.numpy import save_file

from tests.compare import rel_l2
from tests.engine.gguf_files import reference as reference_weights

# Wide enough that the block linears (input 256 and 768) take K-quants' 256-blocks.
CONFIG = {**embedded.TRANSFORMER_CONFIG, "attention_head_dim": 128, "axes_dims_rope": [32, 48, 48]}


def test_the_preset_mixes_types_as_llama_cpp():
    kind = preset_types("q4_k_m", 32)
    assert kind("transformer_blocks.0.attn.to_v.weight", (3072, 3072)) == T.Q6_K  # first eighth
    assert kind("transformer_blocks.5.attn.to_v.weight", (3072, 3072)) == T.Q4_K
    assert kind("transformer_blocks.6.attn.to_v.weight", (3072, 3072)) == T.Q6_K  # every third
    assert kind("transformer_blocks.7.img_mlp.out.weight", (3072, 9216)) == T.Q4_K
    assert kind("transformer_blocks.30.img_mlp.out.weight", (3072, 9216)) == T.Q6_K  # last eighth
    assert kind("transformer_blocks.6.attn.to_q.weight", (3072, 3072)) == T.Q4_K
    assert kind("transformer_blocks.6.attn.to_q.weight", (64, 96)) == T.Q5_0  # no 256-blocks
    assert kind("transformer_blocks.6.attn.to_q.weight", (64, 48)) is None  # no block at all


def wide_folder(root):
    base = ensure_embedded_model(root / "embedded")
    folder = root / "wide"
    shutil.copytree(base, folder, ignore=shutil.ignore_patterns("transformer"))
    transformer = folder / "transformer"
    transformer.mkdir()
    (transformer / "config.json").write_text(json.dumps(CONFIG))
    weights = draw(
        embedded.transformer_tensors(CONFIG), np.random.default_rng(1), embedded.CONSTANT_NOISE
    )
    save_file(weights, str(transformer / DIFFUSERS_WEIGHTS))
    return folder


def step(model, rows) -> np.ndarray:
    x = np.random.default_rng(2).standard_normal((1, 64, 8, 8)).astype(np.float32)
    return model.denoise_step(x, np.array([0.7], np.float32), rows).out


def test_a_kquant_folder_loads_and_steps_as_its_file(tmp_path, capsys):
    pytest.importorskip("mlx_kquant")
    folder = wide_folder(tmp_path)
    out = tmp_path / "q4_k_m"
    assert cli.main(["model", "quantize", str(folder), str(out), "--kquant", "q4_k_m"]) == 0
    assert "its DiT as q4_k_m" in capsys.readouterr().out
    plain = family.QWEN_IMAGE21.load(folder, "plain")
    cond = plain.encode("a red boat", [], refs=False).cond
    rows = [StepRow(np.asarray(cond), "c", (), (), ())]  # no references
    model = family.QWEN_IMAGE21.load(out, "kquant")
    held = model.status()["quantization"]["dit"]
    assert held["weights"] == "blocks" and {"Q4_K", "Q6_K"} <= set(held["types"])
    # the step is the network on the file's weights as gguf dequantizes them
    reference = tmp_path / "reference"
    shutil.copytree(out, reference)
    (gguf_path,) = (reference / "transformer").glob("*.gguf")
    weights = {
        t.name: reference_weights(t.tensor_type, t.data).reshape(
            [int(d) for d in reversed(t.shape.tolist())]
        )
        for t in gguf.GGUFReader(gguf_path).tensors
    }
    gguf_path.unlink()
    save_file(weights, str(reference / "transformer" / DIFFUSERS_WEIGHTS))
    got = step(model, rows)
    assert rel_l2(got, step(family.QWEN_IMAGE21.load(reference, "reference"), rows)) <= 1e-4
    # its loss against the float folder, beside MLX's affine 4-bit at load (groups of 64)
    expected = step(plain, rows)
    affine = family.QWEN_IMAGE21.load(folder, "q4", Quantization(4, 64))
    kquant_loss, affine_loss = rel_l2(got, expected), rel_l2(step(affine, rows), expected)
    print(f"q4_k_m: step rel-L2 {kquant_loss:.3g}, DiT {model.dit.weight_bytes} bytes")
    print(f"affine 4-bit g64: step rel-L2 {affine_loss:.3g}, DiT {affine.dit.weight_bytes} bytes")
    assert 0 < kquant_loss < 0.1 and 0 < affine_loss < 0.1


def test_without_mlx_kquant_the_command_says_how_to_get_it(tmp_path, capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_kquant(name, *args, **kwargs):
        if name == "mlx_kquant":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_kquant)
    folder = ensure_embedded_model(tmp_path / "embedded")
    out = tmp_path / "out"
    assert cli.main(["model", "quantize", str(folder), str(out), "--kquant", "q4_k_m"]) == 2
    assert "--kquant needs mlx-kquant, the `kquant` extra" in capsys.readouterr().err
    assert not out.exists()
