"""LoRA files for the in-process sampler (`gmlx image sample|bench --adapter FILE[:STRENGTH]`)
and for a model entry's configured default adapters (`[models."id"] adapters`, docs/contract.md §2.9).

A client of the step routes maps a LoRA file's keys onto the DiT's linear layers and defines a
patch table (docs/contract.md §2.9, docs/lora.md); the in-process sampler does that mapping here and
builds the table with the routes' own `service.build_table`, so a LoRA is checked and applied
the same way in process as through the routes. Keys of the three forms found in the wild (the
naming rule is `gmlx_contract.lora_keys`, which the ComfyUI pack's key map shares):

    diffusers / PEFT  [transformer.]<layer>.lora_A.weight, .lora_B.weight           (no alpha)
    kohya             lora_unet_<layer, dots as underscores>.lora_down.weight, .lora_up.weight,
                      .alpha
    ComfyUI           diffusion_model.<layer>.lora_down.weight, .lora_up.weight, .alpha

where <layer> is a linear weight of the model's manifest, less `.weight` (diffusers names), or
one of the manifest's `lora_aliases` (FLUX.2 klein: BFL's names, a fused q/k/v among them): a
pair on an alias becomes a pair on each manifest layer it is made of, its up matrix split by
rows and its down matrix shared, with a band where it covers part of a layer.

A diffusers/PEFT pair has no alpha key; its scale is PEFT's `lora_alpha / r` (or `/ sqrt(r)`
with rsLoRA, both per layer through `alpha_pattern`/`rank_pattern`) from the LoRA's config where
the file comes with one: diffusers' `save_lora_weights` writes it into the file's metadata
(`lora_adapter_metadata`, keys prefixed `transformer.`), and PEFT's `save_pretrained` writes
`adapter_config.json` beside `adapter_model.safetensors`, whose keys start `base_model.model.`
(that form is refused without its config). Without a config the scale is 1, as diffusers loads
such a file. ComfyUI reads neither config: it applies such a file at scale 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gmlx_contract import wire
from gmlx_contract.errors import ContractError
from gmlx_contract.hashing import table_id
from gmlx_contract.lora_keys import (
    PEFT_PREFIX,
    SUFFIXES,
    LayerNames,
    alias_landings,
    layer_aliases,
    layer_rows,
    lora_targets,
)

from .config import AdapterSpec, ModelSettings, parse_adapter
from .engine.registry import LoadedModel
from .service import CachedTensor, PatchTable, build_table, hash_of, tensor_of

log = logging.getLogger(__name__)

DORA_KEY = "lora_magnitude_vector"
# Where a diffusers/PEFT LoRA keeps its LoraConfig: diffusers' safetensors metadata entry (its
# keys prefixed with the model part's name), or PEFT's file beside the weights.
DIFFUSERS_CONFIG_KEY = "lora_adapter_metadata"
DIFFUSERS_CONFIG_PREFIX = "transformer."
PEFT_CONFIG_FILE = "adapter_config.json"
# The LoraConfig fields read here (what tells a bare config from another part's metadata).
LORA_CONFIG_KEYS = {"r", "lora_alpha", "alpha_pattern", "rank_pattern", "use_rslora", "use_dora"}


def adapter_spec(text: str) -> AdapterSpec:
    """`FILE` or `FILE:STRENGTH` as an argparse type (`config.parse_adapter`), the file's
    safetensors header read: a file that is none is refused with the other arguments, before
    any model is chosen or loaded."""
    from .engine.file_headers import HeaderError, safetensors_entries  # the server's extras

    try:
        spec = parse_adapter(text)
        safetensors_entries(spec.path)
    except HeaderError as exc:
        raise argparse.ArgumentTypeError(f"not a safetensors LoRA file: {exc}") from None
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return spec


class DefaultAdapters:
    """The registry's load hooks for the entries' configured adapters (`[models."id"] adapters`).
    `check` maps the files onto the model's manifest before its weights load, so a file that is
    gone, unreadable or names no layer of the model fails the load at once (and evicts nothing);
    `give` builds the table on the loaded instance (`LoadedModel.default_table`), where the model
    itself checks the shapes. Both run on the image worker."""

    def __init__(self, models: Mapping[str, ModelSettings]) -> None:
        self.models = models
        self._checked: dict[str, tuple[dict, dict[str, CachedTensor]]] = {}

    def specs(self, model_id: str) -> tuple[AdapterSpec, ...]:
        settings = self.models.get(model_id)
        return settings.adapters if settings is not None else ()

    def check(self, model_id: str, manifest: dict) -> None:
        self._checked.pop(model_id, None)
        specs = self.specs(model_id)
        if specs:
            self._checked[model_id] = adapter_doc(model_id, manifest, list(specs))

    def give(self, loaded: LoadedModel) -> None:
        specs = self.specs(loaded.model_id)
        if not specs:
            return
        checked = self._checked.pop(loaded.model_id, None)
        doc, adapters = checked or adapter_doc(
            loaded.model_id, loaded.model.manifest(), list(specs)
        )
        loaded.default_adapters = specs
        loaded.default_table = files_table(loaded, specs, doc, adapters)
        log.info(
            "model %s runs under its configured adapters: %s",
            loaded.model_id,
            ", ".join(f"{spec.path.name}:{spec.strength:g}" for spec in specs),
        )


def sampling_table(loaded: LoadedModel, specs: Sequence[AdapterSpec]) -> PatchTable | None:
    """The table an in-process sampling runs under: these files' (a step naming a table runs
    under that table alone), else the entry's configured adapters' (docs/contract.md §2.9)."""
    return adapter_table(loaded, list(specs)) if specs else loaded.default_table


def adapter_table(loaded: LoadedModel, specs: list[AdapterSpec]) -> PatchTable | None:
    """The patch table of these LoRA files at their strengths for the loaded model (None for
    none), as `PUT patch-tables` builds and checks it; a file that does not fit is refused with
    a ValueError naming it and the key."""
    if not specs:
        return None
    doc, adapters = adapter_doc(loaded.model_id, loaded.model.manifest(), specs)
    return files_table(loaded, specs, doc, adapters)


def files_table(
    loaded: LoadedModel, specs: Sequence[AdapterSpec], doc: dict, adapters: dict
) -> PatchTable:
    """`build_table` for a table made of these files; its refusals (matrices that do not fit
    their layer) name the files as a ValueError."""
    try:
        return build_table(loaded, table_id(doc), doc, adapters)
    except (ContractError, ValueError) as error:  # the schema's refusals, the model's
        reason = error.message if isinstance(error, ContractError) else str(error)
        names = ", ".join(spec.path.name for spec in specs)
        raise ValueError(f"LoRA file {names}: {reason}") from None


def adapter_doc(
    model_id: str, manifest: dict, specs: list[AdapterSpec], float32: bool = False
) -> tuple[dict, dict[str, CachedTensor]]:
    """The table document of these LoRA files and its matrices by hash; with `float32`, every
    matrix as F32 (what a client uploads: the table's values are the same, as the server
    computes in float32 whatever the upload's dtype)."""
    loras = [(_file_parts(spec.path, manifest, float32), spec.strength) for spec in specs]
    return table_doc(model_id, loras)


def _file_parts(path: Path, manifest: dict, float32: bool) -> list[Landed]:
    try:
        container = wire.read_container(Path(path).read_bytes())
        tensors = {name: tensor_of(container, name) for name in container.tensors}
        if float32:
            tensors = {name: CachedTensor(t.float32(), "F32") for name, t in tensors.items()}
        config = peft_config(path, container.metadata, tensors)
        if config is not None and config.get("use_dora"):
            raise ValueError("it is a DoRA adapter (use_dora), which is not a plain LoRA")
        parts = layer_parts(tensors, lora_targets(manifest))
        if config is not None:
            apply_peft_scales(parts, config)
        return landed_parts(parts, manifest)
    except OSError as error:
        raise ValueError(f"LoRA file {path}: cannot read it: {error.strerror or error}") from None
    except ContractError as error:  # not a safetensors file the wire rules read
        raise ValueError(f"LoRA file {path.name}: {error.message}") from None
    except ValueError as error:
        raise ValueError(f"LoRA file {path.name}: {error}") from None


def peft_config(path: Path, metadata: dict[str, str], tensors: dict[str, Any]) -> dict | None:
    """The LoraConfig fields of a diffusers/PEFT LoRA file, where it comes with them: in the
    metadata (keys prefixed `transformer.` from a pipeline's `save_lora_weights`, bare from the
    model's own `save_lora_adapter`), or in PEFT's config file beside it."""
    text = metadata.get(DIFFUSERS_CONFIG_KEY)
    if text:
        try:
            saved = json.loads(text)
        except ValueError:
            raise ValueError(f"its {DIFFUSERS_CONFIG_KEY} metadata is not JSON") from None
        if not isinstance(saved, dict):
            raise ValueError(f"its {DIFFUSERS_CONFIG_KEY} metadata is not a JSON object")
        config = {
            key.removeprefix(DIFFUSERS_CONFIG_PREFIX): value
            for key, value in saved.items()
            if key.startswith(DIFFUSERS_CONFIG_PREFIX)
        }
        if not config and LORA_CONFIG_KEYS & set(saved):
            config = saved
        return config or None
    if any(name.startswith(PEFT_PREFIX) for name in tensors):
        beside = path.with_name(PEFT_CONFIG_FILE)
        if not beside.is_file():
            raise ValueError(
                f"its keys are PEFT's ({PEFT_PREFIX}...) and no {PEFT_CONFIG_FILE} is beside it "
                "to give lora_alpha and r"
            )
        try:
            config = json.loads(beside.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as error:
            raise ValueError(f"cannot read {beside}: {error}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{beside} is not a JSON object")
        return config
    return None


def apply_peft_scales(parts_by_layer: dict[str, dict[str, Any]], config: dict) -> None:
    """Give each pair without an alpha key the alpha whose alpha / rank is PEFT's scaling for
    its layer: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora, where alpha_pattern and
    rank_pattern name layers by PEFT's rule (a pattern matching the name's end at a dot)."""
    for name in ("alpha_pattern", "rank_pattern"):
        if not isinstance(config.get(name) or {}, dict):
            raise ValueError(f"its LoRA config's {name} is not an object")
    try:
        default_rank, default_alpha = config.get("r", 8), config.get("lora_alpha", 8)
        for layer, parts in parts_by_layer.items():
            if parts["alpha"] is not None:
                continue
            rank = float(_pattern_value(config.get("rank_pattern"), layer, default_rank))
            alpha = float(_pattern_value(config.get("alpha_pattern"), layer, default_alpha))
            scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
            parts["alpha"] = scaling * parts["down"].shape[0]
    except (TypeError, ValueError, ZeroDivisionError, re.error) as error:
        raise ValueError(f"its LoRA config is not usable: {error}") from None


def _pattern_value(patterns: dict | None, layer: str, default: Any) -> Any:
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", layer):
            return value
    return default


# A pair on one manifest layer: (layer, band or None, {"up", "down", "alpha"}).
Landed = tuple[str, list[int] | None, dict[str, Any]]


def landed_parts(parts_by_name: dict[str, dict[str, Any]], manifest: dict) -> list[Landed]:
    """The pairs of `layer_parts` on the manifest's layers: a pair on an alias split onto the
    layers it is made of (`gmlx_contract.lora_keys.alias_landings`)."""
    aliases, rows = layer_aliases(manifest), layer_rows(manifest)
    landed: list[Landed] = []
    for name, parts in parts_by_name.items():
        if name not in aliases:
            landed.append((name, None, parts))
            continue
        up = parts["up"]
        for landing in alias_landings(name, aliases[name], None, up.shape[0], rows):
            rows_up = CachedTensor(np.ascontiguousarray(up.array[landing.up_rows]), up.dtype)
            landed.append((landing.layer, landing.band, {**parts, "up": rows_up}))
    return landed


def table_doc(
    model_id: str, loras: list[tuple[list[Landed], float]]
) -> tuple[dict, dict[str, CachedTensor]]:
    """A table document stacking the LoRAs (their `landed_parts`) at their strengths, and its
    matrices by hash: one entry per layer key and band (sorted, the whole layer first), one
    patch per LoRA pair on it."""
    adapters: dict[str, CachedTensor] = {}
    patches: dict[tuple[str, tuple], list[dict]] = {}
    for pairs, strength in loras:
        for layer, band, parts in pairs:
            up, down = hash_of(parts["up"]), hash_of(parts["down"])
            adapters[up], adapters[down] = parts["up"], parts["down"]
            patch = {"up": up, "down": down, "alpha": parts["alpha"], "strength": strength}
            key = (f"diffusion_model.{layer}.weight", tuple(band or ()))
            patches.setdefault(key, []).append(patch)
    entries = [
        {"key": key, "band": list(band) or None, "patches": patches[(key, band)]}
        for key, band in sorted(patches)
    ]
    return {"model": model_id, "entries": entries}, adapters


def layer_parts(tensors: dict[str, CachedTensor], layers: list[str]) -> dict[str, dict[str, Any]]:
    """A LoRA file's tensors by the layer (or alias) they patch: {"up", "down", "alpha" (float
    or None)}."""
    names = LayerNames(layers)
    found: dict[str, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        suffix = next((s for s in SUFFIXES if key.endswith(s)), None)
        if DORA_KEY in key:
            raise ValueError(f"{key!r} is a DoRA magnitude: a DoRA adapter is not a plain LoRA")
        if suffix is None:
            raise ValueError(
                f"{key!r} is not a LoRA key (.lora_A/.lora_B/.lora_down/.lora_up/.alpha)"
            )
        layer = names.layer_of(key[: -len(suffix)])
        if layer is None:
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
