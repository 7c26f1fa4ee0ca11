"""The twin-blocks family (tests only): a DiT of two block kinds with fused and unfused
projections and no prefix cache, Qwen3 as its text encoder and FLUX.1's AutoencoderKL as its
VAE (both shared parts of the engine), laid out as a family of the engine is, to prove that a
family is its folder: its spec, its DiT and these few lines (the conformance suite,
tests/families/test_conformance.py, finds it through conformance.py).

Status, manifest, checks and `gmlx model quantize`'s choice come from family.FolderFamily and
the parts; the generic half of the loaded model (status copy, manifest, patch tables, VAE
routes, planning defaults) is FamilyModel's.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
from gmlx_server.engine.base import EngineInputError, StepCall, StepResult
from gmlx_server.engine.family import FamilyModel, FolderFamily
from gmlx_server.engine.step_inputs import checked_cond, checked_latents, row_sigmas
from gmlx_server.engine.vaes.autoencoder_kl import AutoencoderKLPart

from .dit import Config, TwinBlocksDiT
from .prompt import TwinPromptEncoder
from .spec import SPEC

STEP_BUFFERS = 16  # activations of one token per row, in widths of the hidden size
RESERVE_CAPTION = 64  # the reference workload's caption rows


def step_peak_bytes(config: Config, itemsize: int, rows: int, tokens: int) -> int:
    """Every row's text and image tokens at the DiT's width, and its scores."""
    width = STEP_BUFFERS * max(config.hidden, config.mlp)
    return rows * tokens * (width * itemsize + tokens * 4 * config.heads)


class TwinBlocksModel(FamilyModel):
    DIT = TwinBlocksDiT
    PROMPT = TwinPromptEncoder
    VAE = AutoencoderKLPart()

    @classmethod
    def reserve_bytes(cls, config: Config, image_tokens: int, dtype: mx.Dtype) -> int:
        """A guided step (2 rows) with RESERVE_CAPTION caption rows."""
        return step_peak_bytes(config, dtype.size, 2, image_tokens + RESERVE_CAPTION)

    def step_peak_bytes(self, x_shape, rows, table=None, plans=None) -> int:
        """Every row's text (as long as its conditioning) and image tokens at the DiT's width."""
        batch, _, h, w = x_shape
        text = max((np.shape(row.cond)[-2] for row in rows), default=0) if rows else 0
        return step_peak_bytes(self.dit.config, self.dit.dtype.size, batch, text + h * w)

    def step(self, x, timestep, rows, call: StepCall) -> StepResult:
        """The DiT's output at sigma = timestep, one row at a time."""
        config = self.dit.config
        x = checked_latents(x, rows, config.in_channels)
        if any(row.ref_latents for row in rows):
            raise EngineInputError("the twin-blocks family takes no reference latents")
        batch, channels, h, w = x.shape
        sigmas = row_sigmas(timestep, batch)
        weights = self.tables.weights_for(call.table)
        started = time.perf_counter()
        outs = []
        for index, row in enumerate(rows):
            cond = checked_cond(row, index, config.cond_width)[None]
            tokens = mx.array(x[index].reshape(channels, h * w).T[None])
            out = self.dit.forward(weights, tokens, float(sigmas[index]), mx.array(cond))
            outs.append(out.astype(mx.float32)[0].T.reshape(channels, h, w))
        out = mx.stack(outs)
        mx.eval(out)
        return StepResult(np.array(out), "none", (time.perf_counter() - started) * 1000.0)


TWIN_BLOCKS = FolderFamily(SPEC, TwinBlocksModel)
