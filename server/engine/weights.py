"""The weights of a diffusers-layout component folder: its config, its (sharded) safetensors,
and what a family's load asks of them.

Everything that touches stored tensors goes through here: reading (safetensors shards today;
GGUF and MLX's quantized files next), casting to the compute dtype, quantizing (quantize.py)
and in time sharding. A family's load says what it needs (`load_tree(dir, sanitize, dtype,
keep_f32=..., quantization=..., quantized=...)`) and maps the names (its DiT's `sanitize`); it
never casts leaf by leaf. Memory is counted from the loaded
arrays (`nn.dtypes.tree_bytes`); the header-based `stored_elements` serves only estimates for a
folder that is not loaded. `tensor_infos` gives logical shapes, whatever the storage.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from .precision import Quantization
from .quantize import quantize_tree

_INDEX_SUFFIX = ".safetensors.index.json"


def read_config(component_dir: Path) -> dict:
    return json.loads((Path(component_dir) / "config.json").read_text())


def weight_files(component_dir: Path) -> list[Path]:
    """The safetensors files of a component: the shards an index names, else every file."""
    component_dir = Path(component_dir)
    indexes = sorted(component_dir.glob("*" + _INDEX_SUFFIX))
    if indexes:
        weight_map = json.loads(indexes[0].read_text())["weight_map"]
        return [component_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(component_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {component_dir}")
    return files


def load_weights(
    component_dir: Path,
    dtype: mx.Dtype | None = None,
    keep_f32: Callable[[str], bool] | None = None,
) -> dict[str, mx.array]:
    """All tensors of a component by their file names, cast to `dtype` when given; the names
    `keep_f32` picks (norm scales, read by norms that run in float32) are cast to float32."""
    weights: dict[str, mx.array] = {}
    for path in weight_files(component_dir):
        for name, value in mx.load(str(path)).items():
            target = mx.float32 if keep_f32 is not None and keep_f32(name) else dtype
            weights[name] = value.astype(target) if target is not None else value
    return weights


def load_tree(
    component_dir: Path,
    sanitize: Callable[[dict[str, mx.array]], dict],
    dtype: mx.Dtype | None = None,
    keep_f32: Callable[[str], bool] | None = None,
    quantization: Quantization | None = None,
    quantized: Callable[[str], bool] | None = None,
) -> dict:
    """A component's weight tree, evaluated: its tensors read (`load_weights`), mapped by the
    family's `sanitize` (file names -> tree), and with a `quantization` the linear weights
    whose tree path `quantized` picks quantized, one at a time (quantize.quantize_tree), so the
    float model is never whole in memory."""
    tree = sanitize(load_weights(component_dir, dtype, keep_f32))
    if quantization is not None:
        if quantized is None:
            raise ValueError("a quantized load needs the family's choice of layers")
        quantize_tree(tree, quantization, quantized)
    mx.eval(tree)
    return tree


@dataclass(frozen=True)
class TensorInfo:
    """A stored tensor as a manifest names it: its logical shape and its stored dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # the safetensors name: F32, F16, BF16, ...


def tensor_infos(component_dir: Path) -> list[TensorInfo]:
    """Every tensor of a component, from the file headers (no data read)."""
    return [
        TensorInfo(name, tuple(entry["shape"]), entry["dtype"])
        for path in weight_files(component_dir)
        for name, entry in read_header(path).items()
    ]


def stored_elements(component_dir: Path) -> int:
    """Elements of a component's tensors, from the headers: for estimates of a folder that is
    not loaded (a loaded model counts its arrays)."""
    return sum(int(np.prod(info.shape, dtype=np.int64)) for info in tensor_infos(component_dir))


def read_header(path: Path) -> dict:
    """The safetensors header of one file (names to dtype, shape, offsets), without its data."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return header


def component_bytes(component_dir: Path) -> int:
    """Bytes of tensor data in a component's files, from their headers."""
    total = 0
    for path in weight_files(component_dir):
        for entry in read_header(path).values():
            start, end = entry["data_offsets"]
            total += end - start
    return total
