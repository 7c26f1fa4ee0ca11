"""The Z-Image diffusion transformer in MLX (diffusers' `ZImageTransformer2DModel`, its weight
names, its basic text-to-image mode).

A single-stream DiT over 16-channel latents cut into 2x2 patches. Each row's image tokens and
caption tokens are each padded to a multiple of SEQ_MULTIPLE with a learned pad token (those pad
tokens are real tokens: they attend and are attended to). The image tokens run through the
modulated noise refiner, the caption tokens through the unmodulated context refiner, and the
row's [image, caption] sequence through the main blocks; the image tokens' outputs are the answer.

Rows of a batch may carry captions of different lengths: the reference pads the batch and masks
the padded keys. Here the batch is padded too, and each row attends over its own keys only, so
the padded rows never reach a real one (the same answer, no mask).

The DiT's raw output at time `t` is the reference's: the pipeline feeds t = 1 - sigma and negates
the output to get dx/dsigma (see step.py).
"""

from __future__ import annotations

import math
import re

import mlx.core as mx
import numpy as np

from ...dit_file import Naming
from ...dit_network import DiTNetwork, DiTPart
from ...lora import BIAS, LinearSlot, block_slots, dense, project
from ...nn.activations import layer_norm, silu
from ...nn.attention import attention
from ...nn.rope import apply_rope, rope_tables
from ...shard import ShardPlan
from ...shard_plan import attention_mlp_plan
from ...weights import block_weights, single_dit_file
from .layout import (
    BLOCK_LINEARS,
    BLOCK_NORMS,
    CAP_NORM,
    COMFY_BLOCK,
    COMFY_TOP,
    COMFY_UNREAD,
    F32_WEIGHTS,
    MODULATION,
    PAD_TOKENS,
    STACKS,
    TOP_LINEARS,
    DiTConfig,
    block_parts,
    stack_depth,
    tensor_shapes,
    top_name,
)

SEQ_MULTIPLE = 32  # image and caption tokens are each padded to a multiple of this
QK_NORM_EPS = 1e-5
FINAL_NORM_EPS = 1e-6


def padded(length: int) -> int:
    """`length` rounded up to a multiple of SEQ_MULTIPLE."""
    return length + (-length) % SEQ_MULTIPLE


# ---------------------------------------------------------------------------------------------
# Weights: the diffusers names mapped to the forward's tree, in one place


def linear_slots(config: DiTConfig) -> dict[str, LinearSlot]:
    """Every linear layer of the DiT by its diffusers name (the manifest's names less `.weight`)."""
    slots = {top_name(name, config): LinearSlot(key) for key, name in TOP_LINEARS.items()}
    for stack, (prefix, modulated) in STACKS.items():
        for i in range(stack_depth(stack, config)):
            p = prefix.format(i)
            slots |= block_slots((stack, i), p, BLOCK_LINEARS)
            if modulated:
                slots[p + MODULATION] = LinearSlot("modulation", (stack, i))
    return slots


def shard_plan(config: DiTConfig) -> ShardPlan:
    """How the DiT splits over ranks (engine/shard.py): the three stacks, in order, are the
    pipeline; in every block q/k/v (three segments, whole heads) and w1/w3 (two segments) split
    by output rows, the attention output (whole heads) and w2 by input columns."""
    prefixes = {stack: prefix for stack, (prefix, _) in STACKS.items()}
    return attention_mlp_plan(prefixes, config.head_dim)


def sanitize(files: dict[str, mx.array], config: DiTConfig) -> dict:
    """The file's tensors (diffusers names) as the forward's weight tree: q/k/v and the SwiGLU
    w1/w3 are concatenated so each runs as one matmul; biases sit beside their linear under
    key + BIAS. `linear_slots` names the same places for LoRA."""
    weights = {}
    for key, name in TOP_LINEARS.items():
        name = top_name(name, config)
        weights[key] = files[name + ".weight"]
        weights[key + BIAS] = files[name + ".bias"]
    weights["cap_norm"] = files[CAP_NORM]
    for key, name in PAD_TOKENS.items():
        weights[key] = files[name].reshape(-1)
    for stack, (prefix, modulated) in STACKS.items():
        weights[stack] = [
            _block(files, prefix.format(i), modulated) for i in range(stack_depth(stack, config))
        ]
    return weights


def _block(files: dict[str, mx.array], prefix: str, modulated: bool) -> dict:
    block = block_weights(files, prefix, BLOCK_LINEARS, BLOCK_NORMS)
    if modulated:
        block["modulation"] = files[prefix + MODULATION + ".weight"]
        block["modulation" + BIAS] = files[prefix + MODULATION + ".bias"]
    return block


def quantized(path: str) -> bool:
    """The weights a quantized load quantizes (a model entry's `quantize`), by tree path: the
    attention and feed-forward linears of every block of the three stacks, which hold nearly
    all of the DiT. The embedders, each block's modulation, the final layer, the norm scales
    and the pad tokens keep the compute dtype."""
    stack, _, rest = path.partition(".")
    return stack in STACKS and rest.rpartition(".")[2] in BLOCK_LINEARS


TITLE = "Z-Image"


def comfy_naming(config: DiTConfig) -> Naming:
    """ComfyUI's naming of the same tensors (layout.py's COMFY_ tables): its names of the layers
    outside the blocks renamed from the start of a name, a block's within it, and its fused
    `qkv` split into diffusers' q, k and v; its unread `norm_final` (COMFY_UNREAD) ignored."""
    renames = [
        (rf"^{re.escape(comfy)}\.", top_name(TOP_LINEARS[key], config) + ".")
        for key, comfy in COMFY_TOP.items()
    ]
    fused = []
    for key, comfy in COMFY_BLOCK.items():
        parts = block_parts(key)
        if len(parts) > 1:
            fused.append((f".{comfy}.weight", tuple(f".{part}.weight" for part in parts)))
        else:
            renames.append((rf"\.{re.escape(comfy)}\.", f".{parts[0]}."))
    return Naming(renames=tuple(renames), fused=tuple(fused), ignored=COMFY_UNREAD)


# The DiT's single file (GGUF or safetensors) in diffusers' or ComfyUI's naming as the family
# reads it (weights.single_dit_file).
dit_file = single_dit_file(DiTConfig, linear_slots, tensor_shapes, comfy_naming, TITLE)


# ---------------------------------------------------------------------------------------------
# Positions: host-side integers only


def caption_positions(length: int) -> np.ndarray:
    """(padded(length), 3): caption token j (pad tokens included) sits at (1 + j, 0, 0)."""
    rows = np.arange(1, padded(length) + 1)
    return np.stack([rows, np.zeros_like(rows), np.zeros_like(rows)], axis=1)


def image_positions(frame: int, h: int, w: int) -> np.ndarray:
    """(padded(h*w), 3): patch (i, j) at (frame, i, j) in raster order, pad tokens at (0, 0, 0)."""
    grid = np.stack(
        [np.full(h * w, frame), np.repeat(np.arange(h), w), np.tile(np.arange(w), h)], axis=1
    )
    return np.concatenate([grid, np.zeros((padded(h * w) - h * w, 3), grid.dtype)])


# The DiT's weights as data (dit_network.DiTPart): what FolderFamily and the load read.
def shard_layout(config: DiTConfig) -> tuple[ShardPlan, dict[str, int]]:
    return shard_plan(config), {stack: stack_depth(stack, config) for stack in STACKS}


PART = DiTPart(
    dit_file, DiTConfig, linear_slots, quantized, sanitize, F32_WEIGHTS, shard_layout, tensor_shapes
)


class ZImageDiT(DiTNetwork):
    PART = PART

    # -- pieces ------------------------------------------------------------------------------

    def time_embedding(self, w: dict, t: mx.array) -> mx.array:
        """(B,) t in [0, 1] -> (B, adaln_dim): sinusoid of t_scale * t (cos first), then the MLP."""
        args = (self.config.t_scale * t.astype(mx.float32))[:, None] * self._time_freqs[None, :]
        embedding = mx.concatenate([mx.cos(args), mx.sin(args)], axis=-1).astype(self.dtype)
        return dense(w, "time_2", silu(dense(w, "time_1", embedding)))

    def rms_norm(self, x: mx.array, scale: mx.array, eps: float) -> mx.array:
        return mx.fast.rms_norm(x.astype(mx.float32), scale, eps).astype(self.dtype)

    def rope(self, positions: list[np.ndarray]) -> tuple[mx.array, mx.array]:
        """(B, N, 1, head_dim/2) tables for rows of positions, each padded to the longest with
        angle 0 (those rows are never read)."""
        longest = max(len(p) for p in positions)
        rows = [np.concatenate([p, np.zeros((longest - len(p), 3), p.dtype)]) for p in positions]
        cos, sin = rope_tables(
            np.concatenate(rows), self.config.axes_dims, self.config.rope_theta, float64=True
        )
        shape = (len(rows), longest, 1, cos.shape[-1])
        return cos.reshape(shape), sin.reshape(shape)

    def attention(self, block: dict, x: mx.array, cos, sin, lengths: list[int]) -> mx.array:
        """Self-attention of x (B, N, dim), row b over its first lengths[b] tokens."""
        batch, length, _ = x.shape
        # heads from the weight: all of them, or a rank's share in tensor mode (shard_plan)
        fused = project(block, "qkv", x).reshape(batch, length, 3, -1, self.config.head_dim)
        q = self.rms_norm(fused[:, :, 0], block["norm_q"], QK_NORM_EPS)
        k = self.rms_norm(fused[:, :, 1], block["norm_k"], QK_NORM_EPS)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        v = fused[:, :, 2].transpose(0, 2, 1, 3)
        attended = self._rows_attention(q, k, v, lengths)
        merged = attended.transpose(0, 2, 1, 3).reshape(batch, length, -1)
        return project(block, "out", merged)

    def _rows_attention(self, q, k, v, lengths: list[int]) -> mx.array:
        """Each row's queries over its own keys; rows of one length run together."""
        scale = 1.0 / math.sqrt(self.config.head_dim)
        full = q.shape[2]
        if all(n == full for n in lengths):
            return attention(q, k, v, scale, self.cpu_ops)
        outputs = []
        for row, n in enumerate(lengths):
            keys, values = k[row : row + 1, :, :n], v[row : row + 1, :, :n]
            outputs.append(attention(q[row : row + 1], keys, values, scale, self.cpu_ops))
        return mx.concatenate(outputs, axis=0)

    def feed_forward(self, block: dict, x: mx.array) -> mx.array:
        gate, up = mx.split(project(block, "gate_up", x), 2, axis=-1)
        return project(block, "down", silu(gate) * up)

    def block(self, block: dict, x, cos, sin, lengths, adaln: mx.array | None) -> mx.array:
        eps = self.config.norm_eps
        if adaln is None:
            scale_msa = scale_mlp = gate_msa = gate_mlp = None
        else:
            params = dense(block, "modulation", adaln)[:, None, :]
            scale_msa, gate_msa, scale_mlp, gate_mlp = mx.split(params, 4, axis=-1)
            gate_msa, gate_mlp = mx.tanh(gate_msa), mx.tanh(gate_mlp)
        normed = self.rms_norm(x, block["attention_norm1"], eps)
        if scale_msa is not None:
            normed = normed * (1 + scale_msa)
        attended = self.attention(block, normed, cos, sin, lengths)
        attended = self.rms_norm(attended, block["attention_norm2"], eps)
        x = x + (attended if gate_msa is None else gate_msa * attended)
        normed = self.rms_norm(x, block["ffn_norm1"], eps)
        if scale_mlp is not None:
            normed = normed * (1 + scale_mlp)
        fed = self.rms_norm(self.feed_forward(block, normed), block["ffn_norm2"], eps)
        return x + (fed if gate_mlp is None else gate_mlp * fed)

    # -- the forward -------------------------------------------------------------------------

    def patchify(self, x: mx.array) -> mx.array:
        """(B, C, H, W) -> (B, (H/p)(W/p), p*p*C): patches in raster order, (ph, pw, C) inside."""
        batch, channels, height, width = x.shape
        p = self.config.patch_size
        x = x.reshape(batch, channels, height // p, p, width // p, p)
        x = x.transpose(0, 2, 4, 3, 5, 1)
        return x.reshape(batch, (height // p) * (width // p), p * p * channels)

    def unpatchify(self, tokens: mx.array, height: int, width: int) -> mx.array:
        batch, p, channels = tokens.shape[0], self.config.patch_size, self.config.in_channels
        x = tokens.reshape(batch, height // p, width // p, p, p, channels)
        return x.transpose(0, 5, 1, 3, 2, 4).reshape(batch, channels, height, width)

    def forward(
        self, x: mx.array, t: mx.array, caps: list[mx.array], weights: dict | None = None
    ) -> mx.array:
        """The raw output (B, C, H, W) for latents x (B, C, H, W) at t (B,) (the reference's
        time: 1 - sigma), row b conditioned on caption features caps[b] (L_b, cap_feat_dim).
        `weights`: a tree carrying a LoRA table's pairs (default: the plain weights). The pass
        runs compiled (nn/compiled.py), once traced per weight tree, size and caption lengths."""
        w = self.weights if weights is None else weights
        _, _, height, width = x.shape
        p = self.config.patch_size
        if height % p or width % p:
            raise ValueError(f"latents {height}x{width} must be multiples of the patch {p}")
        cap_lens = [int(cap.shape[0]) for cap in caps]
        tables = self._rope_tables(height // p, width // p, cap_lens)
        signature = (id(w), x.shape, tuple(cap_lens))
        return self.compiled_pass(signature, w, x.astype(self.dtype), t, caps, tables)

    def _rope_tables(self, h: int, w: int, cap_lens: list[int]) -> tuple:
        """Host side: the RoPE tables of the image tokens, the caption tokens and each row's
        [image, caption], for an h x w patch grid and rows of these caption lengths."""
        image_pos = [image_positions(padded(n) + 1, h, w) for n in cap_lens]
        cap_pos = [caption_positions(n) for n in cap_lens]
        unified_pos = [np.concatenate(pair) for pair in zip(image_pos, cap_pos, strict=True)]
        return self.rope(image_pos), self.rope(cap_pos), self.rope(unified_pos)

    def _pass(self, w: dict, x: mx.array, t: mx.array, caps: list[mx.array], tables) -> mx.array:
        """The forward as a pure function of arrays (weights included), so `mx.compile` traces
        it once per shape and fuses its elementwise work. Every length comes from a shape."""
        config = self.config
        batch, _, height, width = x.shape
        p = config.patch_size
        h, w_tokens = height // p, width // p
        image_len, image_padded = h * w_tokens, padded(h * w_tokens)
        cap_padded = [padded(int(cap.shape[0])) for cap in caps]
        (image_cos, image_sin), (cap_cos, cap_sin), (cos, sin) = tables
        adaln = self.time_embedding(w, t).astype(self.dtype)

        # Image tokens, padded with the pad token, through the noise refiner.
        image = dense(w, "x_in", self.patchify(x))
        pad = mx.broadcast_to(w["x_pad"], (batch, image_padded - image_len, config.dim))
        image = mx.concatenate([image, pad.astype(self.dtype)], axis=1)
        image = self._stack(
            w, "noise_refiner", image, image_cos, image_sin, [image_padded] * batch, adaln
        )

        # Caption tokens, each row padded to its multiple with the pad token, then the batch to
        # the longest, through the context refiner.
        caption = self._caption_tokens(w, caps, cap_padded)
        caption = self._stack(w, "context_refiner", caption, cap_cos, cap_sin, cap_padded, None)

        # Each row's [image, caption], through the main blocks.
        unified = mx.concatenate([image, caption], axis=1)
        lengths = [image_padded + n for n in cap_padded]
        unified = self._stack(w, "layers", unified, cos, sin, lengths, adaln)

        scale = 1 + dense(w, "final_modulation", silu(adaln))[:, None, :]
        out = dense(w, "final", layer_norm(unified[:, :image_len], FINAL_NORM_EPS) * scale)
        return self.unpatchify(out, height, width)

    def _stack(self, w: dict, stack: str, x, cos, sin, lengths, adaln) -> mx.array:
        """x through one of the block stacks (this process's part of it: `stages`)."""

        def run_block(index: int, block: dict, x: mx.array) -> mx.array:
            return self.block(block, x, cos, sin, lengths, adaln)

        return self.stages.run(stack, w[stack], x, run_block)

    def _caption_tokens(self, w: dict, caps: list[mx.array], cap_padded: list[int]) -> mx.array:
        longest, dim = max(cap_padded), self.config.dim
        rows = []
        for cap, row_padded in zip(caps, cap_padded, strict=True):
            normed = self.rms_norm(cap, w["cap_norm"], self.config.norm_eps)
            tokens = dense(w, "cap_in", normed)
            pad = mx.broadcast_to(w["cap_pad"], (row_padded - cap.shape[0], dim))
            zeros = mx.zeros((longest - row_padded, dim), self.dtype)
            rows.append(mx.concatenate([tokens, pad.astype(self.dtype), zeros], axis=0))
        return mx.stack(rows)
