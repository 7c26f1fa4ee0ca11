"""How a LoRA file's keys name a layer of the DiT: the one naming rule of the server's `--adapter`
loader and of the ComfyUI pack's LoRA key map (docs/lora.md).

A layer is a linear weight of the model's manifest, less `.weight` (diffusers module names). A
LoRA key is a stem naming the layer followed by a suffix naming the part. The stems of the forms
found in the wild:

    ComfyUI           diffusion_model.<layer>          (also model.diffusion_model.<layer>)
    diffusers         transformer.<layer>              (also the bare <layer>)
    PEFT              base_model.model.<layer>         (PEFT's save_pretrained)
    kohya             lora_unet_<layer, dots as underscores>

A manifest may also name *aliases* (`lora_aliases`, docs/contract.md §2.4): a layer of another
naming that LoRA files use (FLUX.2's BFL names: each stream's q/k/v as one `qkv`), made of rows
of the manifest's layers in order. A stem may name an alias in any form; a patch on it lands on
those rows (`alias_landings`).

Pure: plain strings, dictionaries and whatever slices like an array.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Suffix -> the part of the pair it holds (down = A (rank, in), up = B (out, rank)).
SUFFIXES = {
    ".lora_A.weight": "down",
    ".lora_B.weight": "up",
    ".lora_down.weight": "down",
    ".lora_up.weight": "up",
    ".alpha": "alpha",
}
PEFT_PREFIX = "base_model.model."
# Prefixes before a layer's name, longest first where one ends another.
PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.", PEFT_PREFIX)
KOHYA_PREFIX = "lora_unet_"


def linear_layers(manifest: dict[str, Any]) -> list[str]:
    """The manifest's linear weights (2-D `.weight` tensors), less `.weight`."""
    return list(layer_rows(manifest))


def lora_targets(manifest: dict[str, Any]) -> list[str]:
    """Every name a LoRA stem may name: the linear layers, then the aliases."""
    return [*linear_layers(manifest), *layer_aliases(manifest)]


@dataclass(frozen=True)
class Rows:
    """Rows `start … start+length-1` of a manifest layer: one piece of an alias."""

    layer: str
    start: int
    length: int


def layer_aliases(manifest: dict[str, Any]) -> dict[str, tuple[Rows, ...]]:
    """The manifest's aliases (`lora_aliases`: name -> [[layer, start, length], ...]), each as
    the rows it is made of, in order; none for a manifest without them."""
    return {
        alias: tuple(Rows(str(layer), int(start), int(length)) for layer, start, length in pieces)
        for alias, pieces in (manifest.get("lora_aliases") or {}).items()
    }


def layer_rows(manifest: dict[str, Any]) -> dict[str, int]:
    """Output rows of each linear layer of the manifest."""
    return {
        tensor["name"].removesuffix(".weight"): int(tensor["shape"][0])
        for tensor in manifest["tensors"]
        if tensor["name"].endswith(".weight") and len(tensor["shape"]) == 2
    }


@dataclass(frozen=True)
class Landing:
    """Where a patch on an alias lands on one manifest layer: the band there (None: the whole
    layer) and the patch's `up` rows that go to it."""

    layer: str
    band: list[int] | None
    up_rows: slice


def alias_landings(
    alias: str,
    pieces: tuple[Rows, ...],
    band: list[int] | None,
    up_rows: int,
    rows_of: dict[str, int],
) -> list[Landing]:
    """A patch on `alias` (its band `[dim, start, length]` or None, its `up` of `up_rows` rows)
    as patches on the manifest's layers: `up` split by rows over the pieces it covers, `down`
    shared. A band on input columns passes to each piece when each is a whole layer. Raises
    ValueError when the band or the rows do not fit the alias."""
    total = sum(piece.length for piece in pieces)
    dim, start, length = band if band is not None else (0, 0, total)
    if dim != 0:
        if any(rows_of.get(p.layer) != p.length for p in pieces):
            raise ValueError(f"{alias}: a band on input columns cannot split over its rows")
        start, length = 0, total
    if start < 0 or length <= 0 or start + length > total:
        raise ValueError(f"{alias}: band {band} runs past its {total} output rows")
    if up_rows != length:
        what = "band" if band is not None and dim == 0 else "layer"
        raise ValueError(f"{alias}: up has {up_rows} rows, the {what} has {length}")
    landings, offset = [], 0
    for piece in pieces:
        first, last = max(start, offset), min(start + length, offset + piece.length)
        if first < last:
            rows = [0, piece.start + first - offset, last - first]
            whole = rows[1] == 0 and rows[2] == rows_of.get(piece.layer)
            target = list(band) if dim != 0 else (None if whole else rows)
            landings.append(Landing(piece.layer, target, slice(first - start, last - start)))
        offset += piece.length
    return landings


def stems_of(layer: str) -> list[str]:
    """Every stem a LoRA file may name `layer` by, one per form (the bare name included)."""
    return [prefix + layer for prefix in PREFIXES] + [layer, kohya_stem(layer)]


def kohya_stem(layer: str) -> str:
    return KOHYA_PREFIX + layer.replace(".", "_")


class LayerNames:
    """The layers of a model, to read LoRA stems against."""

    def __init__(self, layers: list[str]) -> None:
        self.layers = frozenset(layers)
        self._kohya = {kohya_stem(layer): layer for layer in layers}

    def layer_of(self, stem: str) -> str | None:
        """The layer a stem names (its form's prefix dropped; a kohya name matched with dots
        written as underscores), None when it names no layer of the model."""
        if stem in self._kohya:
            return self._kohya[stem]
        for prefix in PREFIXES:
            if stem.startswith(prefix):
                stem = stem[len(prefix) :]
                break
        return stem if stem in self.layers else None
