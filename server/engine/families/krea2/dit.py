"""The Krea 2 diffusion transformer in MLX (diffusers' `Krea2Transformer2DModel`, its weight
names).

A single-stream DiT over 16-channel latents cut into 2x2 patches. A row's conditioning is a stack
of text-encoder hidden states per token (L, num_text_layers, text_dim). The text fusion stage
collapses the layer axis (two blocks attending across the layers of each token, a linear
projector) and refines the token sequence (two blocks across the tokens), `txt_in` projects it to
the DiT's width, and the row's [text, image] sequence runs through the main blocks, each
modulated by one shared time vector plus its own learned table. Attention is grouped-query, its
output gated by a sigmoid of the input; the norms are RMS norms scaling by 1 + weight, in
float32. Text tokens sit at RoPE position (0, 0, 0), image tokens at (0, row, column).

The reference pads every prompt to a fixed length and masks the padded keys everywhere; a padded
token is never read back. Here a row carries its real tokens only, which gives the real tokens
the same answer. Rows of a batch with conditionings of different lengths are left-padded to the
longest, and each row attends over its own keys only (its keys are the last ones), so the padding
is never read either.

The DiT's raw output at time t = sigma is the flow velocity dx/dsigma, as the pipeline uses it.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import numpy as np

from ...dit_file import Naming
from ...dit_network import DiTNetwork, DiTPart
from ...lora import BIAS, LinearSlot, block_slots, dense, project
from ...nn.activations import gelu_tanh, silu
from ...nn.attention import attention
from ...nn.rope import apply_rope, rope_tables
from ...shard import ShardPlan, Split
from ...weights import block_weights, single_dit_file
from .layout import (
    BLOCK_LINEARS,
    BLOCK_NORMS,
    F32_WEIGHTS,
    FINAL_TABLE,
    MODULATION_TABLE,
    PATCH,
    PROJECTOR,
    STACKS,
    TIME_SCALE,
    TOP_LINEARS,
    TOP_NORMS,
    DiTConfig,
    stack_depth,
    tensor_shapes,
)


def linear_slots(config: DiTConfig) -> dict[str, LinearSlot]:
    """Every linear layer of the DiT by its diffusers name (the manifest's names less `.weight`)."""
    slots = {name: LinearSlot(key) for key, name in TOP_LINEARS.items()}
    slots[PROJECTOR] = LinearSlot("projector")
    for stack, prefix in STACKS.items():
        for i in range(stack_depth(stack, config)):
            slots |= block_slots((stack, i), prefix.format(i), BLOCK_LINEARS)
    return slots


def sanitize(files: dict[str, mx.array], config: DiTConfig) -> dict:
    """The file's tensors (diffusers names) as the forward's weight tree: q with the gate, k with
    v and the SwiGLU's gate with its up projection concatenated so each pair runs as one matmul;
    biases sit beside their linear under key + BIAS. `linear_slots` names the same places."""
    weights = {}
    for key, name in TOP_LINEARS.items():
        weights[key] = files[name + ".weight"]
        weights[key + BIAS] = files[name + ".bias"]
    weights["projector"] = files[PROJECTOR + ".weight"]
    for key, name in TOP_NORMS.items():
        weights[key] = files[name]
    weights["final_table"] = files[FINAL_TABLE]
    for stack, prefix in STACKS.items():
        weights[stack] = []
        for i in range(stack_depth(stack, config)):
            p = prefix.format(i)
            block = block_weights(files, p, BLOCK_LINEARS, BLOCK_NORMS)
            if stack == "blocks":
                block["table"] = files[p + MODULATION_TABLE]
            weights[stack].append(block)
    return weights


def quantized(path: str) -> bool:
    """The weights a quantized load quantizes, by tree path: the attention and feed-forward
    linears of the main blocks, which hold nearly all of the DiT. The text fusion (narrow, and
    run once per conditioning), the embedders, the modulation tables, the final layer and the
    norm scales keep the compute dtype."""
    stack, _, rest = path.partition(".")
    return stack == "blocks" and rest.rpartition(".")[2] in BLOCK_LINEARS


def shard_plan(config: DiTConfig) -> ShardPlan:
    """How the DiT splits over ranks (engine/shard.py): the main blocks are the pipeline (the
    text fusion, run once per conditioning, is whole on every rank); in every main block q with the gate and k with v (two segments each, whole heads) and
    the SwiGLU's gate with up split by output rows, the attention output (whole heads) and the
    down projection by input columns. A rank's query heads keep their key/value heads when the
    key/value heads split evenly, which the group refuses otherwise."""
    return ShardPlan(
        stacks=("blocks",),
        columns={
            "q_gate": Split(2, config.head_dim),
            "kv": Split(2, config.head_dim),
            "gate_up": Split(2),
        },
        rows={"out": Split(1, config.head_dim), "down": Split(1)},
        prefixes={"blocks": STACKS["blocks"]},
    )


def shard_layout(config: DiTConfig) -> tuple[ShardPlan, dict[str, int]]:
    return shard_plan(config), {"blocks": config.num_layers}


TITLE = "Krea 2"
# Single files in diffusers' names (under a prefix such as `model.diffusion_model.` too).
NAMING = Naming()


# The DiT's single file (GGUF or safetensors) as the family reads it (weights.single_dit_file).
dit_file = single_dit_file(DiTConfig, linear_slots, tensor_shapes, NAMING, TITLE)


PART = DiTPart(
    dit_file, DiTConfig, linear_slots, quantized, sanitize, F32_WEIGHTS, shard_layout, tensor_shapes
)


def image_positions(h: int, w: int) -> np.ndarray:
    """(h*w, 3): patch (i, j) at (0, i, j) in raster order (text tokens sit at (0, 0, 0))."""
    return np.stack([np.zeros(h * w), np.repeat(np.arange(h), w), np.tile(np.arange(w), h)], 1)


@functools.lru_cache(maxsize=16)
def image_rope(h: int, w: int, axes_dims: tuple[int, ...], theta: float) -> tuple:
    """The image tokens' RoPE tables for an h x w patch grid: made once per grid, not per step."""
    return rope_tables(image_positions(h, w), axes_dims, theta)


class Krea2DiT(DiTNetwork):
    PART = PART

    # -- pieces ------------------------------------------------------------------------------

    def rms_norm(self, x: mx.array, weight: mx.array) -> mx.array:
        """RMS norm scaling by 1 + weight, in float32 (`Krea2RMSNorm`)."""
        scale = 1.0 + weight.astype(mx.float32)
        return mx.fast.rms_norm(x.astype(mx.float32), scale, self.config.norm_eps).astype(
            self.dtype
        )

    def time_embedding(self, w: dict, t: mx.array) -> mx.array:
        """(B,) t -> (B, 1, hidden): cos-first sinusoid of 1000 t, then the two-layer MLP."""
        args = (TIME_SCALE * t.astype(mx.float32))[:, None, None] * self._time_freqs
        embedding = mx.concatenate([mx.cos(args), mx.sin(args)], axis=-1).astype(self.dtype)
        return dense(w, "time_2", gelu_tanh(dense(w, "time_1", embedding)))

    def attention(self, block: dict, x, head_dim: int, rope, starts: list[int]) -> mx.array:
        """Gated grouped-query self-attention of x (B, N, width); row b over its keys from
        starts[b] on; `rope`: (cos, sin) tables or None."""
        batch, length, _ = x.shape
        q, gate = mx.split(project(block, "q_gate", x), 2, axis=-1)
        k, v = mx.split(project(block, "kv", x), 2, axis=-1)
        # heads from the weights: all of them, or a rank's share in tensor mode (shard_plan)
        q = self.rms_norm(q.reshape(batch, length, -1, head_dim), block["norm_q"])
        k = self.rms_norm(k.reshape(batch, length, -1, head_dim), block["norm_k"])
        v = v.reshape(batch, length, -1, head_dim)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        groups = q.shape[2] // k.shape[2]
        q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
        if groups > 1:
            k, v = mx.repeat(k, groups, axis=1), mx.repeat(v, groups, axis=1)
        attended = self._rows_attention(q, k, v, head_dim, starts)
        merged = attended.transpose(0, 2, 1, 3).reshape(batch, length, -1)
        return project(block, "out", merged * mx.sigmoid(gate))

    def _rows_attention(self, q, k, v, head_dim: int, starts: list[int]) -> mx.array:
        """Each row's queries over its own keys (from starts[b] on); rows of one start together."""
        scale = 1.0 / math.sqrt(head_dim)
        if all(start == starts[0] for start in starts):
            s = starts[0]
            return attention(q, k[:, :, s:], v[:, :, s:], scale, self.cpu_ops)
        outputs = []
        for row, s in enumerate(starts):
            one = slice(row, row + 1)
            outputs.append(attention(q[one], k[one, :, s:], v[one, :, s:], scale, self.cpu_ops))
        return mx.concatenate(outputs, axis=0)

    def feed_forward(self, block: dict, x: mx.array) -> mx.array:
        gate, up = mx.split(project(block, "gate_up", x), 2, axis=-1)
        return project(block, "down", silu(gate) * up)

    def text_block(self, block: dict, x: mx.array, starts: list[int]) -> mx.array:
        """A text fusion block: pre-norm attention and SwiGLU, no RoPE, no modulation."""
        head_dim = self.config.text_head_dim
        x = x + self.attention(block, self.rms_norm(x, block["norm1"]), head_dim, None, starts)
        return x + self.feed_forward(block, self.rms_norm(x, block["norm2"]))

    def main_block(self, block: dict, x, modulation, rope, starts) -> mx.array:
        """A main block under the shared modulation (B, 1, 6, hidden) plus its own table."""
        mod = modulation + block["table"].astype(modulation.dtype)
        prescale, preshift, pregate, postscale, postshift, postgate = (
            mod[:, :, i] for i in range(6)
        )
        normed = (1 + prescale) * self.rms_norm(x, block["norm1"]) + preshift
        x = x + pregate * self.attention(block, normed, self.config.head_dim, rope, starts)
        normed = (1 + postscale) * self.rms_norm(x, block["norm2"]) + postshift
        return x + postgate * self.feed_forward(block, normed)

    # -- the forward -------------------------------------------------------------------------

    def patchify(self, x: mx.array) -> mx.array:
        """(B, C, H, W) -> (B, (H/p)(W/p), C*p*p): patches in raster order, (C, ph, pw) inside."""
        batch, channels, height, width = x.shape
        x = x.reshape(batch, channels, height // PATCH, PATCH, width // PATCH, PATCH)
        x = x.transpose(0, 2, 4, 1, 3, 5)
        return x.reshape(batch, (height // PATCH) * (width // PATCH), channels * PATCH * PATCH)

    def unpatchify(self, tokens: mx.array, height: int, width: int) -> mx.array:
        batch, channels = tokens.shape[0], self.config.latent_channels
        x = tokens.reshape(batch, height // PATCH, width // PATCH, channels, PATCH, PATCH)
        return x.transpose(0, 3, 1, 4, 2, 5).reshape(batch, channels, height, width)

    def forward(
        self, x: mx.array, t: mx.array, conds: list[mx.array], weights: dict | None = None
    ) -> mx.array:
        """The velocity (B, C, H, W) for latents x (B, C, H, W) at t = sigma (B,), row b
        conditioned on its text stack conds[b] (L_b, num_text_layers, text_dim). `weights`: a
        tree carrying a LoRA table's pairs (default: the plain weights). The pass runs compiled
        (nn/compiled.py), traced once per weight tree, size and conditioning lengths."""
        w = self.weights if weights is None else weights
        _, _, height, width = x.shape
        if height % PATCH or width % PATCH:
            raise ValueError(f"latents {height}x{width} must be multiples of the patch {PATCH}")
        config = self.config
        cos, sin = image_rope(height // PATCH, width // PATCH, config.axes_dims, config.rope_theta)
        lengths = tuple(int(cond.shape[0]) for cond in conds)
        signature = (id(w), x.shape, lengths)
        return self.compiled_pass(signature, w, x.astype(self.dtype), t, conds, (cos, sin))

    def fused_text(self, w: dict, cond: mx.array) -> mx.array:
        """One row's text stack (L, num_text_layers, text_dim) -> its tokens (L, hidden): the
        layerwise blocks across each token's layers, the projector over the layer axis, the
        refiner blocks across the tokens, then txt_in."""
        tokens = cond.astype(self.dtype)  # (L, layers, text_dim): L sequences of the layers
        for block in w["layerwise"]:
            tokens = self.text_block(block, tokens, [0])
        refined = dense(w, "projector", tokens.swapaxes(1, 2)).swapaxes(1, 2)  # (L, 1, text_dim)
        refined = refined.swapaxes(0, 1)  # one sequence of the L tokens
        for block in w["refiner"]:
            refined = self.text_block(block, refined, [0])
        hidden = dense(w, "txt_in_1", self.rms_norm(refined[0], w["txt_norm"]))
        return dense(w, "txt_in_2", gelu_tanh(hidden))

    def _pass(self, w: dict, x: mx.array, t: mx.array, conds: list[mx.array], rope) -> mx.array:
        """The forward as a pure function of arrays (weights included), so `mx.compile` traces
        it once per shape. Every length comes from a shape."""
        batch, _, height, width = x.shape
        hidden = self.config.dim
        temb = self.time_embedding(w, t)  # (B, 1, hidden)
        modulation = dense(w, "time_mod", gelu_tanh(temb)).reshape(batch, 1, 6, hidden)

        texts = [self.fused_text(w, cond) for cond in conds]
        longest = max(text.shape[0] for text in texts)
        starts = [longest - text.shape[0] for text in texts]  # left padding: own keys last
        text = mx.stack(
            [mx.pad(row, ((start, 0), (0, 0))) for row, start in zip(texts, starts, strict=True)]
        )
        image = dense(w, "img_in", self.patchify(x))
        tokens = mx.concatenate([text, image], axis=1)

        cos, sin = rope
        ones, zeros = mx.ones((longest, 1, cos.shape[-1])), mx.zeros((longest, 1, cos.shape[-1]))
        tables = (mx.concatenate([ones, cos]), mx.concatenate([zeros, sin]))

        def run_block(index: int, block: dict, tokens: mx.array) -> mx.array:
            return self.main_block(block, tokens, modulation, tables, starts)

        tokens = self.stages.run("blocks", w["blocks"], tokens, run_block)

        image = tokens[:, longest:]
        final = temb + w["final_table"].astype(temb.dtype)[None]  # (B, 2, hidden)
        scale, shift = final[:, :1], final[:, 1:]
        out = dense(w, "final", (1 + scale) * self.rms_norm(image, w["final_norm"]) + shift)
        return self.unpatchify(out, height, width)
