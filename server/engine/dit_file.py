"""A DiT's weights in one file, GGUF or safetensors (gguf.weights_file), named as the family
names them: `Naming`, another naming a file may use (ComfyUI's, BFL's) onto the family's
diffusers names, and `DiTFile`, the file checked whole against the family's config before
anything loads, then read one tensor at a time, quantized weights held as gguf.held_as()
says (the file's blocks, or MLX's affine form)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as T

from .ggml_blocks import BlockLayout, Blocks
from .gguf import (
    AFFINE,
    BLOCKS,
    GGUFError,
    GGUFFile,
    SafetensorsFile,
    bits_per_weight,
    held_as,
    held_bits,
    weights_file,
)
from .gguf_affine import GROUP_SIZE, rows_of, swapped_rows, width
from .quantize import BIASES, SCALES


@dataclass(frozen=True)
class Naming:
    """Another naming of a DiT's tensors that a file may use (ComfyUI's, BFL's), onto the
    family's diffusers names: `renames` (regular expression, replacement), applied in order,
    and `fused`, file tensors (by name suffix, after the renames) whose rows split into several
    diffusers tensors (suffixes, in row order). The renames must leave a diffusers name as it
    is, so a file in either naming (or a mix) reads the same. `ignored`: file tensors the
    forward does not read. `swapped`: file tensors (by their own names) whose two halves of
    rows the file holds in the other order than diffusers (BFL's final modulation: shift, then
    scale); swapping them permutes whole rows, which quantized rows allow."""

    renames: tuple[tuple[str, str], ...] = ()
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()
    ignored: tuple[str, ...] = ()
    swapped: tuple[str, ...] = ()

    def sources(self, names) -> dict[str, tuple[str, int, int]]:
        """Diffusers name -> (file name, part, parts): which rows of which file tensor it is."""
        found: dict[str, tuple[str, int, int]] = {}
        for file_name in names:
            name = self.renamed(file_name)
            if name in self.ignored:
                continue
            for suffix, parts in self.fused:
                if name.endswith(suffix):
                    stem = name[: -len(suffix)]
                    for part, part_suffix in enumerate(parts):
                        found[stem + part_suffix] = (file_name, part, len(parts))
                    break
            else:
                found[name] = (file_name, 0, 1)
        return found

    def renamed(self, file_name: str) -> str:
        for pattern, replacement in self.renames:
            file_name = re.sub(pattern, replacement, file_name)
        return file_name

    def holds(self, names) -> bool:
        """Whether any of `names` is in this naming rather than diffusers' (renamed, or fused)."""
        fused = tuple(suffix for suffix, _ in self.fused)
        for name in names:
            renamed = self.renamed(name)
            if renamed != name or renamed.endswith(fused):
                return True
        return False


@dataclass(frozen=True)
class DiTFile:
    """A family's DiT read from one file, GGUF or safetensors (`weights_file`, by its suffix):
    `shapes`, every tensor the family's config asks for by diffusers name (its logical shape);
    `fused`, diffusers weight name -> the names of the weight its forward fuses it with
    (linear_slots' parts, in order); `title`, the family's name in prose. `open` checks the
    whole file against them before anything loads."""

    path: Path
    naming: Naming
    shapes: dict[str, tuple[int, ...]]
    fused: dict[str, tuple[str, ...]]
    title: str

    def open(self) -> tuple[GGUFFile | SafetensorsFile, dict[str, tuple[str, int, int]]]:
        """The file and each expected tensor's source; a GGUFError names the file and the
        tensor when it cannot be read, is not the family's, or holds a shape the config does
        not give."""
        file = weights_file(self.path)
        sources = self.naming.sources(file.entries)
        missing = [name for name in self.shapes if name not in sources]
        if missing:
            arch = f" (its architecture: {file.architecture})" if file.architecture else ""
            raise GGUFError(
                f"{self.path} is not a {self.title} DiT{arch}: it has no tensor {missing[0]}"
                f" ({len(missing)} of the {len(self.shapes)} the family reads are missing)"
            )
        for name, expected in self.shapes.items():
            file_name, part, parts = sources[name]
            shape = _part_shape(file.entries[file_name].shape, parts)
            if shape != tuple(expected):
                raise GGUFError(
                    f"{self.path}: tensor {file_name} has shape {list(file.entries[file_name].shape)}"
                    f" where {self.title}'s config gives {name} the shape {list(expected)}"
                    + (f" ({parts} of them fused along the rows)" if parts > 1 else "")
                )
        return file, sources

    def tensors(
        self, dtype: mx.Dtype | None = None, keep_f32=None, reads=None, quantizing: bool = False
    ) -> dict[str, mx.array | Blocks]:
        """The family's tensors by diffusers name. A linear weight `X.weight` of a fused group
        with a part quantized in the file (every part stored in its logical rows) is held
        quantized, as `held_as()` says: as `Blocks` of the file's bytes (each part's own type,
        float parts too), or in MLX's affine form packed beside `X.scales` and `X.biases`
        (group 32, float32; every part at the widest part's width, widening being exact, and
        only when every part is quantized). A linear weight stored in a float narrower than
        `dtype` (F16 or BF16 at float32 compute) is held as stored too, as blocks, unless the
        load is `quantizing` its float layers. Everything else is a float array cast to
        `dtype` (float32 for the names `keep_f32` picks). Read one file tensor at a time; a file
        tensor none of whose names `reads` picks (the blocks of another rank:
        shard.TreeShard.reads) is never read: its names hold zeros of their shapes that are
        never evaluated (MLX arrays are lazy), for the caller to drop."""
        file, sources = self.open()
        narrower = None if quantizing or dtype is None else dtype.size
        held = self.held(file, sources, narrower)
        out: dict[str, mx.array | Blocks] = {}
        by_file: dict[str, list[tuple[str, int, int]]] = {}
        for name in self.shapes:
            file_name, part, parts = sources[name]
            by_file.setdefault(file_name, []).append((name, part, parts))
        for file_name, targets in by_file.items():
            float_dtype = dtype
            if keep_f32 is not None and all(keep_f32(name) for name, _, _ in targets):
                float_dtype = mx.float32
            swapped = file_name in self.naming.swapped
            form = held.get(targets[0][0]) if all(n in held for n, _, _ in targets) else None
            if reads is not None and not any(reads(name) for name, _, _ in targets):
                for name, _, _ in targets:
                    out.update(self._unread(file, file_name, name, form, float_dtype))
                continue
            if isinstance(form, str):  # blocks
                value = file.read_blocks(file_name, swapped)
                for name, part, parts in targets:
                    out[name] = _split_blocks(value, part, parts)
            elif form is not None:  # affine, at that width
                value = file.read(file_name)
                value = swapped_rows(value) if swapped else value
                for name, part, parts in targets:
                    base = name[: -len(".weight")]
                    packed = rows_of(value, part, parts).packed(held[name])
                    out[name], out[base + SCALES], out[base + BIASES] = packed
            else:
                value = file.read(file_name, float_dtype, as_float=True)
                value = _swapped_halves(value) if swapped else value
                for name, part, parts in targets:
                    out[name] = _split_rows(value, part, parts)
            del value
        return out

    def _unread(self, file, file_name: str, name: str, form, dtype: mx.Dtype | None) -> dict:
        """Lazy zeros in place of a tensor that is not read: as it would be held (blocks, the
        affine form at its width with its scales and biases, or a float array)."""
        shape = tuple(self.shapes[name])
        if form is None:
            return {name: mx.zeros(shape, dtype or mx.float32)}
        rows, cols = shape
        if isinstance(form, str):
            layout = BlockLayout(cols, ((file.entries[file_name].kind, rows),))
            return {name: Blocks(mx.zeros((layout.nbytes,), mx.uint8), layout)}
        base = name[: -len(".weight")]
        return {
            name: mx.zeros((rows, cols * form // 32), mx.uint32),
            base + SCALES: mx.zeros((rows, cols // GROUP_SIZE), mx.float32),
            base + BIASES: mx.zeros((rows, cols // GROUP_SIZE), mx.float32),
        }

    def held(self, file, sources, narrower: int | None = None) -> dict[str, str | int]:
        """Diffusers weight name -> how it is held as stored: BLOCKS, or (affine) the width it
        is packed at; the weights not named are float arrays. Held as stored: the linear
        weights of a fused group with a part quantized in its logical rows, every part stored
        in its logical rows (as affine: every part quantized), and (blocks, `narrower` given)
        those of a float group stored in floats of fewer bytes than `narrower`."""
        affine_form = held_as() == AFFINE
        forms: dict[str, str | int] = {}
        for name, group in self.fused.items():
            entries = [file.entries[sources[part][0]] for part in group]
            if not all(entry.stored_2d for entry in entries):
                continue
            if affine_form:
                if all(entry.quantized for entry in entries):
                    forms[name] = max(width(entry.kind) for entry in entries)
            elif any(entry.quantized for entry in entries) or (
                narrower is not None and all(_narrower(entry, narrower) for entry in entries)
            ):
                forms[name] = BLOCKS
        return forms

    def infos(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(diffusers name, logical shape, stored type) of every tensor the family reads:
        "quant" for a quantized one, else F32, F16 or BF16 (the manifest's dtypes)."""
        file, sources = self.open()
        out = []
        for name, shape in self.shapes.items():
            entry = file.entries[sources[name][0]]
            out.append((name, tuple(shape), "quant" if entry.quantized else entry.type_name))
        return out

    def status(self) -> dict | None:
        """The component's precision as status reports it: a GGUF file, its tensors' types, how
        its quantized linear weights are held (`weights`: BLOCKS or AFFINE) and at how many
        bits a weight (`bits_per_weight`, over those weights); None for a safetensors file
        (float, as a folder's)."""
        file, sources = self.open()
        status = file.status()
        if status is None:
            return None
        held = self.held(file, sources)
        bits = [self._held_bits(file, sources, name, held[name]) for name in held]
        return {**status, "weights": held_as(), "bits_per_weight": bits_per_weight(bits)}

    def stored_bytes(self) -> int:
        """Bytes of tensor data in the file."""
        return sum(entry.nbytes for entry in weights_file(self.path).entries.values())

    def estimated_bytes(self, itemsize: int) -> int:
        """The bytes the family's tensors take loaded (for the status of a model not loaded):
        a weight held as stored (`held`, loaded without a quantize setting) at its file's bytes
        (blocks) or at its MLX width plus float32 scale and bias per group (affine), the rest (a quantized tensor that is no
        linear weight too) at `itemsize` bytes per element."""
        file, sources = self.open()
        held = self.held(file, sources, itemsize)
        total = 0
        for name, shape in self.shapes.items():
            if name in held:
                total += self._held_bits(file, sources, name, held[name])[1] // 8
            else:
                total += int(np.prod(shape, dtype=np.int64)) * itemsize
        return total

    def _held_bits(self, file, sources, name: str, form) -> tuple[int, int]:
        """(elements, bits held) of a weight held quantized."""
        rows, cols = self.shapes[name]
        kind = file.entries[sources[name][0]].kind
        return rows * cols, held_bits(kind, rows * cols, None if isinstance(form, str) else form)


def _narrower(entry, itemsize: int) -> bool:
    """A float tensor stored in fewer bytes an element than `itemsize`."""
    return entry.kind in (T.F16, T.BF16) and itemsize > 2


def _part_shape(shape: tuple[int, ...], parts: int) -> tuple[int, ...]:
    if parts == 1:
        return tuple(shape)
    return (shape[0] // parts, *shape[1:]) if shape[0] % parts == 0 else tuple(shape)


def _swapped_halves(value: mx.array) -> mx.array:
    first, second = mx.split(value, 2, axis=0)
    return mx.concatenate([second, first], axis=0)


def _split_blocks(value: Blocks, part: int, parts: int) -> Blocks:
    """Part `part` of `parts` equal row groups of a tensor's blocks (one type: a byte range)."""
    if parts == 1:
        return value
    ((kind, count),) = value.layout.runs
    size = value.data.size // parts
    layout = BlockLayout(value.layout.cols, ((kind, count // parts),))
    return Blocks(value.data[part * size : (part + 1) * size], layout)


def _split_rows(value: mx.array, part: int, parts: int) -> mx.array:
    if parts == 1:
        return value
    size = value.shape[0] // parts
    return value[part * size : (part + 1) * size]


def fused_weights(slots: dict) -> dict[str, tuple[str, ...]]:
    """Linear weight name -> the weight names its forward fuses it with, in row order, from a
    DiT's `linear_slots` (manifest name -> lora.LinearSlot)."""
    groups: dict[tuple, list[tuple[int, str]]] = {}
    for name, slot in slots.items():
        groups.setdefault((slot.path, slot.key), []).append((slot.part, name + ".weight"))
    fused = {}
    for parts in groups.values():
        names = tuple(name for _, name in sorted(parts))
        fused.update(dict.fromkeys(names, names))
    return fused
