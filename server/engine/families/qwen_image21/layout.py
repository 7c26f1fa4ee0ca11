"""Qwen-Image 2.1's DiT as data, without MLX: its config (diffusers'
`QwenImage21Transformer2DModel` keys), the diffusers names of its weights by the forward's tree
keys, and every tensor's shape (`tensor_shapes`). The network (dit.py), the GGUF checks and the
embedded model's recipe (embedded.py, which the listing imports without MLX) read these one
tables."""

from __future__ import annotations

from dataclasses import dataclass

from ...config_keys import read_settings, setting


@dataclass(frozen=True)
class DiTConfig:
    """QwenImage21Transformer2DModel's config (`setting`: its key and default)."""

    in_channels: int = setting("in_channels", 64)
    out_channels: int = 64  # the config's, else in_channels (`from_dict`)
    num_layers: int = setting("num_layers", 32)
    num_heads: int = setting("num_attention_heads", 32)
    head_dim: int = setting("attention_head_dim", 128)
    context_in_dim: int = setting("context_in_dim", 4096)
    mlp_ratio: int = setting("mlp_ratio", 3)
    axes_dims_rope: tuple[int, int, int] = setting("axes_dims_rope", (16, 56, 56), tuple)
    eps: float = setting("eps", 1e-6)
    patch_size: int = setting("patch_size", 1)
    causal_condition: bool = setting("causal_condition", True)
    time_dim: int = 256  # the timestep projection's sinusoid width (fixed: no config key)

    @classmethod
    def from_dict(cls, config: dict) -> DiTConfig:
        out_channels = config.get("out_channels") or config.get("in_channels", 64)
        return read_settings(cls, config, out_channels=out_channels)

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def cond_width(self) -> int:
        """A row's conditioning width (the wire's D): the text encoder's last hidden state."""
        return self.context_in_dim


# ---------------------------------------------------------------------------------------------
# The diffusers names of the weights, in one place

BLOCK_PREFIX = "transformer_blocks.{}."
# Linear layers of a block by diffusers name, grouped into the fused weights the forward uses:
# the parts (all the same shape) are stacked along the output rows in this order.
BLOCK_LINEARS = {
    "qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "out": ("attn.to_out.0",),
    "gate_up": ("img_mlp.gate_layer", "img_mlp.proj"),
    "down": ("img_mlp.out",),
}
BLOCK_NORMS = {"norm_q": "attn.norm_q", "norm_k": "attn.norm_k"}  # the blocks' q/k RMS norms
# Linear layers outside the blocks: tree key -> diffusers name.
TOP_LINEARS = {
    "time_1": "time_text_embed.timestep_embedder.linear_1",
    "time_2": "time_text_embed.timestep_embedder.linear_2",
    "text_in": "txt_in.in_layer",
    "text_out": "txt_in.out_layer",
    "img_in": "img_in",
    "modulation": "modulation.1",
    "norm_out": "norm_out.linear",
    "proj_out": "proj_out",
}
TEXT_NORM = "txt_in.text_norm.weight"  # zero-centred: the file stores scale - 1
# Norm scales stay float32 (the norms run in float32); every other weight takes the compute dtype.
F32_WEIGHTS = tuple(name + ".weight" for name in BLOCK_NORMS.values()) + (TEXT_NORM,)


def tensor_shapes(config: DiTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the DiT reads, by diffusers name, with the shape `config` gives it."""
    width, hidden = config.inner_dim, config.inner_dim * config.mlp_ratio
    patches = config.patch_size * config.patch_size
    top = {
        "time_1": (width, config.time_dim),
        "time_2": (width, width),
        "text_in": (width, config.context_in_dim),
        "text_out": (width, width),
        "img_in": (width, config.in_channels * patches),
        "modulation": (4 * width, width),
        "norm_out": (width, width),
        "proj_out": (config.out_channels * patches, width),
    }
    shapes = {TOP_LINEARS[key] + ".weight": shape for key, shape in top.items()}
    shapes[TEXT_NORM] = (config.context_in_dim,)
    block = {
        "qkv": (width, width),
        "out": (width, width),
        "gate_up": (hidden, width),
        "down": (width, hidden),
    }
    for i in range(config.num_layers):
        prefix = BLOCK_PREFIX.format(i)
        for key, parts in BLOCK_LINEARS.items():
            for name in parts:
                shapes[prefix + name + ".weight"] = block[key]
        for name in BLOCK_NORMS.values():
            shapes[prefix + name + ".weight"] = (config.head_dim,)
    return shapes
