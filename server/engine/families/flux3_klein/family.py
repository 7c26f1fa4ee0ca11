"""FLUX.3 klein as an `ImageModel`: the DiT, the VAE and the prompt encoder of one folder.

The folder is diffusers' layout of the FLUX.3 modular pipelines (spec.py). References are VAE
latents only (the text encoder never reads images), in model space, up to MAX_REFS per row; they
run as their own token mode at time 0 beside the image tokens. The distilled checkpoint is a
flow map: each step names the schedule it follows (`sample_sigmas`, docs/contract.md §2.11), and
the DiT jumps from the row's time to the entry after the one nearest it (§5.2). It keeps no
prefix states: the text tokens are modulated by the step's target time in a flow map, and they
attend to the image tokens in every joint block. Its facts as data live in spec.py; its memory
plan and model here.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from ...base import EngineInputError, StepCall, StepResult, StepRow
from ...family import FolderFamily
from ...step_inputs import (
    checked_cond,
    checked_nonempty_latents,
    cond_rows,
    ref_tokens,
    row_sigmas,
)
from ...step_memory import JointTokenModel, TokenBuffers
from ...vaes.autoencoder_kl_flux2 import AutoencoderKLFlux2Part
from .dit import Flux3DiT
from .prompt import Flux3PromptEncoder
from .spec import PAD_MULTIPLE, SPEC


def flow_map_targets(sigmas: np.ndarray, sample_sigmas: np.ndarray) -> np.ndarray:
    """Each row's target time (docs/contract.md §5.2): the entry of the schedule after the one
    nearest the row's sigma, the last entry at most."""
    schedule = np.asarray(sample_sigmas, np.float32).reshape(-1)
    nearest = np.abs(schedule[None, :] - np.asarray(sigmas, np.float32)[:, None]).argmin(axis=1)
    return schedule[np.minimum(nearest + 1, schedule.size - 1)]


class Flux3KleinModel(JointTokenModel):
    """A loaded FLUX.3 klein: its DiT, Qwen3-VL's tapped text layers and FLUX.2's VAE;
    references as their own token mode; a flow map where the checkpoint is distilled."""

    DIT = Flux3DiT
    PROMPT = Flux3PromptEncoder
    VAE = AutoencoderKLFlux2Part()
    # A step's peak beyond the weights, in buffers of the DiT's shapes per token of a row:
    # hidden, normed, modulated, q, k, v, attention out, residual sums; q and k in float32
    # around their RMS norm and RoPE; the fused gate/up, SiLU's temporaries and the product at
    # the MLP's width; cpu_ops.attention's block of scores and its temporaries.
    BUFFERS = TokenBuffers(width=14, f32=4, mlp=8, score_block=10)
    RESERVE_TEXT = 4 * PAD_MULTIPLE  # the reference workload's prompts: the first padded length

    def step_peak_bytes(
        self, x_shape: tuple, rows: list[StepRow] | None, table=None, plans=None
    ) -> int:
        """Without rows (the quick plan) the image tokens alone; with them each row's text and
        references."""
        batch, _, h, w = x_shape
        if rows is None:
            return self.rows_peak_bytes([h * w] * batch)
        return self.rows_peak_bytes([h * w + cond_rows(row) + ref_tokens(row) for row in rows])

    def step(
        self, x: np.ndarray, timestep: np.ndarray, rows: list[StepRow], call: StepCall
    ) -> StepResult:
        """dx/dsigma for x (B, 128, h, w) at sigma = timestep (both conventions: timestep =
        sigma, out = +dx/dsigma, the DiT's time rule), one row per batch entry; a flow map's
        jump to the target `call.sample_sigmas` names."""
        config = self.dit.config
        x = checked_nonempty_latents(x, rows, config.in_channels)
        sigma = row_sigmas(timestep, x.shape[0])
        targets = None
        if config.flow_map:
            if call.sample_sigmas is None:
                raise EngineInputError(f"{self.title} is a flow-map DiT: send sample_sigmas")
            targets = mx.array(flow_map_targets(sigma, call.sample_sigmas))
        texts = [mx.array(checked_cond(row, i, config.cond_width)) for i, row in enumerate(rows)]
        refs = self.reference_arrays(rows, config.cond_in_channels)
        weights = self.tables.weights_for(call.table)
        started = time.perf_counter()
        out = self.dit.forward(mx.array(x), mx.array(sigma), texts, refs, targets, weights)
        out = out.astype(mx.float32)
        mx.eval(out)
        forward_ms = (time.perf_counter() - started) * 1000.0
        return StepResult(out=np.array(out), prefix_cache="none", forward_ms=forward_ms)


FLUX3_KLEIN = FolderFamily(SPEC, Flux3KleinModel)
