"""GGUF files for the tests, written with the `gguf` package (llama.cpp's own writer): tensors
of every type the server reads, quantized by `gguf.quants.quantize` where the package can, else
as random valid block bytes (finite float16 scales, any levels)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

# The types gguf.quants.quantize writes; the K-quants it only reads.
QUANTIZABLE = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)
# Where each K-quant block keeps its float16 scales (byte offsets within a block).
K_HALVES = {
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.Q3_K: (108,),
    T.Q2_K: (80, 82),
}
SCALE_RANGE = (0.002, 0.02)  # |d| of the random K-quant blocks: weights of order 0.1..1


def random_blocks(
    kind: T, shape: tuple[int, int], rng: np.random.Generator, rms: float | None = None
) -> np.ndarray:
    """The bytes (rows, bytes per row) of a (rows, cols) tensor of a quantized `kind`; with
    `rms`, a K-quant's float16 scales are scaled so its weights have about that RMS (weights
    are linear in them), as a network's weights of that fan-in would."""
    rows, cols = shape
    if kind in QUANTIZABLE:
        return gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32) * 0.5, kind)
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, (rows, cols // block_size * type_size), dtype=np.uint8)
    blocks = data.reshape(-1, type_size)
    for offset in K_HALVES[kind]:
        scale = rng.uniform(*SCALE_RANGE, (blocks.shape[0], 1)).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.view(np.uint8)
    if rms is not None:
        factor = rms / float(np.sqrt(np.mean(gguf.quants.dequantize(data, kind) ** 2)))
        for offset in K_HALVES[kind]:
            halves = np.ascontiguousarray(blocks[:, offset : offset + 2]).view(np.float16)
            scaled = (halves.astype(np.float32) * factor).astype(np.float16)
            blocks[:, offset : offset + 2] = scaled.view(np.uint8)
    return data


def encoded(kind: T, value: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """`value` (float32) as a tensor of `kind`: floats as they are, BF16 rounded by gguf, a
    quantized kind quantized (or, for a K-quant, random blocks of its shape and RMS)."""
    if kind == T.F32:
        return value.astype(np.float32)
    if kind == T.F16:
        return value.astype(np.float16)
    if kind == T.BF16:
        return gguf.quants.quantize(value.astype(np.float32), T.BF16)
    if kind in QUANTIZABLE:
        return gguf.quants.quantize(value.astype(np.float32), kind)
    rms = float(np.sqrt(np.mean(value.astype(np.float64) ** 2)))
    return random_blocks(kind, value.shape, rng, rms)


def reference(kind: T, data: np.ndarray) -> np.ndarray:
    """What a tensor of the file holds, as gguf dequantizes it (float32)."""
    if kind in (T.F32, T.F16):
        return data.astype(np.float32)
    return gguf.quants.dequantize(data, kind)


def write_gguf(
    path: Path,
    tensors: dict[str, tuple[T, np.ndarray]],
    arch: str | None = "qwen_image",
    orig_shapes: dict[str, tuple[int, ...]] | None = None,
    metadata: Callable[[gguf.GGUFWriter], None] | None = None,
) -> Path:
    """A GGUF file of `tensors` (name -> (type, data as `encoded` gives it)), with
    `general.architecture` = arch, ComfyUI-GGUF's orig_shape entries and what `metadata`
    adds to the writer's keys."""
    writer = gguf.GGUFWriter(str(path), arch=arch or "")
    if arch is None:  # a file with no architecture: drop the key the writer adds
        writer.kv_data[0].pop(gguf.Keys.General.ARCHITECTURE, None)
    for name, shape in (orig_shapes or {}).items():
        writer.add_array(f"comfy.gguf.orig_shape.{name}", list(shape))
    if metadata is not None:
        metadata(writer)
    for name, (kind, data) in tensors.items():
        raw = None if kind in (T.F32, T.F16) else kind
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def write_dit(
    path: Path,
    weights: dict[str, np.ndarray],
    types: dict[str, T],
    rng: np.random.Generator,
    prefix: str = "",
    fused: dict[str, tuple[str, ...]] | None = None,
    flattened: tuple[str, ...] = (),
    arch: str | None = "qwen_image",
) -> dict[str, np.ndarray]:
    """Write a DiT's `weights` (float32, by diffusers name) as a GGUF file, each tensor as
    `types` says (F32 when it does not), its name under `prefix`; `fused`: file tensors under
    other names (ComfyUI's), each made of one or more diffusers tensors' rows (file name ->
    part names, in row order), of the first part's type; `flattened`: tensors written in rows
    of 256 with ComfyUI-GGUF's orig_shape entry. Returns what the file holds by diffusers
    name, as gguf dequantizes it: the reference the loaded weights must equal."""
    fused = fused or {}
    parts = {part for names in fused.values() for part in names}
    layout = {name: (name,) for name in weights if name not in parts}
    layout.update(fused)
    tensors, orig, held = {}, {}, {}
    for file_name, names in layout.items():
        value = np.concatenate([weights[name] for name in names])
        kind = types.get(names[0], T.F32)
        stored = value.reshape(-1, 256) if file_name in flattened else value
        data = encoded(kind, stored, rng)
        tensors[prefix + file_name] = (kind, data)
        if file_name in flattened:
            orig[prefix + file_name] = value.shape
        whole = reference(kind, data).reshape(value.shape)
        for index, chunk in enumerate(np.split(whole, len(names))):
            held[names[index]] = chunk
    write_gguf(path, tensors, arch=arch, orig_shapes=orig)
    return held
