"""One denoise step of Qwen-Image 2.1: rows -> joint sequences, prefix states, the target pass.

Each row of a step is computed independently: its conditioning (text rows, references spliced in
at their wire-form slots) forms a prefix whose K/V per block is a `PrefixState`, held in a
`PrefixCache` (docs/contract.md §3.3); the target tokens of all rows then run as one batch, each row
attending to its own prefix, which is exact for rows of any lengths (no padding, no masks).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ...base import EngineInputError, StepCall, StepResult, StepRow, kept_image_slots
from ...lora import table_id
from ...nn.dtypes import dtype_name
from ...prefix_cache import PrefixCache
from ...step_inputs import checked_cond, checked_latents
from .dit import PrefixLayout, QwenImage21DiT

# Step conventions of this family (docs/contract.md §5.2): both read the timestep as sigma
# (scale 1, shift 0), return +dx/dsigma, and embed the time by the DiT's reference rule.
CONVENTIONS = {"comfy": (1.0, 0.0, 1.0), "reference": (1.0, 0.0, 1.0)}

SLOT_TOKENS = 4  # one image slot of the text encoder stands for 2x2 latent tokens


@dataclass(frozen=True)
class RowPlan:
    """A row turned into what the DiT needs: its prefix layout, inputs and cache key."""

    layout: PrefixLayout
    cond: np.ndarray  # (L, D) float32
    refs: tuple[np.ndarray, ...]  # each (h*w, C), packed in raster order
    key: tuple
    cache: bool


def sigmas_for(timestep: np.ndarray, batch: int, convention: str) -> np.ndarray:
    """The per-row sigma (float32) of a step's timestep under a convention (docs/contract.md §5.2)."""
    if convention not in CONVENTIONS:
        raise EngineInputError(
            f"unknown convention {convention!r} for qwen_image21; use one of {sorted(CONVENTIONS)}"
        )
    scale, shift, _ = CONVENTIONS[convention]
    values = np.asarray(timestep, dtype=np.float64).reshape(-1)
    if values.size == 1:
        values = np.repeat(values, batch)
    if values.size != batch:
        raise EngineInputError(f"timestep has {values.size} values for {batch} rows")
    return (scale * values + shift).astype(np.float32)


def plan_row(
    row: StepRow,
    row_index: int,
    dit: QwenImage21DiT,
    latent_hw: tuple[int, int],
    table_id: str | None,
) -> RowPlan:
    config = dit.config
    cond = checked_cond(row, row_index, config.context_in_dim)
    refs, shapes = [], []
    for index, latent in enumerate(row.ref_latents):
        packed, shape = _pack_reference(latent, config.in_channels, index)
        refs.append(packed)
        shapes.append(shape)
    slots = wire_slots(row.image_slots, len(refs), cond.shape[0])
    layout = PrefixLayout(cond.shape[0], tuple(shapes), slots)
    key = (
        row.cond_key,
        tuple(row.ref_keys),
        slots,
        latent_hw,
        table_id,
        dtype_name(dit.dtype),
    )
    return RowPlan(layout, cond, tuple(refs), key, row.prefix_cache)


def wire_slots(slots, num_refs: int, text_len: int) -> tuple[int, ...]:
    """Wire-form slots (base.kept_image_slots), a reference without one after the text."""
    kept = kept_image_slots(slots, num_refs, text_len)
    return kept + (text_len,) * (num_refs - len(kept))


def _pack_reference(latent, channels: int, index: int) -> tuple[np.ndarray, tuple[int, int]]:
    latent = np.asarray(latent, dtype=np.float32)
    if latent.ndim == 4 and latent.shape[0] == 1:
        latent = latent[0]
    if latent.ndim != 3 or latent.shape[0] != channels or 0 in latent.shape:
        raise EngineInputError(
            f"reference latent {index} must be ({channels}, h, w) or (1, {channels}, h, w),"
            " h and w at least 1,"
            f" got {tuple(np.shape(latent))}"
        )
    _, h, w = latent.shape
    if (h * w) % SLOT_TOKENS:
        raise EngineInputError(
            f"reference latent {index} is {h}x{w}: h*w must be divisible by {SLOT_TOKENS}"
            " (each image slot holds 2x2 latent tokens)"
        )
    return latent.reshape(channels, h * w).T, (h, w)


def prefix_header(plans: list[RowPlan], cache: PrefixCache) -> str:
    if any(not plan.cache for plan in plans):
        return "off"
    return "hit" if all(plan.key in cache for plan in plans) else "miss"


def denoise_step(
    dit: QwenImage21DiT,
    cache: PrefixCache,
    x: np.ndarray,
    timestep: np.ndarray,
    rows: list[StepRow],
    call: StepCall | None = None,
    weights: dict | None = None,
) -> StepResult:
    """Model output sign * dx/dsigma (float32, x's shape) for x (B, C, h, w), one row per entry,
    as `call` says (its convention, run, patch table and, when the caller already made them,
    the rows' `plans`: plan_row at x's size and the table; None: StepCall's defaults).
    `weights`: the tree of the patch table (server/engine/lora.py), None for none."""
    call = call or StepCall()
    x = checked_latents(x, rows, dit.config.in_channels)
    batch, channels, h, w = x.shape
    sigma = sigmas_for(timestep, batch, call.convention)
    sign = CONVENTIONS[call.convention][2]
    plans = call.plans
    if plans is None:
        plans = [plan_row(row, i, dit, (h, w), table_id(call.table)) for i, row in enumerate(rows)]
    header = prefix_header(plans, cache)

    started = time.perf_counter()
    states, fresh = _states_for(dit, cache, plans, call.run, weights)
    # New prefix states are evaluated before the target pass, not in its graph: there each
    # state's buffers, held for the run, were allocated among the pass's transient ones, whose
    # pages the C allocator then kept (the RSS grew 0.15 GB a block at full size).
    mx.eval([array for state in fresh for array in (*state.keys, *state.values)])
    tokens = mx.array(x.reshape(batch, channels, h * w).transpose(0, 2, 1))
    out = dit.target_forward(tokens, mx.array(sigma), states, h, w, weights)
    out = out.astype(mx.float32)
    if sign != 1.0:
        out = sign * out
    # Back to (B, C, h*w) in MLX, so the answer leaves as one contiguous block (a strided numpy
    # view would cost the container writer a slow gather of the whole output).
    out = mx.contiguous(out.transpose(0, 2, 1))
    mx.eval(out)
    forward_ms = (time.perf_counter() - started) * 1000.0
    return StepResult(
        out=host_view(out).reshape(x.shape), prefix_cache=header, forward_ms=forward_ms
    )


def host_view(array: mx.array) -> np.ndarray:
    """A read-only numpy view of an evaluated MLX array's memory (the view keeps the array
    alive): the step's answer goes to the socket from there, without a 2 MiB copy at
    1024x1024."""
    view = np.asarray(array)
    view.flags.writeable = False
    return view


def _states_for(dit, cache: PrefixCache, plans: list[RowPlan], run: str | None, weights):
    """The prefix state of each row: held ones reused, the others built (once per key within the
    call) and stored unless the row opted out. Returns (states, those built now)."""
    states, fresh, built = [], [], {}
    for plan in plans:
        state = cache.get(plan.key) if plan.cache else None
        if state is None:
            state = built.get(plan.key) if plan.cache else None
        if state is None:
            state = dit.prefix_state(
                plan.layout, mx.array(plan.cond), [mx.array(r) for r in plan.refs], weights
            )
            fresh.append(state)
            if plan.cache:
                built[plan.key] = state
        states.append(state)
    # New states go in still lazy (the caller evaluates them before the target pass); every state a
    # row used is pinned to the run, so it lives until the run ends.
    for key, state in built.items():
        cache.put(key, state, run)
    for plan in plans:
        if plan.cache:
            cache.pin(plan.key, run)
    return states, fresh
