"""Z-Image as an `ImageModel`: the DiT, the VAE and the prompt encoder of one folder.

The folder is diffusers' `ZImagePipeline` layout: model_index.json (`_class_name`
"ZImagePipeline"), transformer/, vae/ (the FLUX.1 AutoencoderKL), text_encoder/ (Qwen3, its
config's `model_type` "qwen3"), tokenizer/, scheduler/. The variant is the one whose static
shift is nearest the scheduler's `shift` (turbo: 3, base: 6). The family takes no reference
images and keeps no prefix states. Its facts as data (identification,
status facts, sampling) live in spec.py; its memory plan and model here.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from ...base import StepCall, StepResult, StepRow
from ...family import RESERVE_ROWS, FamilyModel, FolderFamily
from ...nn import cpu_ops
from ...nn.compiled import compile_enabled
from ...step_inputs import checked_patch_latents, checked_text_cond, cond_rows, row_sigmas
from ...vaes.autoencoder_kl import AutoencoderKLPart
from .dit import DiTConfig, ZImageDiT, padded
from .prompt import MAX_SEQUENCE_LENGTH, ZImagePromptEncoder
from .spec import SPEC

LATENT_STRIDE = SPEC.latent_stride
LATENT_PATCH = SPEC.latent_patch

# ------------------------------------------------------ memory plan (docs/contract.md §3.5)
# A step's peak beyond the weights, counted in buffers of the DiT's shapes, per token of a row:
TOKEN_WIDTH_BUFFERS = 10  # hidden, its normed form, q, k, v, the attention out, residual sums
TOKEN_F32_BUFFERS = 4  # q and k in float32 around their RMS norm and RoPE
MLP_BUFFERS = 8  # gate and up, SiLU's temporaries and the product, at the MLP's width
# Under mx.compile the fused kernels keep more alive: measured about 7 KB more per token on the
# tiny checkpoint (width 64, MLP width 170), counted as buffers at the MLP's width.
COMPILED_MLP_BUFFERS = 12
# cpu_ops.attention (the CPU backend in float32) holds one block of scores at a time per row.
# Under mx.compile its blocks no longer wait for each other and run side by side, so the plan
# counts every block of a row's scores at once besides (measured on the tiny checkpoint: a peak
# of 123 MiB compiled against 64 MiB eager for two rows of 2816 tokens, the excess in
# proportion to the block size).
SCORE_BLOCK_BUFFERS = 8
# The reference workload behind status `activation_reserve_bytes` (family.RESERVE_PIXELS): a
# guided step (2 rows) with captions of the longest prompt the encoder keeps, or one VAE pass
# (FLUX.1's VAE tiles only past 1024 pixels).
RESERVE_CAPTION = MAX_SEQUENCE_LENGTH


def step_peak_bytes(
    config: DiTConfig, itemsize: int, lengths: list[int], blocked: bool, compiled: bool
) -> int:
    """Peak bytes of one step beyond the weights for rows of `lengths` tokens each (image and
    caption, padded): the batch runs padded to the longest. Pure: no allocation."""
    if not lengths:
        return 0
    longest = max(lengths)
    per_token = (
        TOKEN_WIDTH_BUFFERS * config.dim * itemsize
        + TOKEN_F32_BUFFERS * config.dim * 4
        + (MLP_BUFFERS + (COMPILED_MLP_BUFFERS if compiled else 0)) * config.hidden_dim * itemsize
    )
    total = len(lengths) * longest * per_token
    if blocked:  # a block of scores per row (the rows' attentions may run side by side)
        rows, group = cpu_ops._block_shape(config.num_heads, longest, longest)
        block = SCORE_BLOCK_BUFFERS * min(rows, longest) * group * longest * 4
        every_block = config.num_heads * longest * longest * 4 if compiled else 0
        total += len(lengths) * (block + every_block)
    return total


class ZImageModel(FamilyModel):
    """A loaded Z-Image: its DiT, Qwen3's prompt and FLUX.1's VAE; no references, no prefix
    states."""

    DIT = ZImageDiT
    PROMPT = ZImagePromptEncoder
    VAE = AutoencoderKLPart()

    @classmethod
    def reserve_bytes(cls, config: DiTConfig, image_tokens: int, dtype: mx.Dtype) -> int:
        row = padded(image_tokens) + padded(RESERVE_CAPTION)
        blocked, compiled = cpu_ops.use_cpu_ops(dtype), compile_enabled(config.dim)
        return step_peak_bytes(config, dtype.size, [row] * RESERVE_ROWS, blocked, compiled)

    def step_peak_bytes(
        self, x_shape: tuple, rows: list[StepRow] | None, table=None, plans=None
    ) -> int:
        """Without rows (the quick plan) the image tokens alone; with them each row's caption."""
        batch, _, h, w = x_shape
        image = padded((h // LATENT_PATCH) * (w // LATENT_PATCH))
        captions = [0] * batch if rows is None else [padded(cond_rows(row)) for row in rows]
        # dit.cpu_ops was read at load: the quick plan runs on an HTTP thread, never asks MLX
        dit = self.dit
        lengths = [image + n for n in captions]
        return step_peak_bytes(
            dit.config, dit.dtype.size, lengths, dit.cpu_ops, dit.compiled_pass.enabled
        )

    def step(
        self, x: np.ndarray, timestep: np.ndarray, rows: list[StepRow], call: StepCall
    ) -> StepResult:
        """dx/dsigma for x (B, C, h, w) at sigma = timestep (both conventions: scale 1, shift
        0), one row per batch entry: the DiT's raw output at t = 1 - sigma, negated."""
        x = self._check_latents(x, rows)
        sigma = row_sigmas(timestep, x.shape[0])
        caps = [mx.array(self._check_cond(row, index)) for index, row in enumerate(rows)]
        started = time.perf_counter()
        t = mx.array(np.float32(1.0) - sigma)
        raw = self.dit.forward(mx.array(x), t, caps, self.tables.weights_for(call.table))
        out = -raw.astype(mx.float32)
        mx.eval(out)
        forward_ms = (time.perf_counter() - started) * 1000.0
        return StepResult(out=np.array(out), prefix_cache="none", forward_ms=forward_ms)

    def _check_latents(self, x: np.ndarray, rows: list[StepRow]) -> np.ndarray:
        channels = self.dit.config.in_channels
        return checked_patch_latents(x, rows, channels, LATENT_STRIDE, LATENT_PATCH, self.title)

    def _check_cond(self, row: StepRow, index: int) -> np.ndarray:
        return checked_text_cond(row, index, self.dit.config.cond_width, self.title)


Z_IMAGE = FolderFamily(SPEC, ZImageModel)
