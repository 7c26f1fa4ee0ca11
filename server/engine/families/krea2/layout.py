"""Krea 2's DiT as data, without MLX: its config (`DiTConfig`), the diffusers names of its
weights by tree key, the norm scales kept in float32 and `tensor_shapes`, which the network
(dit.py), the single-file checks and the embedded recipe read; so `gmlx list` names the embedded
Krea 2 in a Python without MLX."""

from __future__ import annotations

from dataclasses import dataclass

from ...config_keys import check_rope_axes, read_settings, setting

PATCH = 2  # latents are cut into 2x2 patches (the pipeline's patch_size)
TIME_SCALE = 1000.0  # the sinusoid embeds 1000 t


@dataclass(frozen=True)
class DiTConfig:
    """Krea2Transformer2DModel's config (`setting`: its key and default)."""

    in_channels: int = setting("in_channels", 64)  # patch channels: latent channels x PATCH^2
    num_layers: int = setting("num_layers", 28)
    head_dim: int = setting("attention_head_dim", 128)
    num_heads: int = setting("num_attention_heads", 48)
    num_kv_heads: int = setting("num_key_value_heads", 12)
    intermediate_size: int = setting("intermediate_size", 16384)
    time_dim: int = setting("timestep_embed_dim", 256)
    text_dim: int = setting("text_hidden_dim", 2560)
    num_text_layers: int = setting("num_text_layers", 12)
    text_heads: int = setting("text_num_attention_heads", 20)
    text_kv_heads: int = setting("text_num_key_value_heads", 20)
    text_intermediate_size: int = setting("text_intermediate_size", 6912)
    layerwise_blocks: int = setting("num_layerwise_text_blocks", 2)
    refiner_blocks: int = setting("num_refiner_text_blocks", 2)
    axes_dims: tuple[int, ...] = setting("axes_dims_rope", (32, 48, 48), tuple)
    rope_theta: float = setting("rope_theta", 1000.0, float)
    norm_eps: float = setting("norm_eps", 1e-5, float)

    @classmethod
    def from_dict(cls, config: dict) -> DiTConfig:
        made = read_settings(cls, config)
        check_rope_axes(made.axes_dims, made.head_dim)
        if made.in_channels % (PATCH * PATCH):
            raise ValueError(f"in_channels {made.in_channels} is no multiple of {PATCH * PATCH}")
        return made

    @property
    def dim(self) -> int:
        return self.head_dim * self.num_heads

    @property
    def latent_channels(self) -> int:
        return self.in_channels // (PATCH * PATCH)

    @property
    def cond_width(self) -> int:
        """A row's conditioning width (the wire's D): the tapped text layers side by side."""
        return self.num_text_layers * self.text_dim

    @property
    def text_head_dim(self) -> int:
        return self.text_dim // self.text_heads


# ---------------------------------------------------------------------------------------------
# Weights: the diffusers names mapped to the forward's tree, in one place

# The block stacks: tree key -> diffusers prefix. The text fusion's two run before the main one.
STACKS = {
    "layerwise": "text_fusion.layerwise_blocks.{}.",
    "refiner": "text_fusion.refiner_blocks.{}.",
    "blocks": "transformer_blocks.{}.",
}
# A block's linear layers by diffusers name, grouped into the fused weights the forward uses (each
# group's parts are of one size: q and the gate are both as wide as the block, k and v both
# as wide as the key/value heads).
BLOCK_LINEARS = {
    "q_gate": ("attn.to_q", "attn.to_gate"),
    "kv": ("attn.to_k", "attn.to_v"),
    "out": ("attn.to_out.0",),
    "gate_up": ("ff.gate", "ff.up"),
    "down": ("ff.down",),
}
BLOCK_NORMS = {"norm_q": "attn.norm_q", "norm_k": "attn.norm_k", "norm1": "norm1", "norm2": "norm2"}
MODULATION_TABLE = "scale_shift_table"  # a main block's (6, hidden) table
# Linear layers outside the blocks: tree key -> diffusers name (all with biases but the projector).
TOP_LINEARS = {
    "img_in": "img_in",
    "time_1": "time_embed.linear_1",
    "time_2": "time_embed.linear_2",
    "time_mod": "time_mod_proj",
    "txt_in_1": "txt_in.linear_1",
    "txt_in_2": "txt_in.linear_2",
    "final": "final_layer.linear",
}
PROJECTOR = "text_fusion.projector"  # (1, num_text_layers): collapses the layer axis
TOP_NORMS = {"txt_norm": "txt_in.norm.weight", "final_norm": "final_layer.norm.weight"}
FINAL_TABLE = "final_layer.scale_shift_table"  # (2, hidden)
# The RMS norms run in float32 and their scales stay float32 (the reference keeps them so).
F32_WEIGHTS = tuple(f"{name}.weight" for name in BLOCK_NORMS.values()) + tuple(TOP_NORMS.values())


def stack_depth(stack: str, config: DiTConfig) -> int:
    return {
        "layerwise": config.layerwise_blocks,
        "refiner": config.refiner_blocks,
        "blocks": config.num_layers,
    }[stack]


def tensor_shapes(config: DiTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the DiT reads, by diffusers name, with the shape `config` gives it."""
    hidden = config.dim
    linears = {
        "img_in": (hidden, config.in_channels),
        "time_1": (hidden, config.time_dim),
        "time_2": (hidden, hidden),
        "time_mod": (6 * hidden, hidden),
        "txt_in_1": (hidden, config.text_dim),
        "txt_in_2": (hidden, hidden),
        "final": (config.in_channels, hidden),
    }
    shapes: dict[str, tuple[int, ...]] = {}
    for key, shape in linears.items():
        name = TOP_LINEARS[key]
        shapes[name + ".weight"], shapes[name + ".bias"] = shape, shape[:1]
    shapes[PROJECTOR + ".weight"] = (1, config.num_text_layers)
    shapes[TOP_NORMS["txt_norm"]] = (config.text_dim,)
    shapes[TOP_NORMS["final_norm"]] = (hidden,)
    shapes[FINAL_TABLE] = (2, hidden)
    for stack, prefix in STACKS.items():
        text = stack != "blocks"
        width = config.text_dim if text else hidden
        head_dim = config.text_head_dim if text else config.head_dim
        kv = head_dim * (config.text_kv_heads if text else config.num_kv_heads)
        inner = config.text_intermediate_size if text else config.intermediate_size
        block = {
            "attn.to_q": (width, width),
            "attn.to_gate": (width, width),
            "attn.to_k": (kv, width),
            "attn.to_v": (kv, width),
            "attn.to_out.0": (width, width),
            "ff.gate": (inner, width),
            "ff.up": (inner, width),
            "ff.down": (width, inner),
        }
        for i in range(stack_depth(stack, config)):
            p = prefix.format(i)
            for name, shape in block.items():
                shapes[p + name + ".weight"] = shape
            shapes[p + "attn.norm_q.weight"] = shapes[p + "attn.norm_k.weight"] = (head_dim,)
            shapes[p + "norm1.weight"] = shapes[p + "norm2.weight"] = (width,)
            if not text:
                shapes[p + MODULATION_TABLE] = (6, hidden)
    return shapes
