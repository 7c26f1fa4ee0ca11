"""LoRA files for the in-process sampler: `gmlx image sample|bench --adapter FILE[:STRENGTH]`.

A client of the step routes maps a LoRA file's keys onto the DiT's linear layers and defines a
patch table (CONTRACT 2.9, docs/lora.md); the in-process sampler does that mapping here and
builds the table with the routes' own `service.build_table`, so a LoRA is checked and applied
the same way in process as through the routes. Keys of the three forms found in the wild:

    diffusers / PEFT  [transformer.]<layer>.lora_A.weight, .lora_B.weight           (no alpha)
    kohya             lora_unet_<layer, dots as underscores>.lora_down.weight, .lora_up.weight,
                      .alpha
    ComfyUI           diffusion_model.<layer>.lora_down.weight, .lora_up.weight, .alpha

where <layer> is a linear weight of the model's manifest, less `.weight` (diffusers names).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gmlx_contract import wire
from gmlx_contract.hashing import table_id

from .engine.registry import LoadedModel
from .service import CachedTensor, PatchTable, build_table, hash_of, tensor_of

SUFFIXES = {
    ".lora_A.weight": "down",
    ".lora_B.weight": "up",
    ".lora_down.weight": "down",
    ".lora_up.weight": "up",
    ".alpha": "alpha",
}
PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.")
KOHYA_PREFIX = "lora_unet_"


@dataclass(frozen=True)
class AdapterSpec:
    path: Path
    strength: float = 1.0

    def record(self) -> dict:
        """The adapter as the bench's record names it (settings.adapters)."""
        return {
            "file": self.path.name,
            "bytes": self.path.stat().st_size,
            "strength": self.strength,
        }


def adapter_spec(text: str) -> AdapterSpec:
    """`FILE` or `FILE:STRENGTH` (an argparse type); a FILE with a colon in its name is taken
    whole when the part after the last colon is not a number."""
    path, strength = text, 1.0
    head, sep, tail = text.rpartition(":")
    if sep and head:
        try:
            path, strength = head, float(tail)
        except ValueError:
            pass
    if not Path(path).expanduser().is_file():
        raise argparse.ArgumentTypeError(f"no LoRA file at {path!r}")
    return AdapterSpec(Path(path).expanduser(), strength)


def adapter_table(loaded: LoadedModel, specs: list[AdapterSpec]) -> PatchTable | None:
    """The patch table of these LoRA files at their strengths for the loaded model (None for
    none), as `PUT patch-tables` builds and checks it; a file that does not fit is refused with
    a ValueError naming it and the key."""
    if not specs:
        return None
    doc, adapters = adapter_doc(loaded.model_id, loaded.model.manifest(), specs)
    return build_table(loaded, table_id(doc), doc, adapters)


def adapter_doc(
    model_id: str, manifest: dict, specs: list[AdapterSpec], float32: bool = False
) -> tuple[dict, dict[str, CachedTensor]]:
    """The table document of these LoRA files and its matrices by hash; with `float32`, every
    matrix as F32 (what a client uploads: the table's values are the same, as the server
    computes in float32 whatever the upload's dtype)."""
    layers = linear_layers(manifest)
    loras = [(_file_parts(spec.path, layers, float32), spec.strength) for spec in specs]
    return table_doc(model_id, loras)


def _file_parts(path: Path, layers: list[str], float32: bool) -> dict[str, dict[str, Any]]:
    try:
        tensors = read_lora(path)
        if float32:
            tensors = {name: CachedTensor(t.float32(), "F32") for name, t in tensors.items()}
        return layer_parts(tensors, layers)
    except ValueError as error:
        raise ValueError(f"LoRA file {path.name}: {error}") from None


def linear_layers(manifest: dict) -> list[str]:
    """The manifest's linear weights (2-D `.weight` tensors), less `.weight`."""
    return [
        tensor["name"].removesuffix(".weight")
        for tensor in manifest["tensors"]
        if tensor["name"].endswith(".weight") and len(tensor["shape"]) == 2
    ]


def read_lora(path: Path) -> dict[str, CachedTensor]:
    """A safetensors file's tensors by name (F32, F16 or BF16 under the wire rules)."""
    container = wire.read_container(Path(path).read_bytes())
    return {name: tensor_of(container, name) for name in container.tensors}


def table_doc(
    model_id: str, loras: list[tuple[dict[str, dict[str, Any]], float]]
) -> tuple[dict, dict[str, CachedTensor]]:
    """A table document stacking the LoRAs (their `layer_parts`) at their strengths, and its
    matrices by hash: one entry per layer key (sorted), one patch per LoRA touching it."""
    adapters: dict[str, CachedTensor] = {}
    patches: dict[str, list[dict]] = {}
    for parts_by_layer, strength in loras:
        for layer, parts in parts_by_layer.items():
            up, down = hash_of(parts["up"]), hash_of(parts["down"])
            adapters[up], adapters[down] = parts["up"], parts["down"]
            patch = {"up": up, "down": down, "alpha": parts["alpha"], "strength": strength}
            patches.setdefault(f"diffusion_model.{layer}.weight", []).append(patch)
    entries = [{"key": key, "band": None, "patches": patches[key]} for key in sorted(patches)]
    return {"model": model_id, "entries": entries}, adapters


def layer_parts(tensors: dict[str, CachedTensor], layers: list[str]) -> dict[str, dict[str, Any]]:
    """A LoRA file's tensors by the layer they patch: {"up", "down", "alpha" (float or None)}."""
    kohya_names = {layer.replace(".", "_"): layer for layer in layers}
    known = set(layers)
    found: dict[str, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        suffix = next((s for s in SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            raise ValueError(
                f"{key!r} is not a LoRA key (.lora_A/.lora_B/.lora_down/.lora_up/.alpha)"
            )
        layer = _layer_of(key[: -len(suffix)], kohya_names)
        if layer not in known:
            raise ValueError(f"{key!r} names no linear layer of the model")
        side = SUFFIXES[suffix]
        if side == "alpha" and tensor.array.size != 1:
            raise ValueError(f"{key!r} must hold one number, not shape {list(tensor.shape)}")
        parts = found.setdefault(layer, {"alpha": None})
        parts[side] = float(tensor.float32().reshape(-1)[0]) if side == "alpha" else tensor
    for layer, parts in found.items():
        if "up" not in parts or "down" not in parts:
            raise ValueError(
                f"the LoRA has no {'up' if 'up' not in parts else 'down'} matrix for {layer}"
            )
    return found


def _layer_of(stem: str, kohya_names: dict[str, str]) -> str:
    if stem.startswith(KOHYA_PREFIX):
        name = stem[len(KOHYA_PREFIX) :]
        return kohya_names.get(name, name)
    for prefix in PREFIXES:
        if stem.startswith(prefix):
            return stem[len(prefix) :]
    return stem
