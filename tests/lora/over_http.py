"""LoRA patch tables over HTTP for the families' seam tests: random low-rank pairs on chosen
layers (whole, or a band of output rows or input columns), the same LoRA as whole-weight
deltas (what a checkpoint with it merged holds), and the PUT of the adapters and the table."""

from __future__ import annotations

import numpy as np
from gmlx_contract.hashing import canonical_json, table_id, tensor_hash


def band_slices(band, shape: tuple[int, int]) -> tuple[slice, slice, tuple[int, int]]:
    """(rows, columns, pair shape (out, in)) of a band [axis, start, length] of a weight of
    `shape` (None: the whole weight)."""
    rows, cols = shape
    if band is None:
        return slice(None), slice(None), (rows, cols)
    axis, start, length = band
    if axis == 0:
        return slice(start, start + length), slice(None), (length, cols)
    return slice(None), slice(start, start + length), (rows, length)


def lora_table(
    shapes: dict[str, tuple[int, int]],
    patched: dict,
    seed: int,
    strength: float,
    alpha: float = 1.0,
    rank: int = 2,
) -> tuple[list[dict], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Patch-table entries for the layers of `patched` (layer -> band or None; `shapes`: each
    layer's weight (out, in)), their adapter tensors by hash, and the same LoRA as deltas of
    the whole weights: strength * alpha / rank * up @ down in the band."""
    rng = np.random.default_rng(seed)
    entries, adapters, deltas = [], {}, {}
    for layer, band in patched.items():
        rows, cols, (out, inputs) = band_slices(band, shapes[layer])
        up = rng.standard_normal((out, rank)).astype(np.float32)
        down = rng.standard_normal((rank, inputs)).astype(np.float32)
        adapters |= {tensor_hash(up): up, tensor_hash(down): down}
        patch = {"up": tensor_hash(up), "down": tensor_hash(down), "alpha": alpha}
        patch |= {"strength": strength, "strength_model": 1.0}
        entries.append({"key": f"diffusion_model.{layer}.weight", "band": band, "patches": [patch]})
        delta = np.zeros(shapes[layer], np.float32)
        delta[rows, cols] = strength * alpha / rank * (up @ down)
        deltas[layer] = delta
    return entries, adapters, deltas


def put_table(live, model: str, entries: list[dict], adapters: dict[str, np.ndarray]):
    """PUT the adapters and the table of `entries` for `model`: the response, and the id."""
    for array in adapters.values():
        live.put_tensor(array, "adapters")
    doc = {"model": model, "entries": entries}
    response = live.call(
        "PUT",
        f"patch-tables/{table_id(doc)}",
        data=canonical_json(doc),
        headers={"Content-Type": "application/json"},
        params={"model": model},
    )
    return response, table_id(doc)
