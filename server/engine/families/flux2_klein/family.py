"""FLUX.2 klein (4B, 9B, 9B KV) as an `ImageModel`: the DiT, the VAE and the prompt encoder of
one folder. One module serves the three families (spec.py declares them).

The folder is diffusers' `Flux2KleinPipeline` layout (or `Flux2KleinKVPipeline`'s):
model_index.json (`_class_name`, `is_distilled`), transformer/, vae/ (AutoencoderKLFlux2),
text_encoder/ (Qwen3: Qwen3-4B for 4B, Qwen3-8B for 9B), tokenizer/, scheduler/; the DiT's
weights may be one file instead (BFL's safetensors or a GGUF file, in transformer/ or a model
entry's `dit`: dit.dit_file). The family is the KV one for the KV pipeline, else the 9B one for
a DiT of 9B's depth (8 double-stream blocks), else the 4B one; the variant is `distilled` when
model_index.json says `is_distilled` (always for the KV pipeline), else `base`. Its facts as data
(identification, status facts, sampling) live in spec.py; its memory plan and model here.

References are VAE latents only (the text encoder never reads images), in model space. They
run with the image tokens at the step's time (`joint`), except in the KV model's way (`kv`:
at time 0, attending to themselves only, their K/V per block depending on them alone), which
the KV family's own pipeline always uses (the `reference` convention: its step in parts, the
run keeping each row's reference K/V as its state, header hit/miss/off) and every family uses
with `ref_cache` (docs/contract.md §3.4), whose K/V the run keeps from its first step on.
Either way the run's end drops them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ...base import EngineInputError, StepCall, StepResult, StepRow
from ...family import FolderFamily
from ...lora import table_id
from ...step_inputs import (
    checked_cond,
    checked_nonempty_latents,
    cond_rows,
    ref_tokens,
    row_sigmas,
)
from ...step_memory import JointTokenModel, TokenBuffers
from ...vaes.autoencoder_kl_flux2 import AutoencoderKLFlux2Part
from .dit import (
    DiTConfig,
    Flux2DiT,
    RefState,
)
from .prompt import MAX_SEQUENCE_LENGTH, Flux2PromptEncoder
from .spec import FAMILY_9B_KV, SPECS


def ref_state_bytes(config: DiTConfig, itemsize: int, tokens: int) -> int:
    """Bytes of one row's reference K/V: K and V of every block."""
    blocks = config.num_layers + config.num_single_layers
    return 2 * blocks * tokens * config.dim * itemsize


@dataclass(frozen=True)
class StepPlan:
    """How a step runs its rows: the reference mode, and per row the key of its reference
    state (None: the row has no references, or they run joint)."""

    ref_mode: str
    keys: tuple[tuple | None, ...]


class Flux2KleinModel(JointTokenModel):
    """A loaded FLUX.2 klein of any of the three families (their capabilities alike): its
    DiT, Qwen3's tapped layers and FLUX.2's VAE; references joint or as K/V."""

    DIT = Flux2DiT
    PROMPT = Flux2PromptEncoder
    VAE = AutoencoderKLFlux2Part()
    # A step's peak beyond the weights, in buffers of the DiT's shapes per token of a row (the
    # tiny model's measured peaks: tests/families/flux2_klein/test_estimates.py): hidden,
    # normed, q, k, v, attention out, residual sums, projections; q and k in float32 around
    # their RMS norm and RoPE; the fused gate/up, SiLU's temporaries and the product at the
    # MLP's width; cpu_ops.attention's block of scores, its exponentials and their temporaries.
    BUFFERS = TokenBuffers(width=16, f32=4, mlp=8, score_block=10)
    RESERVE_TEXT = MAX_SEQUENCE_LENGTH  # the reference workload's captions: the padded length

    def __init__(self, model_dir: Path, model_id: str, variant: str, **arguments):
        super().__init__(model_dir, model_id, variant, **arguments)
        # run -> reference K/V by row key (docs/contract.md §3.4), dropped when the run ends
        self.ref_caches: dict[str, dict[tuple, RefState]] = {}

    # -- the step ----------------------------------------------------------------------------

    def _ref_mode(self, convention: str, ref_cache: bool) -> str:
        """How a step runs its references: "kv" (first, at time 0, their K/V reused: cached in
        the run, or the KV model's step in parts) or "joint" (in the one sequence). A
        `ref_cache` under a convention its capabilities refuse it never comes: the step route
        refuses it (`Capabilities.ref_cache_refusal`)."""
        return "kv" if ref_cache or convention in self.capabilities.in_parts else "joint"

    def _plan(self, rows: list[StepRow], table, convention: str, ref_cache: bool) -> StepPlan:
        mode = self._ref_mode(convention, ref_cache)
        keys = []
        for position, row in enumerate(rows):
            if mode == "joint" or not row.ref_latents:
                keys.append(None)
            else:
                keys.append((position, row.cond_key, tuple(row.ref_keys), table_id(table)))
        return StepPlan(mode, tuple(keys))

    def step_peak_bytes(
        self, x_shape: tuple, rows: list[StepRow] | None, table=None, plans=None
    ) -> int:
        """Without rows (the quick plan) the image tokens alone; with them each row's text and
        references (joint or not, at most), and for the KV family the references' K/V its
        reference convention builds for the step. A `ref_cache` step's K/V stay in the run:
        the memory plan counts them apart (`ref_cache_bytes`)."""
        batch, _, h, w = x_shape
        image = h * w
        if rows is None:
            return self.rows_peak_bytes([image] * batch)
        lengths = [image + cond_rows(row, MAX_SEQUENCE_LENGTH) + ref_tokens(row) for row in rows]
        states = 0
        if self.family == FAMILY_9B_KV:
            config, itemsize = self.dit.config, self.dit.dtype.size
            states = sum(ref_state_bytes(config, itemsize, ref_tokens(row)) for row in rows)
        return self.rows_peak_bytes(lengths) + states

    def ref_cache_bytes(self, rows: list[StepRow], table, run: str) -> int:
        """Bytes of the reference K/V a `ref_cache` step of the run would add (those the run
        does not hold yet): what the memory plan counts before the cache is built."""
        held = self.ref_caches.get(run, {})
        total = 0
        for key, row in zip(self._plan(rows, table, "comfy", True).keys, rows, strict=True):
            if key is not None and key not in held:
                total += ref_state_bytes(self.dit.config, self.dit.dtype.size, ref_tokens(row))
        return total

    def held_bytes(self) -> int:
        cached = sum(s.nbytes for states in self.ref_caches.values() for s in states.values())
        return self.tables.held_bytes + cached

    def end_run(self, run: str) -> None:
        self.ref_caches.pop(run, None)

    def step(
        self, x: np.ndarray, timestep: np.ndarray, rows: list[StepRow], call: StepCall
    ) -> StepResult:
        """dx/dsigma for x (B, 128, h, w) at sigma = timestep (both conventions), one row per
        batch entry: the DiT's output at t = sigma; `comfy` embeds the float32 time,
        `reference` the time as the compute dtype holds it (BFL's and diffusers' pipelines)."""
        convention, run, table, ref_cache = call.convention, call.run, call.table, call.ref_cache
        x = checked_nonempty_latents(x, rows, self.dit.config.in_channels)
        if ref_cache and run is None:
            raise EngineInputError("ref_cache needs a run")
        plan = self._plan(rows, table, convention, ref_cache)
        caps = [
            mx.array(checked_cond(row, i, self.dit.config.cond_width)) for i, row in enumerate(rows)
        ]
        refs = self.reference_arrays(rows, self.dit.config.in_channels)
        weights = self.tables.weights_for(table)
        started = time.perf_counter()
        header = "none"
        states = None
        if plan.ref_mode == "kv":
            # Without ref_cache this is the KV family's own step in parts: its rows' prefix_cache
            # flags decide whether the run keeps the states (docs/contract.md §3.3).
            off = not ref_cache and not all(row.prefix_cache for row in rows)
            kept = run is not None and not off
            held = self.ref_caches.setdefault(run, {}) if kept else {}
            with_refs = [key for key in plan.keys if key is not None]
            if with_refs:
                header = "off" if off else "hit" if all(k in held for k in with_refs) else "miss"
            states = [
                self._state(held, key, r, weights) for key, r in zip(plan.keys, refs, strict=True)
            ]
        t = mx.array(row_sigmas(timestep, x.shape[0]))
        out = self.dit.forward(
            mx.array(x),
            t,
            caps,
            refs if plan.ref_mode == "joint" else None,
            weights,
            ref_mode=plan.ref_mode,
            ref_states=states,
            fp32_time=convention == "comfy",
        ).astype(mx.float32)
        mx.eval(out)
        forward_ms = (time.perf_counter() - started) * 1000.0
        return StepResult(out=np.array(out), prefix_cache=header, forward_ms=forward_ms)

    def _state(self, held: dict, key, refs: list[mx.array], weights) -> RefState | None:
        if key is None:
            return None
        state = held.get(key)
        if state is None:
            state = self.dit.reference_states(refs, weights)
            held[key] = state
        return state

    def close(self) -> None:
        self.ref_caches.clear()
        super().close()


FLUX2_KLEIN = FolderFamily(SPECS[0], Flux2KleinModel, SPECS)
