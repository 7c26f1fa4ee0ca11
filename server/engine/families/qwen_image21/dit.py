"""The Qwen-Image 2.1 diffusion transformer in MLX.

A single-stream DiT (diffusers' `QwenImage21Transformer2DModel`, same weight names): one joint
sequence of text rows, reference-image tokens spliced into the text at their slots, and the target
image's tokens appended. Attention is block-causal (causal over the sequence, bidirectional inside
each image block), so the prefix (text and reference tokens) never sees the target, and under
`causal_condition` the prefix is modulated from t = 0: its keys and values in every block are the
same at every step. The forward is therefore split in two:

- `prefix_state(layout, text, refs)`: runs the prefix alone once, keeping K and V per block;
- `target_forward(x, t, states, h, w)`: runs only the target tokens, attending to [prefix, target].

Both are free of host synchronisation (no `.item()`, no branching on array values): every shape
and mask comes from the host-side `PrefixLayout`, so `mx.compile` can trace them. On the CPU
backend in float32, attention and SiLU use `engine/nn/cpu_ops.py` (MLX's CPU exp is scalar: see there).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import mlx.core as mx
import numpy as np

from ...dit_file import DiTFile, Naming, fused_weights
from ...dit_network import DiTNetwork, DiTPart
from ...lora import LinearSlot, block_slots, project
from ...nn.activations import gelu_tanh, layer_norm, silu
from ...nn.attention import attention
from ...nn.compiled import CompiledPass
from ...nn.rope import apply_rope, rope_tables
from ...shard import ShardPlan, Stages
from ...shard_plan import attention_mlp_plan
from ...weights import block_weights, gguf_file, read_config
from .layout import (
    BLOCK_LINEARS,
    BLOCK_NORMS,
    BLOCK_PREFIX,
    F32_WEIGHTS,
    TEXT_NORM,
    TOP_LINEARS,
    DiTConfig,
    tensor_shapes,
)

TIME_FACTOR = 1000.0  # the time projection embeds 1000 * sigma
TARGET_TABLES_KEPT = 16  # target RoPE tables kept, least recently used dropped first


# ---------------------------------------------------------------------------------------------
# Layout of the prefix: host-side integers only


@dataclass(frozen=True)
class PrefixLayout:
    """Where the reference blocks sit in the text: `slots[i]` is the text row before which
    reference i's tokens go (ascending, within 0..text_len), `ref_shapes[i]` its latent (h, w)."""

    text_len: int
    ref_shapes: tuple[tuple[int, int], ...] = ()
    slots: tuple[int, ...] = ()

    def __post_init__(self):
        if len(self.slots) != len(self.ref_shapes):
            raise ValueError("one slot per reference")
        if list(self.slots) != sorted(self.slots) or any(
            s < 0 or s > self.text_len for s in self.slots
        ):
            raise ValueError("slots must ascend within 0..text_len")

    @cached_property
    def pieces(self) -> tuple[tuple[str, int, int], ...]:
        """The prefix in order as (kind, index, length): ("text", start row, rows) pieces and
        ("ref", reference index, tokens) blocks; empty text pieces are left out."""
        pieces, row = [], 0
        for index, (slot, (h, w)) in enumerate(zip(self.slots, self.ref_shapes, strict=True)):
            if slot > row:
                pieces.append(("text", row, slot - row))
                row = slot
            pieces.append(("ref", index, h * w))
        if row < self.text_len:
            pieces.append(("text", row, self.text_len - row))
        return tuple(pieces)

    @property
    def length(self) -> int:
        return self.text_len + sum(h * w for h, w in self.ref_shapes)

    @cached_property
    def positions(self) -> tuple[np.ndarray, int]:
        """Per prefix token (frame, height, width) RoPE positions, shape (P, 3), and the frame
        position the target block takes, exactly as diffusers' QwenImage21Rope lays them out:
        text advances one position on all axes; an image block freezes the frame axis, centres
        its grid on zero and advances the position by max(h, w)."""
        rows, position = [], 0
        for kind, index, length in self.pieces:
            if kind == "text":
                line = np.arange(position, position + length)
                rows.append(np.stack([line, line, line], axis=1))
                position += length
            else:
                h, w = self.ref_shapes[index]
                rows.append(image_positions(position, h, w))
                position += max(h, w)
        table = np.concatenate(rows) if rows else np.zeros((0, 3), np.int64)
        return table, position


def image_positions(frame: int, h: int, w: int) -> np.ndarray:
    """(h*w, 3) positions of an image block in raster order: frame fixed, grid centred on zero."""
    hh = np.arange(-(h - h // 2), h // 2)
    ww = np.arange(-(w - w // 2), w // 2)
    grid_h = np.repeat(hh, w)
    grid_w = np.tile(ww, h)
    return np.stack([np.full(h * w, frame), grid_h, grid_w], axis=1)


# ---------------------------------------------------------------------------------------------
# Weights: the diffusers names mapped to fused arrays, in one place


def linear_slots(config: DiTConfig) -> dict[str, LinearSlot]:
    """Every linear layer of the DiT by its diffusers name (the manifest's names less `.weight`)."""
    slots = {name: LinearSlot(key) for key, name in TOP_LINEARS.items()}
    for i in range(config.num_layers):
        slots |= block_slots(("blocks", i), BLOCK_PREFIX.format(i), BLOCK_LINEARS)
    return slots


def shard_plan(config: DiTConfig) -> ShardPlan:
    """How the DiT splits over ranks (engine/shard.py): the one stack of blocks is the pipeline;
    q/k/v (three segments, whole heads) and gate/up (two segments) split by output rows, the
    attention output and the MLP's down projection by input columns (the attention output's
    in whole heads, as q/k/v split them)."""
    return attention_mlp_plan({"blocks": BLOCK_PREFIX}, config.head_dim)


def sanitize(files: dict[str, mx.array], config: DiTConfig) -> dict:
    """The file's tensors (diffusers names) as the forward's weight tree: q/k/v and the SwiGLU
    gate/up are concatenated so each runs as one matmul; the zero-centred text norm stores
    scale - 1, so 1 is added. `linear_slots` names the same places for LoRA."""
    blocks = []
    for i in range(config.num_layers):
        blocks.append(block_weights(files, BLOCK_PREFIX.format(i), BLOCK_LINEARS, BLOCK_NORMS))
    weights = {key: files[name + ".weight"] for key, name in TOP_LINEARS.items()}
    weights["text_norm"] = files[TEXT_NORM] + 1.0
    weights["blocks"] = blocks
    return weights


# ComfyUI's naming of the same tensors (a GGUF file may use it): the SwiGLU gate and up
# projections fused into one weight, gate rows first (diffusers' single-file conversion).
COMFY_NAMING = Naming(
    fused=((".img_mlp.gate_up.weight", (".img_mlp.gate_layer.weight", ".img_mlp.proj.weight")),)
)
TITLE = "Qwen-Image 2.1"


def dit_file(transformer_dir: Path, dit: Path | None = None) -> DiTFile | None:
    """The DiT's GGUF file (a model entry's `dit`, else the one in transformer/) as the family
    reads it; None for safetensors."""
    path = gguf_file(transformer_dir, dit)
    if path is None:
        return None
    config = DiTConfig.from_dict(read_config(transformer_dir))
    slots = linear_slots(config)
    return DiTFile(path, COMFY_NAMING, tensor_shapes(config), fused_weights(slots), TITLE)


def quantized(path: str) -> bool:
    """The weights a quantized load quantizes (a model entry's `quantize`), by tree path: the
    blocks' linear layers, which hold nearly all of the DiT. The embedders (time, text, image),
    the modulation every block shares, and the final norm and projection keep the compute
    dtype, as the norm scales do."""
    return path.startswith("blocks.")


@dataclass
class PrefixState:
    """K and V of the prefix in every block, each (1, heads, P, head_dim), and the target's frame
    position. Independent of the timestep, so computed once per conditioning. A rank of a
    pipeline holds those of its own blocks (None elsewhere); of tensor mode, its heads'."""

    keys: list[mx.array | None]
    values: list[mx.array | None]
    length: int
    target_frame: int

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.keys, *self.values) if a is not None)


# The DiT's weights as data (dit_network.DiTPart): what FolderFamily and the load read.
def shard_layout(config: DiTConfig) -> tuple[ShardPlan, dict[str, int]]:
    return shard_plan(config), {"blocks": config.num_layers}


PART = DiTPart(
    dit_file, DiTConfig, linear_slots, quantized, sanitize, F32_WEIGHTS, shard_layout, tensor_shapes
)


class QwenImage21DiT(DiTNetwork):
    PART = PART

    def __init__(
        self, config: DiTConfig, weights: dict, dtype: mx.Dtype, stages: Stages | None = None
    ):
        if config.patch_size != 1:
            raise ValueError("Qwen-Image 2.1 consumes latents unpatched (patch_size 1)")
        if not config.causal_condition:
            raise ValueError("the prefix split needs causal_condition=True")
        super().__init__(config, weights, dtype, stages)
        self._zero_time = mx.zeros((1,), mx.float32)
        # RoPE tables of target blocks by (frame, h, w): the same for every step of a run, and
        # costly to rebuild (MLX's CPU cos/sin are scalar: 6-15 ms at 64x64 latents).
        self._target_tables: OrderedDict[tuple[int, int, int], tuple[mx.array, mx.array]] = (
            OrderedDict()
        )
        # The target pass runs every step: compiled, its elementwise work (RoPE, norms,
        # modulation, gates) fuses (nn/compiled.py says where it compiles). Sharded, it runs
        # eagerly: its collectives stay outside any compiled graph.
        self.target_pass = CompiledPass(self._target_pass, config.inner_dim, enabled=stages is None)

    # -- shared pieces --------------------------------------------------------------------

    def time_embedding(self, w: dict, sigma: mx.array) -> mx.array:
        """(B,) sigma in [0, 1] -> (B, inner): sinusoid of 1000 sigma (cos first), then the MLP."""
        args = (TIME_FACTOR * sigma.astype(mx.float32))[:, None] * self._time_freqs[None, :]
        embedding = mx.concatenate([mx.cos(args), mx.sin(args)], axis=-1).astype(self.dtype)
        return project(w, "time_2", silu(project(w, "time_1", embedding)))

    def modulation(self, w: dict, temb: mx.array) -> list[mx.array]:
        """Shared by every block: [scale1, gate1, scale2, gate2], each (B, 1, inner)."""
        params = project(w, "modulation", silu(temb))[:, None, :]
        return mx.split(params, 4, axis=-1)

    def text_in(self, w: dict, text: mx.array) -> mx.array:
        normed = mx.fast.rms_norm(text.astype(mx.float32), w["text_norm"], self.config.eps)
        hidden = project(w, "text_in", normed.astype(self.dtype))
        return project(w, "text_out", gelu_tanh(hidden))

    def qkv(self, block: dict, x: mx.array, cos: mx.array, sin: mx.array):
        """q, k, v as (B, heads, N, head_dim): fused projection, RMS norm of q and k, RoPE."""
        batch, length, _ = x.shape
        # heads from the weight: all of them, or a rank's share in tensor mode (shard_plan)
        fused = project(block, "qkv", x).reshape(batch, length, 3, -1, self.config.head_dim)
        q, k, v = fused[:, :, 0], fused[:, :, 1], fused[:, :, 2]
        eps = self.config.eps
        q = mx.fast.rms_norm(q.astype(mx.float32), block["norm_q"], eps).astype(self.dtype)
        k = mx.fast.rms_norm(k.astype(mx.float32), block["norm_k"], eps).astype(self.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def attention_out(self, block: dict, attended: mx.array) -> mx.array:
        batch, _, length, _ = attended.shape
        merged = attended.transpose(0, 2, 1, 3).reshape(batch, length, -1)
        return project(block, "out", merged)

    def mlp(self, block: dict, x: mx.array) -> mx.array:
        gate, up = mx.split(project(block, "gate_up", x), 2, axis=-1)
        return project(block, "down", silu(gate) * up)

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.config.head_dim)

    def attention(self, q: mx.array, k: mx.array, v: mx.array) -> mx.array:
        """Unmasked attention (nn.attention: blocked on the CPU backend in float32)."""
        return attention(q, k, v, self.scale, self.cpu_ops)

    # -- the prefix ------------------------------------------------------------------------

    def prefix_state(
        self,
        layout: PrefixLayout,
        text: mx.array,
        refs: list[mx.array],
        weights: dict | None = None,
    ) -> PrefixState:
        """Run the prefix (text (L, D) and reference tokens, each (h*w, C)) at t = 0 through
        every block, keeping each block's K and V. `weights`: a tree carrying a LoRA table's
        pairs (default: the plain weights)."""
        w = self.weights if weights is None else weights
        x = self._prefix_tokens(w, layout, text, refs)
        table, target_frame = layout.positions
        cos, sin = rope_tables(table, self.config.axes_dims_rope)
        zero_time = self.time_embedding(w, self._zero_time)
        scale1, gate1, scale2, gate2 = self.modulation(w, zero_time)
        gate1, gate2 = mx.tanh(gate1), mx.tanh(gate2)
        eps = self.config.eps
        blocks = w["blocks"]
        keys, values = [None] * len(blocks), [None] * len(blocks)

        def run_block(index: int, block: dict, x: mx.array) -> mx.array:
            q, k, v = self.qkv(block, layer_norm(x, eps) * (1 + scale1), cos, sin)
            keys[index], values[index] = k, v
            if index == len(blocks) - 1:
                return x  # the last block's prefix outputs feed nothing
            attended = self._block_causal_attention(layout, q, k, v)
            x = x + gate1 * self.attention_out(block, attended)
            return x + gate2 * self.mlp(block, layer_norm(x, eps) * (1 + scale2))

        self.stages.run("blocks", blocks, x, run_block, keep_output=False)
        return PrefixState(keys, values, layout.length, target_frame)

    def _prefix_tokens(self, w: dict, layout: PrefixLayout, text: mx.array, refs: list[mx.array]):
        text_hidden = self.text_in(w, text.astype(self.dtype)[None])
        parts = []
        for kind, index, length in layout.pieces:
            if kind == "text":
                parts.append(text_hidden[:, index : index + length])
            else:
                parts.append(project(w, "img_in", refs[index].astype(self.dtype)[None]))
        return mx.concatenate(parts, axis=1)

    def _block_causal_attention(self, layout: PrefixLayout, q, k, v) -> mx.array:
        """Each prefix piece attends to every key before it and to its own piece: causally
        inside text pieces, bidirectionally inside a reference block (the reference's
        segmented SDPA path). MLX's causal mask is aligned to the end of the keys, which is
        exactly 'everything before, plus causal inside'."""
        outputs, start = [], 0
        for kind, _, length in layout.pieces:
            end = start + length
            piece_q, piece_k, piece_v = q[:, :, start:end], k[:, :, :end], v[:, :, :end]
            if kind == "text":
                outputs.append(
                    mx.fast.scaled_dot_product_attention(
                        piece_q, piece_k, piece_v, scale=self.scale, mask="causal"
                    )
                )
            else:
                outputs.append(self.attention(piece_q, piece_k, piece_v))
            start = end
        return mx.concatenate(outputs, axis=2)

    # -- the target ------------------------------------------------------------------------

    def target_forward(
        self,
        x: mx.array,
        sigma: mx.array,
        states: list[PrefixState],
        h: int,
        w: int,
        weights: dict | None = None,
    ) -> mx.array:
        """Model output (B, h*w, out_channels) for target tokens x (B, h*w, C) at sigma (B,),
        row b attending to its own prefix state `states[b]` (lengths may differ). `weights`: as
        in `prefix_state`; the states must have been built under the same weights."""
        weights = self.weights if weights is None else weights
        cos, sin = self._target_rope(states, h, w)
        keys = [state.keys for state in states]
        values = [state.values for state in states]
        arguments = (weights, x.astype(self.dtype), sigma, cos, sin, keys, values)
        # what decides the trace: the weight tree, the shapes of x and the RoPE table, each
        # row's prefix length (a pipeline rank without the first block: never compiled)
        prefixes = tuple(None if row[0] is None else row[0].shape for row in keys)
        signature = (id(weights), x.shape, cos.shape, prefixes)
        return self.target_pass(signature, *arguments)

    @property
    def compiled(self) -> bool:
        """Whether the target pass runs compiled (False after a failed compile)."""
        return self.target_pass.enabled

    @compiled.setter
    def compiled(self, enabled: bool) -> None:
        self.target_pass.enabled = enabled

    def _target_pass(self, w: dict, x, sigma, cos, sin, keys, values) -> mx.array:
        """The target pass as a pure function of arrays (weights included), so `mx.compile`
        traces it once per shape and fuses its elementwise work."""
        temb = self.time_embedding(w, sigma)
        scale1, gate1, scale2, gate2 = self.modulation(w, temb)
        gate1, gate2 = mx.tanh(gate1), mx.tanh(gate2)
        eps = self.config.eps

        def run_block(index: int, block: dict, hidden: mx.array) -> mx.array:
            q, k, v = self.qkv(block, layer_norm(hidden, eps) * (1 + scale1), cos, sin)
            prefix = [
                (row_keys[index], row_values[index])
                for row_keys, row_values in zip(keys, values, strict=True)
            ]
            attended = self._target_attention(prefix, q, k, v)
            hidden = hidden + gate1 * self.attention_out(block, attended)
            return hidden + gate2 * self.mlp(block, layer_norm(hidden, eps) * (1 + scale2))

        hidden = self.stages.run("blocks", w["blocks"], project(w, "img_in", x), run_block)
        out_scale = project(w, "norm_out", silu(temb))[:, None, :]
        hidden = layer_norm(hidden, eps) * (1 + out_scale)
        return project(w, "proj_out", hidden)

    def _target_rope(self, states: list[PrefixState], h: int, w: int):
        """(B or 1, N, 1, D/2) tables; rows differ only by their frame position."""
        frames = [state.target_frame for state in states]
        tables = [self._target_table(f, h, w) for f in frames]
        if len(set(frames)) == 1:
            return tables[0][0][None], tables[0][1][None]
        return mx.stack([c for c, _ in tables]), mx.stack([s for _, s in tables])

    def _target_table(self, frame: int, h: int, w: int) -> tuple[mx.array, mx.array]:
        key = (frame, h, w)
        table = self._target_tables.get(key)
        if table is None:
            table = rope_tables(image_positions(frame, h, w), self.config.axes_dims_rope)
            self._target_tables[key] = table
            if len(self._target_tables) > TARGET_TABLES_KEPT:
                self._target_tables.popitem(last=False)
        else:
            self._target_tables.move_to_end(key)
        return table

    def _target_attention(self, prefix: list[tuple[mx.array, mx.array]], q, k, v) -> mx.array:
        """Target queries see the whole prefix and the whole target block: no mask. Each row
        attends over its own [prefix, target] keys, so rows of different prefix lengths batch
        exactly, with no padding."""
        outputs = []
        for row, (prefix_keys, prefix_values) in enumerate(prefix):
            keys = mx.concatenate([prefix_keys, k[row : row + 1]], axis=2)
            values = mx.concatenate([prefix_values, v[row : row + 1]], axis=2)
            outputs.append(self.attention(q[row : row + 1], keys, values))
        return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=0)
