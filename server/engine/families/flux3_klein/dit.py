"""The FLUX.3 klein diffusion transformer in MLX (diffusers' `Flux3Transformer2DModel`, its
weight names).

Three token modes share one joint sequence: the noisy image tokens, the reference tokens
(`image_cond`, VAE latents in model space) and the text (stacked Qwen3-VL layers). Each mode runs
through its own per-mode blocks first, attending within itself only; then [text, image,
references] run through the joint single blocks; only the image tokens reach the output. Every
block is alike: a LayerNorm modulated per mode (shift, scale, gate), attention and a SwiGLU MLP in
parallel from the same normed input, one gated residual. The image tokens are modulated from the
step's time, the references and the text from time 0. A flow-map checkpoint (the step-distilled
one) also embeds the time each step jumps to and adds it to every mode's time embedding, the
output layer's included: `forward` takes that target per row.

Positions are 4-D (t, h, w, l): text token j at (0, 0, 0, j), image token (i, j) at
(0, i/2, j/2, 0), reference k's tokens at (0, i/2, j/2, -1 - k); interleaved RoPE, the angles in
float64 rounded once, as the reference's tables are.

Rows of a batch may differ (text lengths, references): rows of one layout run together, each
layout on its own, so nothing is padded and no mask is needed. The DiT's raw output at t = sigma
is the velocity dx/dsigma (for a flow map, the mean velocity of the jump to the target).
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import replace

import mlx.core as mx
import numpy as np
from gmlx_contract.lora_keys import layer_rows

from ...base import Capabilities
from ...dit_file import Naming
from ...dit_network import DiTNetwork, DiTPart, by_layout, rows_of, stacked_references
from ...lora import LinearSlot, block_slots, project
from ...nn.activations import layer_norm, silu
from ...nn.attention import attention
from ...nn.rope import apply_rope, rope_tables
from ...shard import ShardPlan
from ...shard_plan import attention_mlp_plan
from ...weights import block_weights, single_dit_file
from .layout import (
    BFL_BLOCK,
    BFL_MODULATION,
    BFL_PREFIXES,
    BFL_SWAPPED_HALVES,
    BFL_TOP,
    BLOCK_LINEARS,
    BLOCK_NORMS,
    F32_WEIGHTS,
    IMAGE_ROPE_SCALE,
    STACKS,
    TIME_FACTOR,
    TOP_NAMES,
    DiTConfig,
    bfl_name,
    stack_depth,
    tensor_shapes,
    top_linears,
)

TITLE = "FLUX.3 klein"

# ---------------------------------------------------------------------------------------------
# Weights: the diffusers names mapped to the forward's tree, in one place


def linear_slots(config: DiTConfig) -> dict[str, LinearSlot]:
    """Every linear layer of the DiT by its diffusers name (the manifest's names less `.weight`)."""
    slots = {name: LinearSlot(key) for key, name in top_linears(config).items()}
    for stack, prefix in STACKS.items():
        for i in range(stack_depth(stack, config)):
            slots |= block_slots((stack, i), prefix.format(i), BLOCK_LINEARS)
    return slots


def sanitize(files: dict[str, mx.array], config: DiTConfig) -> dict:
    """The file's tensors (diffusers names) as the forward's weight tree: each block's q, k and v
    concatenated along the rows so they run as one matmul. `linear_slots` names the same places."""
    weights = {key: files[name + ".weight"] for key, name in top_linears(config).items()}
    for stack, prefix in STACKS.items():
        weights[stack] = [
            block_weights(files, prefix.format(i), BLOCK_LINEARS, BLOCK_NORMS)
            for i in range(stack_depth(stack, config))
        ]
    return weights


def quantized(path: str) -> bool:
    """The weights a quantized load quantizes, by tree path: the blocks' linear layers, nearly
    all of the DiT. The embedders, the modulations and the final layer keep the compute dtype,
    as the norm scales do."""
    stack, _, rest = path.partition(".")
    return stack in STACKS and rest.rpartition(".")[2] in BLOCK_LINEARS


def shard_plan(config: DiTConfig) -> ShardPlan:
    """How the DiT splits over ranks (engine/shard.py): the joint single blocks are the pipeline
    (the per-mode blocks, a sixth of the depth, are whole on every rank); in every block q/k/v
    (three segments, whole heads) and the SwiGLU's input split by output rows, the attention
    output (whole heads) and the MLP's output by input columns."""
    return attention_mlp_plan({"single": STACKS["single"]}, config.head_dim, ("ff_in", "ff_out"))


def shard_layout(config: DiTConfig) -> tuple[ShardPlan, dict[str, int]]:
    return shard_plan(config), {"single": config.num_single_layers}


def bfl_naming() -> Naming:
    """BFL's naming onto the diffusers names (which it leaves as they are): the tables above,
    the norm scales' `.scale` as `.weight`, the final modulation's halves swapped."""
    top = {**BFL_TOP, **BFL_SWAPPED_HALVES}
    renames = [(rf"^{re.escape(bfl)}\.", TOP_NAMES[key] + ".") for key, bfl in top.items()]
    renames += [(rf"^{re.escape(bfl)}", name) for bfl, name in BFL_PREFIXES.items()]
    renames.append((rf"{re.escape(BFL_MODULATION[0])}weight$", BFL_MODULATION[1] + "weight"))
    for bfl, name in BFL_BLOCK.items():
        renames.append((rf"(\.\d+\.){re.escape(bfl)}\.(weight|scale)$", rf"\g<1>{name}.weight"))
    swapped = tuple(bfl + ".weight" for bfl in BFL_SWAPPED_HALVES.values())
    return Naming(renames=tuple(renames), swapped=swapped)


def manifest_extras(manifest: dict) -> dict:
    """BFL's names of its linear layers (`lora_aliases`), for LoRA files in them: each the
    whole diffusers layer, the final modulation's halves swapped."""
    rows = layer_rows(manifest)
    aliases = {}
    for layer, count in rows.items():
        if layer == TOP_NAMES["final_mod"]:
            half = count // 2
            aliases[BFL_SWAPPED_HALVES["final_mod"]] = [[layer, half, half], [layer, 0, half]]
        elif bfl_name(layer) != layer:
            aliases[bfl_name(layer)] = [[layer, 0, count]]
    return {"lora_aliases": aliases}


BFL_NAMING = bfl_naming()


# The DiT's single file (GGUF or safetensors) in BFL's naming or diffusers' as the family reads
# it (weights.single_dit_file).
dit_file = single_dit_file(DiTConfig, linear_slots, tensor_shapes, BFL_NAMING, TITLE)


PART = DiTPart(
    dit_file,
    DiTConfig,
    linear_slots,
    quantized,
    sanitize,
    F32_WEIGHTS,
    shard_layout,
    tensor_shapes=tensor_shapes,
    manifest_extras=manifest_extras,
)


# ---------------------------------------------------------------------------------------------
# Positions: host-side numbers only


def text_positions(length: int) -> np.ndarray:
    rows = np.arange(length, dtype=np.float64)
    zeros = np.zeros_like(rows)
    return np.stack([zeros, zeros, zeros, rows], axis=1)


def image_positions(h: int, w: int, layer: int = 0) -> np.ndarray:
    """(h*w, 4): token (i, j) at (0, i/2, j/2, layer) in raster order."""
    rows = np.repeat(np.arange(h, dtype=np.float64), w) * IMAGE_ROPE_SCALE
    columns = np.tile(np.arange(w, dtype=np.float64), h) * IMAGE_ROPE_SCALE
    return np.stack([np.zeros(h * w), rows, columns, np.full(h * w, float(layer))], axis=1)


def reference_positions(shapes: tuple[tuple[int, int], ...]) -> np.ndarray:
    """(sum h*w, 4): reference k's tokens on layer -1 - k."""
    return np.concatenate([image_positions(h, w, -1 - k) for k, (h, w) in enumerate(shapes)])


@functools.lru_cache(maxsize=32)
def rope_of(kind: str, shape: tuple, axes_dims: tuple[int, ...], theta: float) -> tuple:
    """The RoPE tables of a mode's tokens (`kind` "text": shape (length,); "image": (h, w);
    "refs": the references' (h, w) each): made once per shape, not per step."""
    if kind == "refs":
        table = reference_positions(shape)
    else:
        table = image_positions(*shape) if kind == "image" else text_positions(*shape)
    return rope_tables(table, axes_dims, theta, float64=True)


class Flux3DiT(DiTNetwork):
    PART = PART

    def capabilities(self, declared: Capabilities) -> Capabilities:
        """A flow map where the checkpoint carries the target time's embedder."""
        return replace(declared, flow_map=self.config.flow_map)

    # -- pieces ------------------------------------------------------------------------------

    def time_embedding(self, w: dict, embedder: str, t: mx.array) -> mx.array:
        """(B,) t in [0, 1] -> (B, 1, dim): sinusoid of 1000 t as the compute dtype holds it
        (cos first), then the embedder's two-layer MLP (`embedder`: "time" or "target")."""
        scaled = (t.astype(mx.float32).astype(self.dtype) * TIME_FACTOR).astype(mx.float32)
        args = scaled[:, None] * self._time_freqs[None, :]
        embedding = mx.concatenate([mx.cos(args), mx.sin(args)], axis=-1).astype(self.dtype)
        hidden = silu(project(w, embedder + "_1", embedding))
        return project(w, embedder + "_2", hidden)[:, None, :]

    def modulation(self, w: dict, key: str, active: mx.array) -> tuple[mx.array, ...]:
        """(shift, scale, gate), each (B, 1, dim), of a mode's modulation `key` from its
        activated time embedding."""
        return tuple(mx.split(project(w, key, active), 3, axis=-1))

    def rms_norm(self, x: mx.array, scale: mx.array) -> mx.array:
        return mx.fast.rms_norm(x.astype(mx.float32), scale, self.config.eps).astype(self.dtype)

    def block(self, block: dict, x: mx.array, segments: list, rope) -> mx.array:
        """One block (per-mode or joint) over x (B, N, dim): `segments` are the runs of x's
        tokens by mode, each (length, (shift, scale, gate)); attention and the MLP in parallel
        from the modulated LayerNorm, one gated residual."""
        normed = layer_norm(x, self.config.eps)
        parts, start = [], 0
        for length, (shift, scale, _) in segments:
            parts.append((1 + scale) * normed[:, start : start + length] + shift)
            start += length
        modulated = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)
        out = self.attention(block, modulated, rope) + self.feed_forward(block, modulated)
        gated, start = [], 0
        for length, (_, _, gate) in segments:
            gated.append(gate * out[:, start : start + length])
            start += length
        return x + (gated[0] if len(gated) == 1 else mx.concatenate(gated, axis=1))

    def attention(self, block: dict, x: mx.array, rope) -> mx.array:
        batch, length, _ = x.shape
        head_dim = self.config.head_dim
        # heads from the weights: all of them, or a rank's share in tensor mode (shard_plan)
        fused = project(block, "qkv", x).reshape(batch, length, 3, -1, head_dim)
        cos, sin = rope
        q = apply_rope(self.rms_norm(fused[:, :, 0], block["norm_q"]), cos, sin)
        k = apply_rope(self.rms_norm(fused[:, :, 1], block["norm_k"]), cos, sin)
        q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, fused[:, :, 2]))
        out = attention(q, k, v, 1.0 / math.sqrt(head_dim), self.cpu_ops)
        return project(block, "out", out.transpose(0, 2, 1, 3).reshape(batch, length, -1))

    def feed_forward(self, block: dict, x: mx.array) -> mx.array:
        gate, up = mx.split(project(block, "ff_in", x), 2, axis=-1)
        return project(block, "ff_out", silu(gate) * up)

    def rope(self, kind: str, shape: tuple) -> tuple[mx.array, mx.array]:
        return rope_of(kind, shape, self.config.axes_dims, self.config.rope_theta)

    # -- the forward -------------------------------------------------------------------------

    def forward(
        self,
        x: mx.array,
        t: mx.array,
        texts: list[mx.array],
        refs: list[list[mx.array]] | None = None,
        targets: mx.array | None = None,
        weights: dict | None = None,
    ) -> mx.array:
        """The DiT's raw output (B, C, h, w) for latents x (B, C, h, w) at times t (B,), row b
        under its text texts[b] (L_b, joint_attention_dim) and reference latents refs[b] (each
        (C, h_k, w_k), model space); a flow map's `targets` (B,) are the times the rows jump
        to. `weights`: a tree carrying a LoRA table's pairs (default: the plain weights)."""
        if (targets is not None) != self.config.flow_map:
            raise ValueError("target times are for, and only for, a flow-map DiT")
        w = self.weights if weights is None else weights
        refs = refs or [[] for _ in range(x.shape[0])]
        layouts = [
            (text.shape[0], tuple(tuple(r.shape) for r in row))
            for text, row in zip(texts, refs, strict=True)
        ]

        def run(rows: list[int]) -> mx.array:
            return self._forward_group(
                rows_of(x, rows),
                rows_of(t, rows),
                None if targets is None else rows_of(targets, rows),
                mx.stack([texts[b] for b in rows]),
                stacked_references([refs[b] for b in rows]),
                w,
            )

        return by_layout(layouts, run)

    def _forward_group(self, x, t, targets, text, refs, w) -> mx.array:
        """Rows of one layout: x (B, C, h, w), text (B, L, D), refs a list of (B, C, h_k, w_k)."""
        batch, _, height, width = x.shape
        image_temb = self.time_embedding(w, "time", t)
        zero_temb = self.time_embedding(w, "time", mx.zeros((batch,), mx.float32))
        if targets is not None:
            target_temb = self.time_embedding(w, "target", targets)
            image_temb, zero_temb = image_temb + target_temb, zero_temb + target_temb
        image_act, zero_act = silu(image_temb), silu(zero_temb)
        early = {
            "image": self.modulation(w, "early_image", image_act),
            "txt": self.modulation(w, "early_txt", zero_act),
            "cond": self.modulation(w, "early_cond", zero_act),
        }
        n_txt, n_img = text.shape[1], height * width
        txt = project(w, "ctx_in", text.astype(self.dtype))
        img = project(w, "x_in", self.tokens(x.astype(self.dtype)))
        text_rope, image_rope = self.rope("text", (n_txt,)), self.rope("image", (height, width))
        for block in w["txt_blocks"]:
            txt = self.block(block, txt, [(n_txt, early["txt"])], text_rope)
        for block in w["image_blocks"]:
            img = self.block(block, img, [(n_img, early["image"])], image_rope)
        hidden = [txt, img]
        single = [
            (n_txt, self.modulation(w, "single_txt", zero_act)),
            (n_img, self.modulation(w, "single_image", image_act)),
        ]
        ropes = [text_rope, image_rope]
        if refs:
            shapes = tuple((int(r.shape[2]), int(r.shape[3])) for r in refs)
            cond = mx.concatenate([self.tokens(r.astype(self.dtype)) for r in refs], axis=1)
            cond = project(w, "cond_in", cond)
            cond_rope = self.rope("refs", shapes)
            for block in w["cond_blocks"]:
                cond = self.block(block, cond, [(cond.shape[1], early["cond"])], cond_rope)
            hidden.append(cond)
            single.append((cond.shape[1], self.modulation(w, "single_cond", zero_act)))
            ropes.append(cond_rope)
        joint_rope = tuple(mx.concatenate([r[i] for r in ropes]) for i in range(2))

        def run_block(index: int, block: dict, tokens: mx.array) -> mx.array:
            return self.block(block, tokens, single, joint_rope)

        tokens = self.stages.run("single", w["single"], mx.concatenate(hidden, axis=1), run_block)
        image = tokens[:, n_txt : n_txt + n_img]
        scale, shift = mx.split(project(w, "final_mod", image_act), 2, axis=-1)
        out = project(w, "final", layer_norm(image, self.config.eps) * (1 + scale) + shift)
        return self.grid(out, height, width)
