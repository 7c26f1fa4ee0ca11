"""The twin-blocks DiT: double blocks (an image and a text stream, each with its own fused
q/k/v and unfused output and MLP, attending jointly) then single blocks over the joined
sequence (unfused q, k, v). A functional weight tree; `sanitize` maps the file's names onto it,
`linear_slots` names the same places for LoRA and `tensor_shapes` every tensor for single
files, in one place; `quantized` picks what a quantized load quantizes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from gmlx_server.engine.dit_file import DiTFile, Naming, fused_weights
from gmlx_server.engine.dit_network import DiTNetwork, DiTPart
from gmlx_server.engine.lora import LinearSlot, project
from gmlx_server.engine.nn.activations import layer_norm, silu
from gmlx_server.engine.nn.attention import attention
from gmlx_server.engine.nn.rope import apply_rope, rope_tables
from gmlx_server.engine.weights import gguf_file, read_config

QKV = ("to_q", "to_k", "to_v")
STREAMS = ("img", "txt")
# Per stream of a double block: tree key -> the file names it holds, in row order (q/k/v fused
# as "qkv"); per single block likewise, every projection unfused.
STREAM_LINEARS = {"qkv": tuple(f"attn.{n}" for n in QKV), "out": ("attn.to_out",)}
STREAM_LINEARS |= {"mlp_up": ("mlp.up",), "mlp_down": ("mlp.down",)}
SINGLE_LINEARS = {n: (f"attn.{n}",) for n in QKV}
SINGLE_LINEARS |= {"out": ("attn.to_out",), "mlp_up": ("mlp.up",), "mlp_down": ("mlp.down",)}
TOP_LINEARS = {"time_in": "time_in", "img_in": "img_in", "txt_in": "txt_in", "proj_out": "proj_out"}
F32_WEIGHTS = ("norm_out.weight",)  # the final RMS norm's scale, read in float32
EPS = 1e-6


@dataclass(frozen=True)
class Config:
    in_channels: int
    text_width: int
    hidden: int
    heads: int
    double_blocks: int
    single_blocks: int
    mlp: int

    @classmethod
    def from_dict(cls, config: dict) -> Config:
        return cls(**{name: int(config[name]) for name in cls.__dataclass_fields__})

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def cond_width(self) -> int:
        """A row's conditioning width (the wire's D): the text encoder's last hidden state."""
        return self.text_width


def linear_slots(config: Config) -> dict[str, LinearSlot]:
    """Every linear layer by its file name less `.weight`."""
    slots = {name: LinearSlot(key) for key, name in TOP_LINEARS.items()}
    for i in range(config.double_blocks):
        for stream in STREAMS:
            for key, parts in STREAM_LINEARS.items():
                for part, name in enumerate(parts):
                    slot = LinearSlot(key, ("double", i, stream), part, len(parts))
                    slots[f"double_blocks.{i}.{stream}_{name}"] = slot
    for i in range(config.single_blocks):
        for key, (name,) in SINGLE_LINEARS.items():
            slots[f"single_blocks.{i}.{name}"] = LinearSlot(key, ("single", i))
    return slots


def tensor_shapes(config: Config) -> dict[str, tuple[int, ...]]:
    """Every tensor the forward reads, by file name, with its shape."""
    hidden, mlp = config.hidden, config.mlp
    shapes = {"time_in.weight": (hidden, 1), "img_in.weight": (hidden, config.in_channels)}
    shapes |= {"txt_in.weight": (hidden, config.text_width)}
    shapes |= {"proj_out.weight": (config.in_channels, hidden), "norm_out.weight": (hidden,)}
    per_block = {f"attn.{name}": (hidden, hidden) for name in (*QKV, "to_out")}
    per_block |= {"mlp.up": (mlp, hidden), "mlp.down": (hidden, mlp)}
    for i in range(config.double_blocks):
        for stream in STREAMS:
            for names in STREAM_LINEARS.values():
                shapes |= {f"double_blocks.{i}.{stream}_{n}.weight": per_block[n] for n in names}
    for i in range(config.single_blocks):
        for names in SINGLE_LINEARS.values():
            shapes |= {f"single_blocks.{i}.{n}.weight": per_block[n] for n in names}
    return shapes


def quantized(path: str) -> bool:
    """The blocks' linear weights (the embedders and the output projection stay float)."""
    return path.startswith(("double.", "single."))


def dit_file(transformer_dir: Path, dit: Path | None = None) -> DiTFile | None:
    """The DiT's GGUF file (a model entry's `dit`, else the folder's one .gguf), in its own
    names; None for safetensors."""
    path = gguf_file(transformer_dir, dit)
    if path is None:
        return None
    config = Config.from_dict(read_config(transformer_dir))
    fused = fused_weights(linear_slots(config))
    return DiTFile(path, Naming(), tensor_shapes(config), fused, "twin-blocks")


def sanitize(files: dict[str, mx.array], config: Config) -> dict:
    """The file's tensors as the forward's tree (fused weights concatenated along the rows)."""

    def linears(prefix: str, table: dict[str, tuple[str, ...]]) -> dict:
        return {
            key: mx.concatenate([files[prefix + name + ".weight"] for name in names], axis=0)
            for key, names in table.items()
        }

    tree: dict = {key: files[name + ".weight"] for key, name in TOP_LINEARS.items()}
    tree["norm_out"] = files["norm_out.weight"]
    tree["double"] = [
        {stream: linears(f"double_blocks.{i}.{stream}_", STREAM_LINEARS) for stream in STREAMS}
        for i in range(config.double_blocks)
    ]
    tree["single"] = [
        linears(f"single_blocks.{i}.", SINGLE_LINEARS) for i in range(config.single_blocks)
    ]
    return tree


PART = DiTPart(
    dit_file, Config, linear_slots, quantized, sanitize, F32_WEIGHTS, tensor_shapes=tensor_shapes
)


class TwinBlocksDiT(DiTNetwork):
    PART = PART

    def forward(self, w: dict, x: mx.array, sigma: float, text: mx.array) -> mx.array:
        """x (1, N, C) image tokens, text (1, L, D) -> (1, N, C): joint attention, no cache."""
        length, tokens = text.shape[1], x.shape[1]
        temb = project(w, "time_in", mx.full((1, 1, 1), sigma, self.dtype))
        img = project(w, "img_in", x.astype(self.dtype)) + temb
        txt = project(w, "txt_in", text.astype(self.dtype))
        cos, sin = rope_tables(np.arange(length + tokens)[:, None], (self.config.head_dim,))
        for block in w["double"]:
            tq, tk, tv = self._fused_qkv(block["txt"], txt)
            iq, ik, iv = self._fused_qkv(block["img"], img)
            joined = self._attend(
                mx.concatenate([tq, iq], axis=1),
                mx.concatenate([tk, ik], axis=1),
                mx.concatenate([tv, iv], axis=1),
                cos,
                sin,
            )
            txt = self._stream_out(block["txt"], txt, joined[:, :length])
            img = self._stream_out(block["img"], img, joined[:, length:])
        hidden = mx.concatenate([txt, img], axis=1)
        for block in w["single"]:
            normed = layer_norm(hidden, EPS)
            q, k, v = (self._split(project(block, name, normed)) for name in QKV)
            hidden = self._stream_out(block, hidden, self._attend(q, k, v, cos, sin))
        out = mx.fast.rms_norm(hidden[:, length:].astype(mx.float32), w["norm_out"], EPS)
        return project(w, "proj_out", out.astype(self.dtype))

    def _fused_qkv(self, node: dict, hidden: mx.array):
        fused = project(node, "qkv", layer_norm(hidden, EPS))
        return tuple(self._split(part) for part in mx.split(fused, 3, axis=-1))

    def _split(self, x: mx.array) -> mx.array:
        """(B, N, hidden) -> (B, N, heads, head_dim)."""
        return x.reshape(*x.shape[:2], self.config.heads, self.config.head_dim)

    def _attend(self, q, k, v, cos, sin) -> mx.array:
        """Rotated, attended over the whole sequence, heads merged: (B, N, hidden)."""
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        out = attention(q, k, v, self.config.head_dim**-0.5, self.cpu_ops)
        return out.transpose(0, 2, 1, 3).reshape(*out.shape[:1], out.shape[2], -1)

    def _stream_out(self, node: dict, hidden: mx.array, attended: mx.array) -> mx.array:
        hidden = hidden + project(node, "out", attended)
        mlp = project(node, "mlp_up", layer_norm(hidden, EPS))
        return hidden + project(node, "mlp_down", silu(mlp))
