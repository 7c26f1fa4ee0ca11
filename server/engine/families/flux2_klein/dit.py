"""The FLUX.2 klein diffusion transformer in MLX (diffusers' `Flux2Transformer2DModel`, its
weight names; BFL's single files map onto them, `BFL_NAMING`).

An MMDiT over 128-channel latent tokens (the VAE's 32 channels patchified 2x2, patch 1 here):
double-stream blocks (image and text tokens with their own weights, one joint attention), then
single-stream blocks over [text, image] (attention and MLP in parallel from one fused
projection). Every block is modulated from the time embedding alone, through three shared
modulations (image and text of the double blocks, the single blocks).

Reference latents are extra image tokens, in one of two ways:
- `joint` (diffusers' plain forward, `Flux2KleinPipeline`): the references follow the image
  tokens in the image stream, at the step's time, everything attending to everything.
- `kv` (`Flux2KleinKVPipeline`'s extract and cached modes): the references run at time 0 and
  attend to themselves only, so their K and V in every block depend on the references alone.
  `reference_states` runs them once (a `RefState`); `forward` then adds those K/V to the keys
  of every block, which is the extract step's answer and the cached steps' alike.

Rows of a batch may differ (caption lengths, references): rows of one layout run together, each
layout on its own, so nothing is padded and no mask is needed.

Positions are 4-D (t, h, w, l): caption token j at (0, 0, 0, j), image token (i, j) at
(0, i, j, 0), reference k's tokens at (10 + 10k, i, j, 0); interleaved RoPE, the angles in
float64 rounded once, as the reference's tables are.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from gmlx_contract.lora_keys import layer_rows

from ...dit_file import Naming
from ...dit_network import DiTNetwork, DiTPart, by_layout, rows_of, stacked_references
from ...lora import LinearSlot, block_slots, project
from ...nn.activations import layer_norm, silu
from ...nn.attention import attention
from ...nn.rope import apply_rope, rope_tables
from ...weights import block_weights, single_dit_file
from .layout import (
    BFL_SWAPPED_HALVES,
    BFL_TOP,
    F32_WEIGHTS,
    STACKS,
    TOP_LINEARS,
    DiTConfig,
    tensor_shapes,
)

TIME_FACTOR = 1000.0  # the DiT embeds 1000 t
REF_TIME_SCALE = 10  # reference k sits at time coordinate 10 + 10 k
REF_MODES = ("joint", "kv")


# ---------------------------------------------------------------------------------------------
# Weights: the diffusers names mapped to the forward's tree, in one place


def linear_slots(config: DiTConfig) -> dict[str, LinearSlot]:
    """Every linear layer of the DiT by its diffusers name (the manifest's names less `.weight`)."""
    slots = {name: LinearSlot(key) for key, name in TOP_LINEARS.items()}
    for stack in STACKS:
        for i in range(stack.depth(config)):
            slots |= block_slots((stack.key, i), stack.prefix.format(i), stack.diffusers_linears)
    return slots


def bfl_slots(config: DiTConfig) -> dict[str, LinearSlot]:
    """The linear layers by BFL's names (a fused q/k/v is one whole layer here)."""
    slots = {name: LinearSlot(key) for key, name in BFL_TOP.items()}
    for stack in STACKS:
        for i in range(stack.depth(config)):
            for key, (_, bfl) in stack.linears.items():
                slots[stack.bfl_prefix.format(i) + bfl] = LinearSlot(key, (stack.key, i))
    return slots


def bfl_naming() -> Naming:
    """BFL's naming of the DiT's tensors (its own checkpoints, ComfyUI's `Flux2`, the GGUF files
    converted from them) onto the diffusers names, as diffusers' single-file conversion
    (`convert_flux2_transformer_checkpoint_to_diffusers`) maps them: layout.py's tables' BFL
    names beside their diffusers names, each stream's fused `qkv` split into q, k and v, the
    norm scales' `.scale` as `.weight`, and the final modulation's halves swapped."""
    renames = [(_top(bfl), TOP_LINEARS[key] + ".") for key, bfl in BFL_TOP.items()]
    renames += [(_top(bfl), TOP_LINEARS[key] + ".") for key, bfl in BFL_SWAPPED_HALVES.items()]
    fused = []
    for stack in STACKS:
        for parts, bfl in stack.linears.values():
            target = parts[0] if len(parts) == 1 else bfl
            renames.append(_in_block(stack.bfl_prefix, stack.prefix, bfl, target))
            if len(parts) > 1:
                fused.append((f".{bfl}.weight", tuple(f".{part}.weight" for part in parts)))
    for stack in STACKS:
        for name, bfl in stack.norms.values():
            renames.append(_norm_in_block(stack.bfl_prefix, stack.prefix, bfl, name))
    swapped = tuple(bfl + ".weight" for bfl in BFL_SWAPPED_HALVES.values())
    return Naming(renames=tuple(renames), fused=tuple(fused), swapped=swapped)


def _top(bfl: str) -> str:
    return rf"^{re.escape(bfl)}\."


def _in_block(bfl_prefix: str, prefix: str, bfl: str, target: str) -> tuple[str, str]:
    """A rename of a block's tensor `bfl` (under BFL's `bfl_prefix`, `double_blocks.{}.`) to
    `target` under the diffusers `prefix`."""
    return rf"^{_block_pattern(bfl_prefix)}{re.escape(bfl)}\.", prefix.format(
        r"\g<1>"
    ) + target + "."


def _norm_in_block(bfl_prefix: str, prefix: str, bfl: str, name: str) -> tuple[str, str]:
    """A rename of a block's norm scale (`.scale` or `.weight` in BFL's naming)."""
    pattern = rf"^{_block_pattern(bfl_prefix)}{re.escape(bfl)}\.(scale|weight)$"
    return pattern, prefix.format(r"\g<1>") + name + ".weight"


def _block_pattern(bfl_prefix: str) -> str:
    """`double_blocks.{}.` as a pattern whose group 1 is the block's number."""
    return re.escape(bfl_prefix).replace(re.escape("{}"), r"(\d+)")


BFL_NAMING = bfl_naming()


TITLE = "FLUX.2 klein"


# The DiT's single file (GGUF or safetensors) in BFL's naming or diffusers' as the family reads
# it (weights.single_dit_file).
dit_file = single_dit_file(DiTConfig, linear_slots, tensor_shapes, BFL_NAMING, TITLE)


def lora_aliases(rows: dict[str, int]) -> dict[str, list[list]]:
    """BFL's name of every linear layer as the rows of the diffusers layers it is made of, in
    order (the manifest's `lora_aliases`: name -> [[layer, start, length], ...]), from the
    manifest's layers and their output rows: LoRA files trained on BFL's checkpoints (ComfyUI,
    ai-toolkit, kohya) name these."""

    def whole(*layers: str) -> list[list]:
        return [[layer, 0, rows[layer]] for layer in layers]

    aliases = {bfl: whole(TOP_LINEARS[key]) for key, bfl in BFL_TOP.items()}
    for key, bfl in BFL_SWAPPED_HALVES.items():
        layer, half = TOP_LINEARS[key], rows[TOP_LINEARS[key]] // 2
        aliases[bfl] = [[layer, half, half], [layer, 0, half]]
    for stack in STACKS:
        counted = next(iter(stack.diffusers_linears.values()))[0]  # every block has it
        for i in range(_blocks(rows, stack.prefix, counted)):
            for parts, bfl in stack.linears.values():
                layers = (stack.prefix.format(i) + part for part in parts)
                aliases[stack.bfl_prefix.format(i) + bfl] = whole(*layers)
    return aliases


def _blocks(rows: dict[str, int], prefix: str, layer: str) -> int:
    count = 0
    while prefix.format(count) + layer in rows:
        count += 1
    return count


def sanitize(files: dict[str, mx.array], config: DiTConfig) -> dict:
    """The file's tensors (diffusers names) as the forward's weight tree: each stream's q/k/v
    concatenated along the rows so they run as one matmul. `linear_slots` names the same places
    for LoRA."""
    weights = {key: files[name + ".weight"] for key, name in TOP_LINEARS.items()}
    for stack in STACKS:
        weights[stack.key] = [
            block_weights(
                files, stack.prefix.format(i), stack.diffusers_linears, stack.diffusers_norms
            )
            for i in range(stack.depth(config))
        ]
    return weights


def quantized(path: str) -> bool:
    """The weights a quantized load quantizes, by tree path: the blocks' linear layers, nearly
    all of the DiT. The embedders (time, text, image), the shared modulations and the final norm
    and projection keep the compute dtype, as the norm scales do."""
    return path.startswith(("double.", "single."))


# ---------------------------------------------------------------------------------------------
# Positions: host-side integers only


def caption_positions(length: int) -> np.ndarray:
    rows = np.arange(length)
    zeros = np.zeros_like(rows)
    return np.stack([zeros, zeros, zeros, rows], axis=1)


def image_positions(time: int, h: int, w: int) -> np.ndarray:
    return np.stack(
        [
            np.full(h * w, time),
            np.repeat(np.arange(h), w),
            np.tile(np.arange(w), h),
            np.zeros(h * w, np.int64),
        ],
        axis=1,
    )


def reference_positions(shapes: list[tuple[int, int]]) -> np.ndarray:
    """(sum h*w, 4): reference k's tokens at time 10 + 10 k, in raster order."""
    parts = [
        image_positions(REF_TIME_SCALE + REF_TIME_SCALE * k, h, w)
        for k, (h, w) in enumerate(shapes)
    ]
    return np.concatenate(parts) if parts else np.zeros((0, 4), np.int64)


@dataclass
class RefState:
    """The references' K and V after RoPE in every block (double blocks, then single), each
    (1, heads, R, head_dim): what the KV model's references give every other token."""

    keys: list[mx.array]
    values: list[mx.array]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)

    @property
    def tokens(self) -> int:
        return int(self.keys[0].shape[2])


def manifest_extras(manifest: dict) -> dict:
    """BFL's names of its linear layers (`lora_aliases`), for LoRA files in them."""
    return {"lora_aliases": lora_aliases(layer_rows(manifest))}


# The DiT's weights as data (dit_network.DiTPart): what FolderFamily and the load read; no
# shard plan.
def table_slots(config: DiTConfig) -> dict[str, LinearSlot]:
    """The layers a patch table may name: the diffusers names and BFL's."""
    return {**linear_slots(config), **bfl_slots(config)}


PART = DiTPart(
    dit_file,
    DiTConfig,
    linear_slots,
    quantized,
    sanitize,
    F32_WEIGHTS,
    tensor_shapes=tensor_shapes,
    manifest_extras=manifest_extras,
    table_slots=table_slots,
)


class Flux2DiT(DiTNetwork):
    PART = PART

    # -- pieces ------------------------------------------------------------------------------

    def time_embedding(self, w: dict, t: mx.array, fp32_time: bool) -> mx.array:
        """(B,) t in [0, 1] -> (B, dim): sinusoid of 1000 t (cos first), then the MLP. The
        reference rule embeds t as the compute dtype holds it (diffusers casts the timestep to
        the DiT's dtype before scaling it); `fp32_time` embeds the float32 t (ComfyUI's)."""
        t = t.astype(mx.float32)
        if fp32_time:
            scaled = TIME_FACTOR * t
        else:
            scaled = (t.astype(self.dtype) * TIME_FACTOR).astype(mx.float32)
        args = scaled[:, None] * self._time_freqs[None, :]
        embedding = mx.concatenate([mx.cos(args), mx.sin(args)], axis=-1).astype(self.dtype)
        return project(w, "time_2", silu(project(w, "time_1", embedding)))

    def modulations(self, w: dict, temb: mx.array) -> dict[str, list[mx.array]]:
        """The three shared modulations of a time embedding (B, dim), each split into its
        (shift, scale, gate) sets, every piece (B, 1, dim)."""
        active = silu(temb)
        out = {}
        for key in ("mod_img", "mod_txt", "mod_single"):
            params = project(w, key, active)[:, None, :]
            out[key] = mx.split(params, params.shape[-1] // self.config.dim, axis=-1)
        return out

    def rms_norm(self, x: mx.array, scale: mx.array) -> mx.array:
        return mx.fast.rms_norm(x.astype(mx.float32), scale, self.config.eps).astype(self.dtype)

    def norm(self, x: mx.array, shift: mx.array, scale: mx.array) -> mx.array:
        return layer_norm(x, self.config.eps) * (1 + scale) + shift

    def rope(self, positions: np.ndarray) -> tuple[mx.array, mx.array]:
        return rope_tables(positions, self.config.axes_dims, self.config.rope_theta, float64=True)

    def heads(self, block: dict, key: str, x: mx.array, norm_q: str, norm_k: str, rope):
        """q, k, v (B, N, H, D) of x through the fused projection block[key], q and k normed
        per head and rotated."""
        batch, length, _ = x.shape
        fused = project(block, key, x).reshape(
            batch, length, 3, self.config.num_heads, self.config.head_dim
        )
        return self.qk_rope(fused, block[norm_q], block[norm_k], rope)

    def qk_rope(self, fused: mx.array, norm_q: mx.array, norm_k: mx.array, rope):
        cos, sin = rope
        q = apply_rope(self.rms_norm(fused[:, :, 0], norm_q), cos, sin)
        k = apply_rope(self.rms_norm(fused[:, :, 1], norm_k), cos, sin)
        return q, k, fused[:, :, 2]

    def attend(self, q, k, v, extra: tuple[mx.array, mx.array] | None) -> mx.array:
        """softmax(q k^T / sqrt(D)) v over (B, N, H, D) inputs, the keys and values of `extra`
        ((B, H, R, D) each) added to the keys; (B, N, H*D)."""
        batch, length = q.shape[:2]
        q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
        if extra is not None:
            k = mx.concatenate([k, extra[0]], axis=2)
            v = mx.concatenate([v, extra[1]], axis=2)
        out = attention(q, k, v, 1.0 / math.sqrt(self.config.head_dim), self.cpu_ops)
        return out.transpose(0, 2, 1, 3).reshape(batch, length, self.config.dim)

    def feed_forward(self, block: dict, prefix: str, x: mx.array) -> mx.array:
        gate, up = mx.split(project(block, prefix + "_ff_in", x), 2, axis=-1)
        return project(block, prefix + "_ff_out", silu(gate) * up)

    # -- blocks ------------------------------------------------------------------------------

    def double_block(self, block, img, txt, mods, rope, extra=None, record=None):
        """One double-stream block over image tokens `img` and text tokens `txt` (None: the
        image stream alone, as the KV model's references run). `rope` covers [txt, img]."""
        (shift1, scale1, gate1, shift2, scale2, gate2) = mods["mod_img"]
        if txt is None:
            normed = self.norm(img, shift1, scale1)
            q, k, v = self.heads(block, "img_qkv", normed, "norm_q", "norm_k", rope)
        else:
            q, k, v = self._joint_heads(block, img, txt, mods, rope)
        if record is not None:
            record.append((k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)))
        attended = self.attend(q, k, v, extra)
        n_txt = 0 if txt is None else txt.shape[1]
        img_attn = project(block, "img_out", attended[:, n_txt:])
        img = img + gate1 * img_attn
        img = img + gate2 * self.feed_forward(block, "img", self.norm(img, shift2, scale2))
        if txt is None:
            return img, None
        c_shift1, c_scale1, c_gate1, c_shift2, c_scale2, c_gate2 = mods["mod_txt"]
        txt = txt + c_gate1 * project(block, "txt_out", attended[:, :n_txt])
        txt = txt + c_gate2 * self.feed_forward(block, "txt", self.norm(txt, c_shift2, c_scale2))
        return img, txt

    def _joint_heads(self, block, img, txt, mods, rope):
        shift1, scale1 = mods["mod_img"][0], mods["mod_img"][1]
        c_shift1, c_scale1 = mods["mod_txt"][0], mods["mod_txt"][1]
        n_txt = txt.shape[1]
        cos, sin = rope
        txt_rope = (cos[:n_txt], sin[:n_txt])
        img_rope = (cos[n_txt:], sin[n_txt:])
        normed_txt = self.norm(txt, c_shift1, c_scale1)
        normed_img = self.norm(img, shift1, scale1)
        qt, kt, vt = self.heads(
            block, "txt_qkv", normed_txt, "norm_added_q", "norm_added_k", txt_rope
        )
        qi, ki, vi = self.heads(block, "img_qkv", normed_img, "norm_q", "norm_k", img_rope)
        return (
            mx.concatenate([qt, qi], axis=1),
            mx.concatenate([kt, ki], axis=1),
            mx.concatenate([vt, vi], axis=1),
        )

    def single_block(self, block, x, mods, rope, extra=None, record=None):
        shift, scale, gate = mods["mod_single"]
        batch, length, dim = x.shape
        projected = project(block, "qkv_mlp", self.norm(x, shift, scale))
        qkv, mlp = projected[..., : 3 * dim], projected[..., 3 * dim :]
        fused = qkv.reshape(batch, length, 3, self.config.num_heads, self.config.head_dim)
        q, k, v = self.qk_rope(fused, block["norm_q"], block["norm_k"], rope)
        if record is not None:
            record.append((k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)))
        attended = self.attend(q, k, v, extra)
        gate_mlp, up = mx.split(mlp, 2, axis=-1)
        out = project(block, "out", mx.concatenate([attended, silu(gate_mlp) * up], axis=-1))
        return x + gate * out

    # -- the forward -------------------------------------------------------------------------

    def reference_states(self, refs: list[mx.array], w: dict | None = None) -> RefState:
        """The KV model's references (each (C, h, w), model space) run alone at time 0: their K
        and V in every block. Depends on the references and the weights only."""
        w = self.weights if w is None else w
        shapes = [(int(r.shape[1]), int(r.shape[2])) for r in refs]
        tokens = mx.concatenate([self.tokens(r[None].astype(self.dtype)) for r in refs], axis=1)
        rope = self.rope(reference_positions(shapes))
        mods = self.modulations(w, self.time_embedding(w, mx.zeros((1,), mx.float32), True))
        x = project(w, "x_in", tokens)
        record: list = []
        for block in w["double"]:
            x, _ = self.double_block(block, x, None, mods, rope, record=record)
        for block in w["single"]:
            x = self.single_block(block, x, mods, rope, record=record)
        mx.eval(record)
        return RefState([k for k, _ in record], [v for _, v in record])

    def forward(
        self,
        x: mx.array,
        t: mx.array,
        caps: list[mx.array],
        refs: list[list[mx.array]] | None = None,
        weights: dict | None = None,
        *,
        ref_mode: str = "joint",
        ref_states: list[RefState | None] | None = None,
        fp32_time: bool = True,
    ) -> mx.array:
        """The DiT's raw output (B, C, h, w) for latents x (B, C, h, w) at times t (B,), row b
        under caption features caps[b] (L_b, joint_attention_dim) and reference latents
        refs[b] (each (C, h_k, w_k)). With `ref_mode` "kv" each row's references come as
        ref_states[b] (from `reference_states`; None for a row without references)."""
        if ref_mode not in REF_MODES:
            raise ValueError(f"ref_mode must be one of {REF_MODES}, got {ref_mode!r}")
        w = self.weights if weights is None else weights
        batch = x.shape[0]
        kv = ref_mode == "kv"
        joint = refs if refs and not kv else [[] for _ in range(batch)]
        states = ref_states if ref_states and kv else [None] * batch
        layouts = [
            (
                cap.shape[0],
                tuple(tuple(r.shape) for r in row),
                None if state is None else state.tokens,
            )
            for cap, row, state in zip(caps, joint, states, strict=True)
        ]

        def run(rows: list[int]) -> mx.array:
            held = [states[b] for b in rows]
            return self._forward_group(
                rows_of(x, rows),
                rows_of(t, rows),
                mx.stack([caps[b] for b in rows]),
                stacked_references([joint[b] for b in rows]),
                None if held[0] is None else held,
                w,
                fp32_time,
            )

        return by_layout(layouts, run)

    def _forward_group(self, x, t, caps, refs, states, w, fp32_time) -> mx.array:
        """Rows of one layout: x (B, C, h, w), caps (B, L, D), refs a list of (B, C, h_k, w_k)
        joint references, states the rows' RefStates (or None)."""
        height, width = x.shape[2:]
        n_txt = caps.shape[1]
        n_img = height * width
        img = self.tokens(x.astype(self.dtype))
        positions = [caption_positions(n_txt), image_positions(0, height, width)]
        if refs:
            img = mx.concatenate([img] + [self.tokens(r.astype(self.dtype)) for r in refs], axis=1)
            positions.append(reference_positions([(r.shape[2], r.shape[3]) for r in refs]))
        rope = self.rope(np.concatenate(positions))
        temb = self.time_embedding(w, t, fp32_time)
        mods = self.modulations(w, temb)
        img = project(w, "x_in", img)
        txt = project(w, "ctx_in", caps.astype(self.dtype))
        depth = 0
        for block in w["double"]:
            img, txt = self.double_block(block, img, txt, mods, rope, self._extra(states, depth))
            depth += 1
        hidden = mx.concatenate([txt, img], axis=1)
        for block in w["single"]:
            hidden = self.single_block(block, hidden, mods, rope, self._extra(states, depth))
            depth += 1
        hidden = hidden[:, n_txt : n_txt + n_img]
        scale, shift = mx.split(project(w, "final_mod", silu(temb))[:, None, :], 2, axis=-1)
        hidden = layer_norm(hidden, self.config.eps) * (1 + scale) + shift
        out = project(w, "final", hidden)
        return self.grid(out, height, width)

    @staticmethod
    def _extra(states: list[RefState] | None, depth: int):
        if states is None:
            return None
        if len(states) == 1:
            return states[0].keys[depth], states[0].values[depth]
        keys = mx.concatenate([s.keys[depth] for s in states], axis=0)
        values = mx.concatenate([s.values[depth] for s in states], axis=0)
        return keys, values
