"""MOSS-Image as an `ImageModel`: the DiT, the VAE and the prompt encoder of one folder.

The folder is upstream's diffusers custom pipeline layout (spec.py). The family takes no
reference images. Its steps may leave main blocks out (`skip`, docs/contract.md §2.11): the
pipeline's negative pass skips `sampling.neg_skip`, which a client sends as the negative row's
own step. A step's timestep is 1000 sigma (timestep_scale 0.001), which the DiT embeds as it
is. It keeps no prefix states: every block modulates the text tokens with the step's time.
Its facts as data live in spec.py; its memory plan and model here.
"""

from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from ...base import StepCall, StepResult, StepRow
from ...family import FolderFamily
from ...step_inputs import checked_cond, checked_nonempty_latents, cond_rows, row_sigmas
from ...step_memory import JointTokenModel, TokenBuffers
from ...vaes.autoencoder_kl_flux2 import AutoencoderKLFlux2Part
from ...weights import read_config
from .dit import MOSSImageDiT
from .layout import DiTConfig
from .prompt import MOSSImagePromptEncoder
from .spec import SPEC


class MOSSImageModel(JointTokenModel):
    """A loaded MOSS-Image: its DiT, Qwen3.5's prompt and FLUX.2's VAE with its own decoder;
    its steps may skip main blocks; no references, no prefix states."""

    DIT = MOSSImageDiT
    PROMPT = MOSSImagePromptEncoder
    VAE = AutoencoderKLFlux2Part()
    # A step's peak beyond the weights, in buffers of the DiT's shapes per token of a row:
    # hidden, normed, modulated, q, k, v, attention out, residual sums; q and k in float32
    # around their RMS norm; the fused up/gate, SITU's temporaries and the product at the
    # feed-forward's width; cpu_ops.attention's block of scores and its temporaries.
    BUFFERS = TokenBuffers(width=14, f32=4, mlp=8, score_block=10)
    RESERVE_TEXT = 512  # the reference workload's prompts

    def step_peak_bytes(
        self, x_shape: tuple, rows: list[StepRow] | None, table=None, plans=None
    ) -> int:
        """Without rows (the quick plan) the image tokens alone; with them each row's text."""
        batch, _, h, w = x_shape
        texts = [1] * batch if rows is None else [max(1, cond_rows(row)) for row in rows]
        return self.rows_peak_bytes([h * w + text for text in texts])

    def step(
        self, x: np.ndarray, timestep: np.ndarray, rows: list[StepRow], call: StepCall
    ) -> StepResult:
        """dx/dsigma for x (B, 128, h, w) at timestep = 1000 sigma (both conventions), one row
        per batch entry, the main blocks `call.skip` names left out."""
        config = self.dit.config
        x = checked_nonempty_latents(x, rows, config.latent_channels)
        times = row_sigmas(timestep, x.shape[0])  # the timesteps themselves: 1000 sigma
        texts = [mx.array(checked_cond(row, i, config.cond_width)) for i, row in enumerate(rows)]
        weights = self.tables.weights_for(call.table)
        started = time.perf_counter()
        out = self.dit.forward(mx.array(x), times, texts, weights, call.skip)
        out = out.astype(mx.float32)
        mx.eval(out)
        forward_ms = (time.perf_counter() - started) * 1000.0
        return StepResult(out=np.array(out), prefix_cache="none", forward_ms=forward_ms)


class MOSSImageFamily(FolderFamily):
    """The folder family whose negative pass skips the pipeline's blocks where the DiT has
    them (a DiT of fewer blocks skips none)."""

    def sampling_row(self, model_dir: Path, variant: str) -> dict:
        row = super().sampling_row(model_dir, variant)
        depth = DiTConfig.from_dict(read_config(Path(model_dir) / "transformer")).num_layers
        return {**row, "neg_skip": [block for block in row["neg_skip"] if block < depth]}


MOSS_IMAGE = MOSSImageFamily(SPEC, MOSSImageModel)
