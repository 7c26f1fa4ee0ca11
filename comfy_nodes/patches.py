"""ComfyUI LoRA weight patches -> adapter matrices and a patch table (docs/contract.md §7.7, §2.9).

ComfyUI's LoRA loaders add patches to a clone of the MODEL: `ModelPatcher.patches` maps a
weight key to a list of `(strength_patch, value, strength_model, offset, function)`. A plain
LoRA value is a `comfy.weight_adapter.LoRAAdapter` whose `.name` is "lora" and whose `.weights`
are `(up, down, alpha, mid, dora_scale, reshape)` (ComfyUI 0.3.x); older ComfyUI used the tuple
`("lora", (up, down, alpha, mid, dora_scale, reshape))`. Both are read here.

The key map the stock loaders read LoRA files through (`lora_key_map`) covers every key form of
`gmlx_contract.lora_keys`, the naming rule the server's `--adapter` loader reads too, for the
manifest's layers and its `lora_aliases` (FLUX.2 klein's BFL names: ComfyUI's own Flux2 weight
names). The model holds a placeholder weight for each alias, so the stock loaders patch it as
ComfyUI's Flux2 would; `build_table` lands such a patch on the manifest's layers (`Aliases`).

Pure: works on anything tensor-like (torch tensors in ComfyUI, numpy arrays in tests); imports
neither ComfyUI nor torch.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gmlx_contract.hashing import tensor_hash
from gmlx_contract.lora_keys import (
    KOHYA_PREFIX,
    PREFIXES,
    SUFFIXES,
    alias_landings,
    layer_aliases,
    layer_rows,
    lora_targets,
    stems_of,
)

from .errors import GmlxError
from .tensor_hashes import version_of

# Other ComfyUI weight-adapter kinds, by their `.name` / tuple tag, as a user knows them.
ADAPTER_TITLES = {
    "loha": "LoHa",
    "lokr": "LoKr",
    "glora": "GLoRA",
    "oft": "OFT",
    "boft": "BOFT",
    "diff": "a weight diff (tuple patch)",
    "set": "a weight set (tuple patch)",
    "model_as_lora": "a model-as-LoRA diff (tuple patch)",
}


# ComfyUI's name of a model weight: the manifest name under its `diffusion_model.`.
MODEL_KEY = "diffusion_model.{}.weight"


def lora_key_map(manifest: dict[str, Any]) -> dict[str, str]:
    """LoRA stem -> model weight key, for every linear layer and alias of the manifest in every
    form."""
    return {
        stem: MODEL_KEY.format(layer)
        for layer in lora_targets(manifest)
        for stem in stems_of(layer)
    }


class Aliases:
    """The manifest's `lora_aliases` by their model weight keys: a patch on one lands on the
    manifest layers the alias is made of, its up matrix split by rows (down shared)."""

    def __init__(self, manifest: dict[str, Any]) -> None:
        self.pieces = {MODEL_KEY.format(a): (a, p) for a, p in layer_aliases(manifest).items()}
        self.rows = layer_rows(manifest)

    @property
    def weights(self) -> frozenset[str]:
        return frozenset(self.pieces)

    def land(
        self, key: str, band: list[int] | None, patch: dict[str, Any], adapters: dict
    ) -> list[tuple[str, list[int] | None, dict[str, Any]]]:
        """(key, band, patch) of each manifest layer the patch lands on; the split up matrices
        join `adapters`. A patch on a manifest layer lands where it is."""
        if key not in self.pieces:
            return [(key, band, patch)]
        alias, pieces = self.pieces[key]
        up = adapters[patch["up"]]
        try:
            landings = alias_landings(alias, pieces, band, up.shape[0], self.rows)
        except ValueError as err:
            raise GmlxError(f"gmlx: the LoRA patch on {key} does not fit: {err}") from None
        out = []
        for landing in landings:
            rows = np.ascontiguousarray(up[landing.up_rows])
            digest = tensor_hash(rows)
            adapters[digest] = rows
            out.append((MODEL_KEY.format(landing.layer), landing.band, {**patch, "up": digest}))
        return out


def unmapped_patches_text(source: str, model_id: str, foreign_keys: list[str]) -> str:
    """The refusal of patches (a LoRA's, as the stock loaders map it) of which none lands on a
    weight of the model; `source` names where they came from ("the LoRA file 'x'", a node)."""
    forms = ", ".join(f"{prefix}<layer>" for prefix in PREFIXES)
    what = (
        f"its patches name {foreign_keys[0]}{', ...' if len(foreign_keys) > 1 else ''}, "
        "no weight of this model"
        if foreign_keys
        else "none of its keys names a layer (ComfyUI's log lists them: 'lora key not loaded')"
    )
    return (
        f"gmlx: {source} changes nothing in {model_id!r}: {what}. A LoRA's keys are read as "
        f"{forms}, <layer> or {KOHYA_PREFIX}<layer with _ for .>, each with .lora_up/.lora_down "
        "or .lora_B/.lora_A, where <layer> is a linear layer of the model's manifest or one of "
        "its lora_aliases (FLUX.2 klein: BFL's names)"
    )


def unmatched_stems(keys: list[str], key_map: dict[str, str]) -> tuple[list[str], int]:
    """The LoRA stems of a file's keys (each key less its SUFFIXES part) that the key map
    (`lora_key_map`) does not map, sorted, and how many stems the file has."""
    stems = {key[: -len(s)] for key in keys for s in SUFFIXES if key.endswith(s)}
    return sorted(stem for stem in stems if stem not in key_map), len(stems)


def half_matching_text(source: str, model_id: str, unmatched: list[str], total: int) -> str:
    """The warning for a LoRA of which only some layers land on the model; the rest is left out."""
    first = ", ".join(unmatched[:3]) + (", ..." if len(unmatched) > 3 else "")
    return (
        f"gmlx: {source} patches {total - len(unmatched)} of its {total} layers in "
        f"{model_id!r}; {len(unmatched)} name no layer of this model and are left out "
        f"({first}). Is it a LoRA for another model or variant?"
    )


def misfit_patch(patches: dict[str, list[tuple]], shapes: dict[str, tuple]) -> str | None:
    """The first LoRA patch whose matrices do not fit the weight it lands on (`shapes`: the
    model's weights by key; a band's rows as the band says), as a phrase naming key and shapes;
    None when every one fits."""
    for key, entries in patches.items():
        shape = shapes.get(key)
        if shape is None or len(shape) != 2:
            continue
        for patch in entries:
            kind, weights = _is_lora_value(patch[1])
            if kind != "lora" or not weights or len(weights) < 2:
                continue
            up, down = weights[0], weights[1]
            rows, columns = shape
            offset = patch[3] if len(patch) > 3 else None
            if offset is not None and int(offset[0]) == 0:
                rows = int(offset[2])
            up_shape, down_shape = tuple(up.shape), tuple(down.shape)
            fits = (
                len(up_shape) == 2
                and len(down_shape) == 2
                and up_shape[0] == rows
                and down_shape[1] == columns
                and up_shape[1] == down_shape[0]
            )
            if not fits:
                return (
                    f"its patch of {key} is up {list(up_shape)} × down {list(down_shape)}, where"
                    f" that weight is {rows} × {columns} (out × in)"
                )
    return None


@dataclass
class PatchTable:
    """A table document (None when no patch is live) and the adapter matrices it names."""

    doc: dict[str, Any] | None
    adapters: dict[str, np.ndarray] = field(default_factory=dict)


class PatcherTables:
    """The patch table each patcher's patches were defined as (its id; None: no patch live),
    by their `patches_uuid`, and the patchers that sampled with each uuid (ComfyUI's clones
    share their original's). Once ComfyUI has let go of every patcher of a uuid (its LoRA
    dropped from the prompt), its table goes at the next sampling's start (`let_go`), unless
    another uuid's patchers name the same table, so the client no longer holds that table's
    matrices to define it again (docs/contract.md §7.6: LoRAs ComfyUI lets go of are freed)."""

    def __init__(self) -> None:
        self.ids: dict[Any, str | None] = {}
        self._patchers: dict[Any, weakref.WeakSet] = {}
        # uuids one of whose patchers has gone, appended by finalizers on whichever thread
        # collects it
        self._gone: list[Any] = []

    def defined(self, patcher: Any, uuid: Any, table_id: str | None) -> None:
        self.ids[uuid] = table_id
        self.watch(patcher, uuid)

    def watch(self, patcher: Any, uuid: Any) -> None:
        """`patcher` samples with the patches of `uuid` (each call: a clone may be new)."""
        patchers = self._patchers.setdefault(uuid, weakref.WeakSet())
        if patcher not in patchers:
            patchers.add(patcher)
            weakref.finalize(patcher, self._gone.append, uuid)

    def clear(self) -> None:
        self.ids.clear()

    def let_go(self, forget: Any) -> None:
        """`forget(table_id)` for each table no live patcher names any more."""
        while self._gone:
            uuid = self._gone.pop()
            if self._patchers.get(uuid):  # a clone of the same patches still samples
                continue
            self._patchers.pop(uuid, None)
            table_id = self.ids.pop(uuid, None)
            if table_id is not None and table_id not in self.ids.values():
                forget(table_id)


def _is_lora_value(value: Any) -> tuple[str, Any]:
    """(kind, weights) of a patch value: kind "lora" or another tag, "merge", "unknown"."""
    if isinstance(value, list):
        return "merge", None
    name = getattr(value, "name", None)
    if isinstance(name, str) and hasattr(value, "weights"):
        return name.lower(), value.weights
    if isinstance(value, tuple):
        if len(value) == 1:
            return "diff", None
        if len(value) == 2 and isinstance(value[0], str):
            return value[0].lower(), value[1]
    return "unknown", None


def _refusal(key: str, what: str) -> GmlxError:
    return GmlxError(f"gmlx: the server applies plain LoRA only; {key} carries {what}")


def to_wire_array(tensor: Any) -> np.ndarray:
    """An adapter matrix as it travels: F32, F16 or BF16 (uint16 bits) stay; others -> F32."""
    if isinstance(tensor, np.ndarray):
        array = tensor
    else:
        array = _torch_to_numpy(tensor)
    if array.dtype not in (np.float32, np.float16, np.uint16):
        array = array.astype(np.float32)
    return np.ascontiguousarray(array)


def _torch_to_numpy(tensor: Any) -> np.ndarray:
    t = tensor.detach().cpu()
    if str(t.dtype) == "torch.bfloat16":
        import torch  # present whenever a torch tensor is

        return t.contiguous().view(torch.int16).numpy().view(np.uint16)
    if str(t.dtype) in ("torch.float32", "torch.float16"):
        return t.contiguous().numpy()
    return t.float().contiguous().numpy()


class AdapterHashes:
    """Hashes of adapter matrices, memoised per tensor object and its in-place version. The
    memo holds no tensor (the wire array of a float tensor is a view that would keep it alive):
    an entry goes with its tensor, so LoRAs ComfyUI lets go of are freed."""

    def __init__(self) -> None:
        self._memo: dict[int, tuple[Any, int, str]] = {}

    def __len__(self) -> int:
        return len(self._memo)

    def hash(self, tensor: Any) -> tuple[str, np.ndarray]:
        version = version_of(tensor)
        # a view of a contiguous CPU f32/f16/bf16 tensor, else a copy: made per table built
        array = to_wire_array(tensor)
        key = id(tensor)
        held = self._memo.get(key)
        if held is not None and held[0]() is tensor and held[1] == version:
            return held[2], array
        digest = tensor_hash(array)
        try:
            ref = weakref.ref(tensor, lambda _, key=key: self._memo.pop(key, None))
        except TypeError:  # numpy arrays take weak references; plain objects may not
            return digest, array
        self._memo[key] = (ref, version, digest)
        return digest, array


def _band(offset: Any) -> list[int] | None:
    if offset is None:
        return None
    return [int(v) for v in offset]


def _alpha(alpha: Any) -> float | None:
    if alpha is None:
        return None
    return float(alpha.item() if hasattr(alpha, "item") else alpha)


def lora_patch(
    key: str, patch: tuple, hashes: AdapterHashes, adapters: dict[str, np.ndarray]
) -> dict[str, Any] | None:
    """The table patch of one ComfyUI patch entry, None when its strength is 0; refusals raise."""
    strength, value, strength_model, _offset, function = patch[:5]
    if float(strength) == 0.0 and float(strength_model) == 1.0:
        return None  # a switched-off patch changes nothing, whatever its kind
    kind, weights = _is_lora_value(value)
    if kind == "merge":
        raise _refusal(key, "a merge list")
    if kind != "lora":
        raise _refusal(key, ADAPTER_TITLES.get(kind, f"an unknown patch kind {kind!r}"))
    if float(strength_model) != 1.0:
        raise _refusal(key, f"strength_model {float(strength_model)} (a base-weight scale)")
    if function is not None:
        raise _refusal(key, "a patch function")
    up, down, alpha, mid, dora_scale, reshape = tuple(weights) + (None,) * (6 - len(weights))
    if mid is not None:
        raise _refusal(key, "a mid tensor (LoCon/Tucker)")
    if dora_scale is not None:
        raise _refusal(key, "DoRA")
    if reshape is not None:
        raise _refusal(key, "a reshape")
    up_hash, up_array = hashes.hash(up)
    down_hash, down_array = hashes.hash(down)
    adapters[up_hash] = up_array
    adapters[down_hash] = down_array
    return {
        "up": up_hash,
        "down": down_hash,
        "alpha": _alpha(alpha),
        "strength": float(strength),
        "strength_model": 1.0,
    }


def build_table(
    model_id: str,
    patches: dict[str, list[tuple]],
    hashes: AdapterHashes,
    hook_patches: dict | None = None,
    aliases: Aliases | None = None,
) -> PatchTable:
    """The patch table of a patcher's `patches` (docs/contract.md §7.7), patches on an alias
    landed on the manifest's layers."""
    if hook_patches:
        raise GmlxError("gmlx: hook patches (scheduled LoRA hooks) are not supported")
    adapters: dict[str, np.ndarray] = {}
    groups: dict[tuple[str, tuple | None], list[dict[str, Any]]] = {}
    for key, entries in patches.items():
        for patch in entries:
            table_patch = lora_patch(key, patch, hashes, adapters)
            if table_patch is None:
                continue
            band = _band(patch[3])
            landed = [(key, band, table_patch)]
            if aliases is not None:
                landed = aliases.land(key, band, table_patch, adapters)
            for target, target_band, placed in landed:
                group = (target, None if target_band is None else tuple(target_band))
                groups.setdefault(group, []).append(placed)
    if not groups:
        return PatchTable(doc=None)
    entries_out = [
        {"key": key, "band": None if band is None else list(band), "patches": groups[(key, band)]}
        for key, band in sorted(groups, key=_group_order)
    ]
    # an alias's whole up matrix travels only where a patch names it
    named = {p[side] for group in groups.values() for p in group for side in ("up", "down")}
    adapters = {digest: array for digest, array in adapters.items() if digest in named}
    return PatchTable(doc={"model": model_id, "entries": entries_out}, adapters=adapters)


def _group_order(group: tuple[str, tuple | None]) -> tuple:
    key, band = group
    # null band first, then bands in numeric order
    return (key, band is not None, band or ())
