"""What the tests of quantized models share: `gmlx model quantize` run as a user runs it, and
quantized weights made float again, for the checks that a quantized model computes as the same
network in float32 on its dequantized weights."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from gmlx_server.engine.ggml_blocks import LAYOUT, BlockLayout, decode
from gmlx_server.engine.quantize import BIASES, SCALES, SPEC
from mlx.utils import tree_flatten


def quantize_command(*args: str) -> subprocess.CompletedProcess:
    """`gmlx model quantize ARGS` in a process of its own."""
    command = [sys.executable, "-m", "gmlx_server", "model", "quantize", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def quantized_by_command(folder: Path, written: Path, bits: int, group_size: int) -> Path:
    """`folder` written quantized at `written` by `gmlx model quantize`; returns `written`."""
    result = quantize_command(
        str(folder), str(written), "--bits", str(bits), "--group-size", str(group_size)
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return written


def dequantized_tree(tree):
    """A copy of a weight tree with every quantized weight (affine, or a GGUF file's blocks)
    dequantized to float32."""
    if isinstance(tree, list):
        return [dequantized_tree(child) for child in tree]
    out = {}
    for key, value in tree.items():
        if key.endswith((SCALES, BIASES, SPEC, LAYOUT)):
            continue
        if key + LAYOUT in tree:
            out[key] = decode(value, BlockLayout.of(tree[key + LAYOUT]))
        elif key + SPEC in tree:
            bits, group_size = tree[key + SPEC]
            scales, biases = tree[key + SCALES], tree[key + BIASES]
            out[key] = mx.dequantize(value, scales, biases, group_size=group_size, bits=bits)
        elif isinstance(value, (dict, list)):
            out[key] = dequantized_tree(value)
        else:
            out[key] = value
    return out


def dequantized_parameters(module: nn.Module) -> list[tuple[str, mx.array]]:
    """An `mlx.nn` module's parameters by path, each quantized layer's (linear or embedding)
    weight dequantized and its scales and biases left out: what the float module of the same
    layers loads."""
    weights = dict(tree_flatten(module.parameters()))
    for path, layer in module.named_modules():
        if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            weights[path + ".weight"] = mx.dequantize(
                layer.weight,
                layer.scales,
                layer.biases,
                group_size=layer.group_size,
                bits=layer.bits,
            )
            del weights[path + SCALES], weights[path + BIASES]
    return list(weights.items())


def dequantized_qwen3(encoder, component_dir: Path):
    """A float32 Qwen3 of the same layers holding `encoder`'s (a Qwen3TextEncoder) weights, the
    quantized ones dequantized (`component_dir`: its float folder, for the config)."""
    from gmlx_server.engine.encoders.qwen3.text import Qwen3TextEncoder

    plain = Qwen3TextEncoder.load(component_dir, layers=len(encoder.model.layers))
    plain.model.load_weights(dequantized_parameters(encoder.model), strict=True)
    return plain
