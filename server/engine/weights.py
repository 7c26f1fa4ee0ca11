"""Reading a diffusers-layout component folder: its config and its (sharded) safetensors."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx

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


def load_weights(component_dir: Path, dtype: mx.Dtype | None = None) -> dict[str, mx.array]:
    """All tensors of a component by their file names, cast to `dtype` when given."""
    weights: dict[str, mx.array] = {}
    for path in weight_files(component_dir):
        for name, value in mx.load(str(path)).items():
            weights[name] = value.astype(dtype) if dtype is not None else value
    return weights


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


def cast_tree(tree, dtype: mx.Dtype, keep_f32: set[str]):
    """Cast a weight tree to the compute dtype; the leaves under a key in `keep_f32` (norm
    scales, which the norms read in float32) stay float32."""
    if isinstance(tree, list):
        return [cast_tree(value, dtype, keep_f32) for value in tree]
    return {
        key: (
            cast_tree(value, dtype, keep_f32)
            if isinstance(value, (dict, list))
            else value
            if key in keep_f32
            else value.astype(dtype)
        )
        for key, value in tree.items()
    }
