"""MLX's affine form of GGUF's quantized types: the conversion the GGUF loader makes when a
model entry asks for MLX's own quantized kernels (`GMLX_GGUF_WEIGHTS=affine`; by default a GGUF
weight is held as its file's blocks, ggml_blocks.py).

- Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (blocks of 32: one scale d, and a min m or a fixed offset) and
  Q4_K, Q5_K (super-blocks of 256 whose eight sub-blocks of 32 carry a 6-bit scale and min):
  MLX's affine quantization at group 32 with float32 scales and biases, exactly: w = s·q + b
  with s = d (K: d·sc) and b = m, −8·d, −16·d, −128·d (K: −dmin·m), so `mx.dequantize` equals
  `gguf.quants.dequantize` bit for bit in float32 (tests/engine/test_gguf.py), at 1.5 bits a
  weight more than the file.
- Q6_K, Q3_K, Q2_K (sub-blocks of 16, below MLX's smallest group of 32): no exact MLX form;
  dequantized by `gguf.quants.dequantize` and quantized again by `mx.quantize` at NEAREST's
  width, group 32. The error that adds is measured in docs/benchmarks.md ("GGUF types").
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as T

from .precision import MODE

GROUP_SIZE = 32
# The types held as MLX affine quantization without loss, and their width.
EXACT = {T.Q8_0: 8, T.Q4_0: 4, T.Q4_1: 4, T.Q5_0: 5, T.Q5_1: 5, T.Q4_K: 4, T.Q5_K: 5}
# The types with no exact MLX form, and the width they are quantized again at.
NEAREST = {T.Q6_K: 8, T.Q3_K: 5, T.Q2_K: 4}
ROWS_PER_CHUNK = 256  # rows converted at once, bounding a conversion's numpy temporaries


@dataclass(frozen=True)
class Quantized:
    """One weight in MLX's affine form at group GROUP_SIZE: the integer levels q (rows, cols),
    uint8, and float32 scales and biases (rows, cols / GROUP_SIZE); w = scales * q + biases."""

    q: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bits: int

    def packed(self, bits: int | None = None) -> tuple[mx.array, mx.array, mx.array]:
        """(packed uint32, scales, biases) at `bits` (default: its own width; a wider one holds
        the same levels, so widening is exact)."""
        bits = self.bits if bits is None else bits
        if bits < self.bits:
            raise ValueError(f"cannot pack {self.bits}-bit levels in {bits} bits")
        return mx.array(pack(self.q, bits)), mx.array(self.scales), mx.array(self.biases)


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Levels (rows, cols) < 2**bits as MLX packs them: one little-endian bit stream per row
    (level j at bits j*bits ...), read as uint32 words (rows, cols * bits / 32)."""
    rows, cols = q.shape
    per_word = 8 // np.gcd(8, bits)  # levels that fill whole bytes
    groups = q.reshape(rows, cols // per_word, per_word).astype(np.uint64)
    shifts = (np.arange(per_word, dtype=np.uint64) * np.uint64(bits))[None, None, :]
    words = np.bitwise_or.reduce(groups << shifts, axis=-1)  # each < 2**(per_word*bits) <= 2**40
    width = per_word * bits // 8
    stream = words[..., None].view(np.uint8)[..., :width]  # little-endian: low bytes first
    return np.ascontiguousarray(stream).reshape(rows, -1).view(np.uint32)


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """The levels of `pack`'s words, uint8 (rows, cols)."""
    rows = packed.shape[0]
    stream = np.unpackbits(packed.view(np.uint8).reshape(rows, -1), axis=-1, bitorder="little")
    stream = stream.reshape(rows, -1, bits)
    weights = (1 << np.arange(bits)).astype(np.uint8)
    return (stream * weights).sum(axis=-1, dtype=np.uint8)


# ---------------------------------------------------------------------------------------------
# The exact types: block bytes -> levels, scales and biases (mirroring gguf.quants' layouts)


def _half(raw: np.ndarray) -> np.ndarray:
    """(n, 2) bytes -> (n, 1) float32 of the float16 they hold."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """(n, k) bytes -> (n, 2 * k / run, run) levels: per run of `run` bytes, the low nibbles
    then the high ones (the order of Q4_0's 16 bytes, Q4_K's 32-byte chunks)."""
    n = qs.shape[0]
    runs = qs.reshape(n, -1, 1, run) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (runs & 0x0F).reshape(n, -1, run)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Q5_0/Q5_1's 4 bytes -> (n, 32) fifth bits (element j: bit j of the little-endian word)."""
    word = np.ascontiguousarray(qh).view(np.uint32)
    return ((word >> np.arange(count, dtype=np.uint32)[None, :]) & 1).astype(np.uint8)


def _q8_0(b):
    d = _half(b[:, :2])
    q = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q, d, -128 * d


def _q4_0(b):
    d = _half(b[:, :2])
    return _nibbles(b[:, 2:], 16).reshape(-1, 32), d, -8 * d


def _q4_1(b):
    return _nibbles(b[:, 4:], 16).reshape(-1, 32), _half(b[:, :2]), _half(b[:, 2:4])


def _q5_0(b):
    d = _half(b[:, :2])
    q = _nibbles(b[:, 6:], 16).reshape(-1, 32) | (_high_bits(b[:, 2:6], 32) << 4)
    return q, d, -16 * d


def _q5_1(b):
    q = _nibbles(b[:, 8:], 16).reshape(-1, 32) | (_high_bits(b[:, 4:8], 32) << 4)
    return q, _half(b[:, :2]), _half(b[:, 2:4])


def _k_scales(b):
    """Q4_K/Q5_K's super-block header -> scales d·sc and biases −dmin·m per sub-block (n, 8)."""
    sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    scales = _half(b[:, :2]) * sc.astype(np.float32)
    return scales, -(_half(b[:, 2:4]) * m.astype(np.float32))


def _q4_k(b):
    scales, biases = _k_scales(b)
    return _nibbles(b[:, 16:], 32), scales, biases


def _q5_k(b):
    scales, biases = _k_scales(b)
    qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    return _nibbles(b[:, 48:], 32) | ((qh & 1) << 4), scales, biases


_EXACT_BLOCKS = {
    T.Q8_0: _q8_0,
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
}


def affine(kind: T, data: np.ndarray, rows: int, cols: int) -> Quantized:
    """A quantized tensor's bytes (rows, bytes per row) in MLX's affine form at group 32:
    exact for EXACT's types, quantized again at NEAREST's width for the others."""
    if kind in EXACT:
        block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
        convert = _EXACT_BLOCKS[kind]
        parts = [convert(chunk.reshape(-1, type_size)) for chunk in _row_chunks(data)]
        q = np.concatenate([p[0].reshape(-1, cols) for p in parts])
        scales = np.concatenate([p[1].reshape(-1, cols // GROUP_SIZE) for p in parts])
        biases = np.concatenate([p[2].reshape(-1, cols // GROUP_SIZE) for p in parts])
        return Quantized(q, scales, biases, EXACT[kind])
    bits = NEAREST[kind]
    levels, all_scales, all_biases = [], [], []
    for chunk in _row_chunks(data):
        values = mx.array(gguf.quants.dequantize(chunk, kind).reshape(-1, cols))
        packed, scales, biases = mx.quantize(values, GROUP_SIZE, bits, mode=MODE)
        levels.append(unpack(np.array(packed), bits))
        all_scales.append(np.array(scales, np.float32))
        all_biases.append(np.array(biases, np.float32))
    return Quantized(
        np.concatenate(levels), np.concatenate(all_scales), np.concatenate(all_biases), bits
    )


def _row_chunks(data: np.ndarray):
    for start in range(0, data.shape[0], ROWS_PER_CHUNK):
        yield np.asarray(data[start : start + ROWS_PER_CHUNK])


def width(kind: T) -> int:
    """The MLX width a quantized type converts at."""
    return EXACT.get(kind) or NEAREST[kind]


def rows_of(item: Quantized, part: int, parts: int) -> Quantized:
    """Part `part` of `parts` equal row groups of an affine form."""
    if parts == 1:
        return item
    size = item.q.shape[0] // parts
    rows = slice(part * size, (part + 1) * size)
    return Quantized(item.q[rows], item.scales[rows], item.biases[rows], item.bits)


def swapped_rows(item: Quantized) -> Quantized:
    """An affine form with its two halves of rows swapped."""
    half = item.q.shape[0] // 2

    def swap(a: np.ndarray) -> np.ndarray:
        return np.concatenate([a[half:], a[:half]])

    return Quantized(swap(item.q), swap(item.scales), swap(item.biases), item.bits)
