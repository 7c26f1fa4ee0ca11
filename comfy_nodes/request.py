"""From ComfyUI's DiT call to the rows of a step request (docs/contract.md §7.5). Pure: numpy only.

The ComfyUI glue (model.py) calls these functions with torch tensors, tests with numpy arrays;
tensors become float32 numpy arrays only to be hashed or uploaded. Nothing here imports
ComfyUI or torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import GmlxError
from .tensor_hashes import TensorHashes, row_source

# DiT inputs the server honours (the rest of a call with a value is refused by name).
ACCEPTED_INPUTS = frozenset(
    ("num_tokens", "attention_mask", "ref_latents", "image_slots", "ref_latents_method")
)
# transformer_options keys ComfyUI sets on every call, or that carry nothing for the DiT.
KNOWN_OPTIONS = frozenset(
    (
        "cond_or_uncond",
        "uuids",
        "sigmas",
        "sample_sigmas",
        "wrappers",
        "callbacks",
        "patches",
        "patches_replace",
        "rope_options",
        "qwen_image21_cache",
        "transformer_index",
        "block_index",
        "original_shape",
        "activations_shape",
        "hooks",
        "model_options",
    )
)
# The wrapper type whose functions replace the DiT forward itself (ComfyUI's WrappersMP).
DIFFUSION_MODEL_WRAPPER = "diffusion_model"
# What ComfyUI's Flux KV Cache node (comfy_extras/nodes_flux.py) patches the model with: an
# attn1 patch object of this class and a post-input patch function of this name. The server's
# `ref_cache` step field stands in for them (docs/contract.md §3.4, §7.5).
FLUX_KV_CACHE_PATCHES = {"attn1_patch": "KV_Attn_Input", "post_input": "model_input_patch"}
# What ComfyUI's skip-layer guidance nodes (comfy_extras/nodes_slg.py: SkipLayerGuidanceDiT,
# SkipLayerGuidanceDiTSimple) put in `patches_replace["dit"]` for each block they leave out: the
# key (kind, index) and their identity function `skip`, defined in the node's method (ComfyUI
# names the module by its file's path). The server's `skip` step field stands in for them where
# it lists `skip_blocks` (docs/contract.md §7.5).
SKIP_LAYER_MODULE = ("comfy_extras", "nodes_slg")
SKIP_LAYER_NODES = frozenset(("SkipLayerGuidanceDiT", "SkipLayerGuidanceDiTSimple"))
SKIP_LAYER_KIND = "single_block"


class RowTensors(Mapping):
    """The row tensors of a step by hash, made float32 arrays only when read: the client reads
    only those it must upload (not known to be on the server)."""

    def __init__(self) -> None:
        self._parts: dict[str, Any] = {}

    def add(self, digest: str, part: Any) -> None:
        self._parts.setdefault(digest, part)

    def __getitem__(self, digest: str) -> np.ndarray:
        return as_f32(self._parts[digest])

    def __iter__(self) -> Iterator[str]:
        return iter(self._parts)

    def __len__(self) -> int:
        return len(self._parts)


@dataclass
class StepRows:
    """The rows of one step request and the row tensors they name, by hash."""

    rows: list[dict[str, Any]]
    tensors: RowTensors = field(default_factory=RowTensors)


def as_f32(tensor: Any) -> np.ndarray:
    """A C-contiguous float32 numpy array (copy if needed) of a numpy array or torch tensor:
    the form tensors are hashed and sent in."""
    if not isinstance(tensor, np.ndarray):  # a torch tensor
        tensor = tensor.detach().cpu().float().contiguous().numpy()
    return np.ascontiguousarray(tensor, dtype=np.float32)


def typed_where_it_belongs(conds: Mapping[str, Any]) -> Any:
    """The conditioning a call steps on: where the server rewrote the prompt (prompt
    upsampling), the prompt as typed for a negative or an edit (docs/contract.md §7.4), as
    the FLUX.3 pipelines never rewrite those; else the encoded one. A conditioning ComfyUI
    zeroed (ConditioningZeroOut, which keeps the other keys) stays zero."""
    typed, encoded = conds.get("gmlx_cond_typed"), conds.get("cross_attn")
    if typed is None or not (
        conds.get("prompt_type") == "negative" or conds.get("reference_latents")
    ):
        return encoded
    zeroed = encoded is not None and not np.any(as_f32(encoded))  # read only where it decides
    return encoded if zeroed else typed


def row_of(batch: Any, i: int, length: int | None = None) -> Any:
    """Row i of a batched tensor, or row 0 when its batch is 1 (broadcast); its first `length`
    entries along dim 1 when given. When the pack concatenated `batch`, the row is read from
    the tensor it came from (`row_source`) where that holds the same values: a tensor that
    outlives the step, so its hash is memoised across steps."""
    j = 0 if batch.shape[0] == 1 else i
    length = batch.shape[1] if length is None else length
    source = row_source(batch, j)
    if source is not None and length <= source.shape[1] and source.shape[2:] == batch.shape[2:]:
        return source[:, :length]
    return batch[j : j + 1, :length]


def build_rows(
    batch_size: int,
    context: Any,
    *,
    num_tokens: list[int] | None = None,
    ref_latents: list[Any] | None = None,
    image_slots: list[list[int]] | None = None,
    prefix_cache: bool = True,
    hashes: TensorHashes | None = None,
) -> StepRows:
    """One row per batch entry of x.

    `context` is (B or 1, L, D); `num_tokens[i]` the real length of row i when the pack padded
    rows of different lengths to one tensor (else L). The row's `cond` is the hash of its
    context rows [0, n) as F32 (1, n, D), which is exactly what `encode` answered, so an encoded
    conditioning needs no upload. `ref_latents` are (B or 1, C, h, w) tensors in model space;
    `image_slots[i]` the wire-form slots of row i. Tensors are numpy arrays or torch tensors;
    `hashes` memoises their hashes across calls (a fresh one hashes every tensor).
    """
    if context.ndim != 3:
        raise GmlxError(f"gmlx: the conditioning has shape {list(context.shape)}, not (B, L, D)")
    if context.shape[0] not in (1, batch_size):
        raise GmlxError(
            f"gmlx: the conditioning batch {context.shape[0]} does not match the latent "
            f"batch {batch_size}"
        )
    out = StepRows(rows=[])
    namer = _Namer(TensorHashes(as_f32) if hashes is None else hashes, out.tensors)
    for i in range(batch_size):
        out.rows.append(
            _row(i, context, num_tokens, ref_latents or [], image_slots, prefix_cache, namer)
        )
    return out


@dataclass
class _Namer:
    """Names row tensors by hash and keeps them for upload."""

    hashes: TensorHashes
    tensors: RowTensors

    def __call__(self, part: Any) -> str:
        digest = self.hashes.digest(part)
        self.tensors.add(digest, part)
        return digest


def _row(
    i: int,
    context: Any,
    num_tokens: list[int] | None,
    ref_latents: list[Any],
    image_slots: list[list[int]] | None,
    prefix_cache: bool,
    named: _Namer,
) -> dict[str, Any]:
    length = context.shape[1]
    if num_tokens is not None:
        length = int(num_tokens[0] if len(num_tokens) == 1 else num_tokens[i])
        if not 0 < length <= context.shape[1]:
            raise GmlxError(f"gmlx: row {i} names {length} tokens of {context.shape[1]}")
    row: dict[str, Any] = {"cond": named(row_of(context, i, length)), "num_tokens": length}
    if ref_latents:
        row["ref_latents"] = [named(row_of(ref, i)) for ref in ref_latents]
    if image_slots:
        slots = image_slots[0] if len(image_slots) == 1 else image_slots[i]
        if slots:
            row["image_slots"] = [int(s) for s in slots]
    if not prefix_cache:
        row["prefix_cache"] = False
    return row


# The node that makes a latent of the sides a model takes (comfy_nodes/nodes.py).
EMPTY_LATENT_NODE = "gmlx Empty Latent"


# The status members a MODEL is built from and reads (a member path each): what it is, its
# latent format and its sampling. A model id the server has come to serve other weights under
# answers others; members a newer server adds beside them change nothing.
MODEL_FACTS = (
    "family",
    "variant",
    "comfy.model_class",
    "latent.channels",
    "latent.stride",
    "latent.patch",
    "vae.latents_mean",
    "vae.latents_std",
    "vae.space",
    "sampling.shift",
    "sampling.sigmas",
    "sampling.schedule",
    "sampling.timestep_scale",
    "conditioning.ref_method",
)


def changed_facts(built_from: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """The MODEL_FACTS in which the status `now` differs from `built_from`."""
    return [path for path in MODEL_FACTS if _member(built_from, path) != _member(now, path)]


def _member(status: Mapping[str, Any], path: str) -> Any:
    value: Any = status
    for key in path.split("."):
        value = value.get(key) if isinstance(value, Mapping) else None
    return value


def latent_patch(status: Mapping[str, Any]) -> int:
    """The side, in latent cells, of the model's DiT patch (status `latent.patch`)."""
    return int((status.get("latent") or {}).get("patch") or 1)


def wrapped_to_patch(x: np.ndarray, patch: int) -> np.ndarray:
    """Latents (B, C, [frames,] h, w) with sides made whole patches: the bottom rows and right
    columns wrap round from the top and left, as ComfyUI's own DiTs pad theirs (common_dit's
    pad_to_patch_size, circular), so a latent of any size the VAE makes samples as it does on
    ComfyUI's own Z-Image; the step's answer is cut back to (h, w)."""
    height, width = x.shape[-2:]
    extra = (-height % patch, -width % patch)
    if extra == (0, 0):
        return x
    leading = [(0, 0)] * (x.ndim - 2)  # batch, channels (and a video's frames)
    return np.pad(x, [*leading, (0, extra[0]), (0, extra[1])], mode="wrap")


def step_timestep(timestep: np.ndarray, batch_size: int) -> np.ndarray:
    """ComfyUI's timesteps as F32 (B,): one per row, broadcast when ComfyUI gives one."""
    t = as_f32(np.asarray(timestep).reshape(-1))
    if t.size == 1 and batch_size > 1:
        t = np.full(batch_size, t[0], dtype=np.float32)
    if t.size != batch_size:
        raise GmlxError(f"gmlx: {t.size} timesteps for a batch of {batch_size}")
    return t


def qwen_image21_cache(transformer_options: dict[str, Any]) -> dict:
    """ComfyUI's Qwen-Image 2.1 cache option ({"device": auto|gpu|cpu|off, "dtype":
    default|int8|int4}); {} where none is set."""
    cache = transformer_options.get("qwen_image21_cache")
    return cache if isinstance(cache, dict) else {}


def prefix_cache_enabled(transformer_options: dict[str, Any]) -> bool:
    """False when ComfyUI's Qwen-Image 2.1 cache option turns the device cache off."""
    return qwen_image21_cache(transformer_options).get("device") != "off"


@dataclass
class CallCheck:
    """What a DiT call asks that the server cannot honour, and the option keys nobody knows."""

    refusals: list[str]
    unknown_options: list[str]
    # Words that name the upstream ComfyUI nodes likely to have caused the refusals.
    suspect_words: list[str] = field(default_factory=list)
    # ComfyUI's Flux KV Cache node is on, and the server takes `ref_cache` in its place.
    ref_cache: bool = False
    # The blocks skip-layer guidance leaves out of this call, sent as the step's `skip`.
    skip: list[int] = field(default_factory=list)


def is_flux_kv_cache(patches: Any) -> bool:
    """Whether a transformer_options `patches` holds ComfyUI's Flux KV Cache patches alone."""
    if not isinstance(patches, dict) or set(patches) != set(FLUX_KV_CACHE_PATCHES):
        return False
    for name, expected in FLUX_KV_CACHE_PATCHES.items():
        entries = patches[name]
        if not isinstance(entries, list) or len(entries) != 1:
            return False
        entry = entries[0]
        found = type(entry).__name__ if name == "attn1_patch" else getattr(entry, "__name__", "")
        if found != expected:
            return False
    return True


def skipped_blocks(patches_replace: Any) -> list[int] | None:
    """The single-stream blocks a `patches_replace` of ComfyUI's skip-layer guidance alone
    leaves out (sorted), else None: any other patch, or another kind of block."""
    if not isinstance(patches_replace, dict) or set(patches_replace) != {"dit"}:
        return None
    entries = patches_replace["dit"]
    if not isinstance(entries, dict) or not entries:
        return None
    blocks = []
    for key, function in entries.items():
        if not (isinstance(key, tuple) and len(key) == 2 and key[0] == SKIP_LAYER_KIND):
            return None
        if not isinstance(key[1], int) or not is_skip_layer_patch(function):
            return None
        blocks.append(key[1])
    return sorted(blocks)


def is_skip_layer_patch(function: Any) -> bool:
    """Whether a block patch is the identity `skip` of one of ComfyUI's skip-layer nodes."""
    module = str(getattr(function, "__module__", "")).replace("\\", "/").replace(".", "/")
    owner = str(getattr(function, "__qualname__", "")).split(".")[0]
    return (
        tuple(module.split("/")[-2:]) == SKIP_LAYER_MODULE
        and owner in SKIP_LAYER_NODES
        and getattr(function, "__name__", None) == "skip"
    )


def check_call(
    extra_inputs: dict[str, Any],
    transformer_options: dict[str, Any],
    *,
    control: Any = None,
    guidance_embedder: bool = False,
    edit_capable: bool = True,
    default_ref_method: str | None = "index",
    ref_cache: bool = False,
    skip_blocks: bool = False,
) -> CallCheck:
    """Collect refusals for one DiT call (docs/contract.md §7.5), without raising. `ref_cache`:
    the server has the `ref_cache` feature, so ComfyUI's Flux KV Cache node is honoured by it
    (the check's `ref_cache`) rather than refused as an attention patch; `skip_blocks`: the
    server has that feature, so skip-layer guidance over single-stream blocks is sent as the
    step's `skip` (the check's `skip`)."""
    refusals: list[str] = []
    words: list[str] = []
    skip = skipped_blocks(transformer_options.get("patches_replace")) if skip_blocks else None
    kv_cache = is_flux_kv_cache(transformer_options.get("patches"))
    if kv_cache and not ref_cache:
        refusals.append("ComfyUI's Flux KV Cache (this server has no ref_cache feature)")
        words += ["Cache"]
    if control is not None:
        refusals.append("ControlNet (the server runs no control models)")
        words += ["ControlNet"]
    for name in ("patches", "patches_replace"):
        if (name == "patches" and kv_cache) or (name == "patches_replace" and skip):
            continue
        if transformer_options.get(name):
            kinds = ", ".join(sorted(map(str, transformer_options[name])))
            refusals.append(f"transformer_options {name} ({kinds}): attention/block patches")
            words += ["Attention", "Patch", "FreeU", "Perturbed", "SkipLayer", "Block", "Hook"]
    if transformer_options.get("rope_options"):
        refusals.append("transformer_options rope_options")
        words += ["Rope", "RoPE"]
    cache_dtype = qwen_image21_cache(transformer_options).get("dtype")
    if cache_dtype not in (None, "default"):
        refusals.append(
            f"Qwen-Image 2.1's cache dtype {cache_dtype!r} (the server keeps its prefix states"
            " at the model's own dtype: choose default)"
        )
        words += ["Cache"]
    wrappers = transformer_options.get("wrappers") or {}
    if isinstance(wrappers, dict) and any(wrappers.get(DIFFUSION_MODEL_WRAPPER, {}).values()):
        refusals.append("a diffusion-model wrapper")
        words += ["Wrapper", "Cache"]
    for name, value in sorted(extra_inputs.items()):
        if value is None or name in ACCEPTED_INPUTS:
            continue
        if name == "guidance" and not guidance_embedder:
            continue
        refusals.append(f"the DiT input {name!r}")
    if extra_inputs.get("ref_latents") and not edit_capable:
        refusals.append("reference latents on a model that takes none (edit_capable is false)")
    method = extra_inputs.get("ref_latents_method")
    if method is not None and method != default_ref_method:
        refusals.append(
            f"reference placement method {method!r} (the DiT's is {default_ref_method!r})"
        )
    unknown = sorted(k for k in transformer_options if k not in KNOWN_OPTIONS)
    return CallCheck(
        refusals=refusals,
        unknown_options=unknown,
        suspect_words=words,
        ref_cache=kv_cache and ref_cache,
        skip=skip or [],
    )


def suspects(class_types: list[str], words: list[str]) -> list[str]:
    """The node classes of a prompt whose names contain any of `words`."""
    lowered = [w.lower() for w in words]
    return sorted({c for c in class_types if any(w in c.lower() for w in lowered)})


def refusal_text(refusals: list[str], upstream: str = "") -> str:
    """The error text for a refused call."""
    what = "; ".join(refusals)
    return f"gmlx: the remote model cannot honour {what}{upstream}"
