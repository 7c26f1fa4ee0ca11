"""Krea 2 as an `ImageModel`: the DiT, the VAE and the prompt encoder of one folder.

The folder is diffusers' `Krea2Pipeline` layout (spec.py). The family takes no reference images.
It keeps no prefix states: every main block modulates the text tokens with the step's time, so
no part of the text's keys and values outlives a step; the text fusion depends on the
conditioning alone but runs once a step at a cost small beside the blocks'. Its facts as data
live in spec.py; its memory plan and model here.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from ...base import StepCall, StepResult, StepRow
from ...family import RESERVE_ROWS, FamilyModel, FolderFamily
from ...nn.attention import QUERY_CHUNK
from ...step_inputs import checked_patch_latents, checked_text_cond, cond_rows, row_sigmas
from ...vaes.qwen_image import QwenImageVAEPart
from .dit import Krea2DiT
from .layout import PATCH, DiTConfig
from .prompt import Krea2PromptEncoder
from .spec import MAX_SEQUENCE_LENGTH, SPEC, SUFFIX_TOKENS

LATENT_STRIDE = SPEC.latent_stride

# ------------------------------------------------------ memory plan (docs/contract.md §3.5)
# A step's peak beyond the weights, in buffers of the DiT's shapes, per token of a row:
TOKEN_WIDTH_BUFFERS = 12  # hidden, its normed and modulated forms, q, gate, the attention out, sums
TOKEN_F32_BUFFERS = 4  # q and k in float32 around their RMS norm and RoPE
MLP_BUFFERS = 8  # gate and up, SiLU's temporaries and the product, at the MLP's width
SCORE_BUFFERS = 3  # the scores, their softmax and its temporaries, per head and query chunk
# The reference workload behind status `activation_reserve_bytes` (family.RESERVE_PIXELS): a
# guided step (2 rows) with the longest conditioning the encoder gives, or one VAE pass.
RESERVE_TEXT = MAX_SEQUENCE_LENGTH + SUFFIX_TOKENS


def per_token_bytes(width: int, mlp: int, itemsize: int) -> int:
    return (
        TOKEN_WIDTH_BUFFERS * width * itemsize
        + TOKEN_F32_BUFFERS * width * 4
        + MLP_BUFFERS * mlp * itemsize
    )


def attention_bytes(heads: int, length: int, keys: int) -> int:
    """The scores of one attention over `length` queries and `keys` keys, in float32, a query
    chunk at a time as nn/attention.py runs them."""
    return SCORE_BUFFERS * heads * min(length, QUERY_CHUNK) * keys * 4


def step_peak_bytes(config: DiTConfig, itemsize: int, image: int, texts: list[int]) -> int:
    """Peak bytes of one step beyond the weights for rows of `texts` text tokens each over
    `image` image tokens: the larger of a row's text fusion (each token's layers as a sequence,
    then the tokens) and the main blocks' batch padded to the longest text. Pure."""
    if not texts:
        return 0
    longest = max(texts)
    fusion = longest * config.num_text_layers * per_token_bytes(
        config.text_dim, config.text_intermediate_size, itemsize
    ) + attention_bytes(config.text_heads, longest, longest)
    length = longest + image
    blocks = len(texts) * (
        length * per_token_bytes(config.dim, config.intermediate_size, itemsize)
        + attention_bytes(config.num_heads, length, length)
    )
    return max(fusion, blocks)


class Krea2Model(FamilyModel):
    """A loaded Krea 2: its DiT, Qwen3-VL's tapped text layers and Qwen-Image's VAE; no
    references, no prefix states."""

    DIT = Krea2DiT
    PROMPT = Krea2PromptEncoder
    VAE = QwenImageVAEPart()

    @classmethod
    def reserve_bytes(cls, config: DiTConfig, image_tokens: int, dtype: mx.Dtype) -> int:
        return step_peak_bytes(config, dtype.size, image_tokens, [RESERVE_TEXT] * RESERVE_ROWS)

    def step_peak_bytes(
        self, x_shape: tuple, rows: list[StepRow] | None, table=None, plans=None
    ) -> int:
        """Without rows (the quick plan) the image tokens alone; with them each row's text."""
        batch, _, h, w = x_shape
        texts = [1] * batch if rows is None else [max(1, cond_rows(row)) for row in rows]
        image = (h // PATCH) * (w // PATCH)
        return step_peak_bytes(self.dit.config, self.dit.dtype.size, image, texts)

    def step(
        self, x: np.ndarray, timestep: np.ndarray, rows: list[StepRow], call: StepCall
    ) -> StepResult:
        """dx/dsigma for x (B, C, h, w) at sigma = timestep (both conventions: timestep = sigma,
        out = +dx/dsigma), one row per batch entry: the DiT's output as it is."""
        config = self.dit.config
        channels = config.latent_channels
        x = checked_patch_latents(x, rows, channels, LATENT_STRIDE, PATCH, self.title)
        sigma = row_sigmas(timestep, x.shape[0])
        conds = [mx.array(self._check_cond(row, index)) for index, row in enumerate(rows)]
        started = time.perf_counter()
        weights = self.tables.weights_for(call.table)
        out = self.dit.forward(mx.array(x), mx.array(sigma), conds, weights).astype(mx.float32)
        mx.eval(out)
        forward_ms = (time.perf_counter() - started) * 1000.0
        return StepResult(out=np.array(out), prefix_cache="none", forward_ms=forward_ms)

    def _check_cond(self, row: StepRow, index: int) -> np.ndarray:
        """A row's conditioning (1, L, layers x text width) as the DiT's (L, layers, width)."""
        config = self.dit.config
        cond = checked_text_cond(row, index, config.cond_width, self.title)
        return cond.reshape(cond.shape[0], config.num_text_layers, config.text_dim)


KREA2 = FolderFamily(SPEC, Krea2Model)
