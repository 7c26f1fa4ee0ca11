"""The MOSS-Image diffusion transformer in MLX (upstream's `MOSSImageTransformer`, its weight
names).

A single-stream DiT over FLUX.2's 128-channel model-space latents, one token per latent cell.
A row's conditioning is Qwen3.5's final hidden states (L, text_dim). The text projection (a
linear, then two blocks of its own) brings them to the DiT's width; the row's [image, text]
sequence then runs through the main blocks, all modulated by one shared table of the time
(shift, scale and gate before attention and before the feed-forward), and the image tokens
leave through a modulated RMS norm and a linear head. Every block is a pre-norm attention (q
and k RMS-normed per head, rotated by a four-axis RoPE) and a SITU feed-forward,
`4 tanh(g / 4) sigmoid(g) x 25 tanh(h / 25)` of its up (h) and gate (g) halves. The norms are RMS
norms in float32.

RoPE positions, per axis (r, t, h, w): an image token at (0, L, i - (H - 1) / 2, j - (W - 1) / 2),
text token k at (0, k, 0, 0); each axis rotates head_dim / 8 frequency pairs of
`rope_base^(-n / (head_dim / 8))`, the axes one after another in each half of the head.

The time is embedded from the step's timestep (1000 sigma, as the pipeline hands it over) by a
float64 sinusoid, cos first. The output at that time is the flow velocity dx/dsigma.

The reference runs one sample at a time, unpadded. Here rows whose texts are of one length run
together and rows of other lengths apart, so nothing is padded either. `skip` leaves main
blocks out (skip-layer guidance's negative pass).
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import mlx.core as mx
import numpy as np

from ...base import Capabilities
from ...dit_file import Naming
from ...dit_network import DiTNetwork, DiTPart, by_layout, rows_of
from ...lora import BIAS, LinearSlot, block_slots, dense
from ...nn.attention import attention
from ...nn.rope import apply_rotary
from ...shard import ShardPlan
from ...shard_plan import attention_mlp_plan
from ...weights import block_weights, single_dit_file
from .layout import (
    BLOCK_NORMS,
    F32_WEIGHTS,
    FINAL_NORM,
    NORM_EPS,
    STACKS,
    TIME_MAX_PERIOD,
    TOP_LINEARS,
    UNBIASED,
    DiTConfig,
    stack_depth,
    stack_linears,
    tensor_shapes,
)

TITLE = "MOSS-Image"
ROPE_AXES = 4


def linear_slots(config: DiTConfig) -> dict[str, LinearSlot]:
    """Every linear layer of the DiT by its file name (the manifest's names less `.weight`)."""
    slots = {name: LinearSlot(key) for key, name in TOP_LINEARS.items()}
    for stack, prefix in STACKS.items():
        for i in range(stack_depth(stack, config)):
            slots |= block_slots((stack, i), prefix.format(i), stack_linears(stack))
    return slots


def sanitize(files: dict[str, mx.array], config: DiTConfig) -> dict:
    """The file's tensors as the forward's weight tree: the main blocks' q, k and v and the text
    blocks' up and gate concatenated so each group runs as one matmul; biases sit beside their
    linear under key + BIAS. `linear_slots` names the same places."""
    weights = {}
    for key, name in TOP_LINEARS.items():
        weights[key] = files[name + ".weight"]
        if key not in UNBIASED:
            weights[key + BIAS] = files[name + ".bias"]
    weights["final_norm"] = files[FINAL_NORM]
    for stack, prefix in STACKS.items():
        linears = stack_linears(stack)
        weights[stack] = []
        for i in range(stack_depth(stack, config)):
            p = prefix.format(i)
            block = block_weights(files, p, linears, BLOCK_NORMS)
            if stack == "text_blocks":
                for key, parts in linears.items():
                    biases = [files[p + name + ".bias"] for name in parts]
                    block[key + BIAS] = mx.concatenate(biases) if len(biases) > 1 else biases[0]
            weights[stack].append(block)
    return weights


def quantized(path: str) -> bool:
    """The weights a quantized load quantizes, by tree path: the main blocks' attention and
    feed-forward linears, which hold nearly all of the DiT. The text projection, the embedders,
    the modulations, the head and the norm scales keep the compute dtype (as upstream's MLX
    port keeps them)."""
    stack, _, rest = path.partition(".")
    return stack == "blocks" and rest.rpartition(".")[2] in stack_linears("blocks")


def shard_plan(config: DiTConfig) -> ShardPlan:
    """How the DiT splits over ranks (engine/shard.py): the main blocks are the pipeline (the
    text projection is whole on every rank); in every main block q, k and v (three segments,
    whole heads) and the feed-forward's up and gate halves (two segments) split by output rows,
    the attention output (whole heads) and the down projection by input columns."""
    return attention_mlp_plan({"blocks": STACKS["blocks"]}, config.head_dim, ("up_gate", "down"))


def shard_layout(config: DiTConfig) -> tuple[ShardPlan, dict[str, int]]:
    return shard_plan(config), {"blocks": config.num_layers}


# Single files in the upstream names (under a prefix such as `model.diffusion_model.` too).
NAMING = Naming()


# The DiT's single file (GGUF or safetensors) as the family reads it (weights.single_dit_file).
dit_file = single_dit_file(DiTConfig, linear_slots, tensor_shapes, NAMING, TITLE)


PART = DiTPart(
    dit_file, DiTConfig, linear_slots, quantized, sanitize, F32_WEIGHTS, shard_layout, tensor_shapes
)


def situ(hidden: mx.array, gate: mx.array) -> mx.array:
    """The SITU gate of the feed-forward: 4 tanh(g / 4) sigmoid(g) x 25 tanh(h / 25)."""
    return (4.0 * mx.tanh(gate / 4.0) * mx.sigmoid(gate)) * (25.0 * mx.tanh(hidden / 25.0))


def time_sinusoid(timesteps: np.ndarray, dim: int) -> np.ndarray:
    """(B, dim) float32: cos then sin of each timestep (as float32, then float64) times
    10000^(-i / half), computed in float64 as the reference does."""
    t = np.asarray(timesteps, dtype=np.float32).astype(np.float64)[:, None]
    half = dim // 2
    phase = t * TIME_MAX_PERIOD ** (-np.arange(half, dtype=np.float64) / half)
    return np.concatenate([np.cos(phase), np.sin(phase)], axis=1).astype(np.float32)


def rope_positions(height: int, width: int, text: int) -> np.ndarray:
    """(H*W + L, 4) float32 positions (r, t, h, w): image cells in raster order, then text."""
    rows, columns = np.meshgrid(np.arange(height), np.arange(width), indexing="ij")
    image = np.zeros((height * width, ROPE_AXES), dtype=np.float32)
    image[:, 1] = text
    image[:, 2] = rows.reshape(-1) - np.float32((height - 1) / 2)
    image[:, 3] = columns.reshape(-1) - np.float32((width - 1) / 2)
    words = np.zeros((text, ROPE_AXES), dtype=np.float32)
    words[:, 1] = np.arange(text, dtype=np.float32)
    return np.concatenate([image, words])


@functools.lru_cache(maxsize=16)
def rope_tables(height: int, width: int, text: int, head_dim: int, base: float) -> tuple:
    """(cos, sin), each (H*W + L, 1, head_dim) float32 (to broadcast over heads), the axes'
    angles side by side in each half of the head; made once per size, not per step."""
    bands = head_dim // (2 * ROPE_AXES)
    exponents = np.arange(bands, dtype=np.float32) / np.float32(bands)
    frequencies = (np.float32(1) / np.float32(base) ** exponents).astype(np.float32)
    angles = rope_positions(height, width, text)[..., None] * frequencies  # (N, 4, bands)
    angles = angles.reshape(angles.shape[0], -1)
    cos, sin = np.cos(angles), np.sin(angles)
    halves = [np.concatenate([table, table], axis=-1)[:, None, :] for table in (cos, sin)]
    return mx.array(halves[0]), mx.array(halves[1])


class MOSSImageDiT(DiTNetwork):
    PART = PART

    def capabilities(self, declared: Capabilities) -> Capabilities:
        """Every main block may be skipped."""
        return replace(declared, skip_blocks=self.config.num_layers)

    # -- pieces ------------------------------------------------------------------------------

    def rms_norm(self, x: mx.array, weight: mx.array) -> mx.array:
        """RMS norm in float32 times its scale, back in the compute dtype."""
        scale = weight.astype(mx.float32)
        return mx.fast.rms_norm(x.astype(mx.float32), scale, NORM_EPS).astype(self.dtype)

    def attention(self, block: dict, x: mx.array, rope: tuple) -> mx.array:
        """Self-attention of x (B, N, dim): q and k RMS-normed per head and rotated."""
        batch, length, _ = x.shape
        head_dim = self.config.head_dim
        q, k, v = mx.split(dense(block, "qkv", x), 3, axis=-1)
        # heads from the weights: all of them, or a rank's share in tensor mode (shard_plan)
        q = self.rms_norm(q.reshape(batch, length, -1, head_dim), block["norm_q"])
        k = self.rms_norm(k.reshape(batch, length, -1, head_dim), block["norm_k"])
        v = v.reshape(batch, length, -1, head_dim)
        cos, sin = (table.astype(self.dtype) for table in rope)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
        attended = attention(q, k, v, 1.0 / math.sqrt(head_dim), self.cpu_ops)
        return dense(block, "out", attended.transpose(0, 2, 1, 3).reshape(batch, length, -1))

    def feed_forward(self, block: dict, x: mx.array) -> mx.array:
        hidden, gate = mx.split(dense(block, "up_gate", x), 2, axis=-1)
        return dense(block, "down", situ(hidden, gate))

    def text_block(self, block: dict, x: mx.array, rope: tuple) -> mx.array:
        """A text projection block: pre-norm attention and feed-forward, no modulation."""
        x = x + self.attention(block, self.rms_norm(x, block["norm1"]), rope)
        return x + self.feed_forward(block, self.rms_norm(x, block["norm2"]))

    def main_block(self, block: dict, x: mx.array, modulation: mx.array, rope) -> mx.array:
        """A main block under the shared modulation (B, 6, 1, dim)."""
        shift_a, scale_a, gate_a, shift_f, scale_f, gate_f = (modulation[:, i] for i in range(6))
        normed = self.rms_norm(x, block["norm1"]) * (1 + scale_a) + shift_a
        x = x + self.attention(block, normed, rope) * gate_a
        normed = self.rms_norm(x, block["norm2"]) * (1 + scale_f) + shift_f
        return x + self.feed_forward(block, normed) * gate_f

    # -- the forward -------------------------------------------------------------------------

    def forward(
        self,
        x: mx.array,
        timesteps: np.ndarray,
        conds: list[mx.array],
        weights: dict | None = None,
        skip: tuple[int, ...] = (),
    ) -> mx.array:
        """The velocity (B, C, H, W) for latents x (B, C, H, W) at the timesteps (B,) (1000
        sigma), row b conditioned on conds[b] (L_b, text_dim), the main blocks in `skip` left
        out. `weights`: a tree carrying a LoRA table's pairs (default: the plain weights). Rows
        of one text length run together, compiled (nn/compiled.py), traced once per weight
        tree, size, text length and skip set."""
        w = self.weights if weights is None else weights
        embedded = mx.array(time_sinusoid(timesteps, self.config.freq_dim))
        skip = tuple(sorted(set(skip)))

        def run(rows: list[int]) -> mx.array:
            text = mx.stack([conds[row] for row in rows]).astype(self.dtype)
            latents = rows_of(x, rows).astype(self.dtype)
            signature = (id(w), latents.shape, text.shape[1], skip)
            return self.compiled_pass(signature, w, latents, rows_of(embedded, rows), text, skip)

        return by_layout([int(cond.shape[0]) for cond in conds], run)

    def _pass(
        self, w: dict, x: mx.array, embedded: mx.array, text: mx.array, skip: tuple[int, ...]
    ) -> mx.array:
        """The forward of rows sharing one text length, as a pure function of arrays (weights
        included), so `mx.compile` traces it once per shape. Every length comes from a shape."""
        batch, _, height, width = x.shape
        dim, cells = self.config.dim, height * width
        config = self.config
        cos, sin = rope_tables(height, width, text.shape[1], config.head_dim, config.rope_base)

        hidden = dense(w, "time_1", embedded.astype(self.dtype)[:, None])
        hidden = hidden.astype(mx.float32)
        time = dense(w, "time_2", (hidden * mx.sigmoid(hidden)).astype(self.dtype))
        modulation = dense(w, "modulation", time).reshape(batch, 6, 1, dim)
        head = dense(w, "head_modulation", time).reshape(batch, 2, 1, dim)

        words = dense(w, "text_in", text)
        text_rope = (cos[cells:], sin[cells:])
        for block in w["text_blocks"]:
            words = self.text_block(block, words, text_rope)
        image = dense(w, "video_in", self.tokens(x))
        tokens = mx.concatenate([image, words], axis=1)

        def run_block(index: int, block: dict, tokens: mx.array) -> mx.array:
            if index in skip:
                return tokens
            return self.main_block(block, tokens, modulation, (cos, sin))

        tokens = self.stages.run("blocks", w["blocks"], tokens, run_block)
        normed = self.rms_norm(tokens[:, :cells], w["final_norm"]) * (1 + head[:, 1]) + head[:, 0]
        out = dense(w, "final", normed)
        return self.grid(out, height, width)
