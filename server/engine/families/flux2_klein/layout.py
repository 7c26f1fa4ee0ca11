"""FLUX.2 klein's DiT as data, without MLX: its config (diffusers' `Flux2Transformer2DModel`
keys), the diffusers names of its weights by the forward's tree keys with BFL's names of them,
its block stacks (`STACKS`), and every tensor's shape (`tensor_shapes`). The network (dit.py),
the weight checks of single files, the component files (components.py) and the embedded
model's recipe (embedded.py, which the listing imports without MLX) read these one tables."""

from __future__ import annotations

from dataclasses import dataclass

from ...config_keys import FluxWidths, read_settings, setting


@dataclass(frozen=True)
class DiTConfig(FluxWidths):
    """Flux2Transformer2DModel's config (`setting`: its key and default)."""

    in_channels: int = setting("in_channels", 128)
    num_layers: int = setting("num_layers", 8)
    num_single_layers: int = setting("num_single_layers", 48)
    num_heads: int = setting("num_attention_heads", 48)
    head_dim: int = setting("attention_head_dim", 128)
    joint_attention_dim: int = setting("joint_attention_dim", 15360)
    mlp_ratio: float = setting("mlp_ratio", 3.0, float)
    axes_dims: tuple[int, ...] = setting("axes_dims_rope", (32, 32, 32, 32), tuple)
    rope_theta: float = setting("rope_theta", 2000, float)
    eps: float = setting("eps", 1e-6, float)
    # the sinusoidal time projection's channels
    time_dim: int = setting("timestep_guidance_channels", 256, int)

    @classmethod
    def from_dict(cls, config: dict) -> DiTConfig:
        if config.get("patch_size", 1) != 1:
            raise ValueError("FLUX.2's DiT takes patchified latents as they are (patch_size 1)")
        if config.get("guidance_embeds", False):
            raise ValueError("a guidance-embedding FLUX.2 DiT (guidance_embeds) is not klein")
        made = read_settings(cls, config)
        out_channels = config.get("out_channels")
        if out_channels not in (None, made.in_channels):
            raise ValueError(
                f"out_channels {out_channels} must equal in_channels {made.in_channels}"
            )
        return made


# The diffusers names of the weights, in one place.

# Linear layers outside the blocks: tree key -> diffusers name.
TOP_LINEARS = {
    "x_in": "x_embedder",
    "ctx_in": "context_embedder",
    "time_1": "time_guidance_embed.timestep_embedder.linear_1",
    "time_2": "time_guidance_embed.timestep_embedder.linear_2",
    "mod_img": "double_stream_modulation_img.linear",
    "mod_txt": "double_stream_modulation_txt.linear",
    "mod_single": "single_stream_modulation.linear",
    "final_mod": "norm_out.linear",
    "final": "proj_out",
}
DOUBLE = "transformer_blocks.{}."
SINGLE = "single_transformer_blocks.{}."
BFL_DOUBLE_BLOCK = "double_blocks.{}."
BFL_SINGLE_BLOCK = "single_blocks.{}."
# A block's linear layers: tree key -> (their diffusers names, in row order, BFL's name). The
# forward fuses each stream's q, k and v as one matrix, as BFL's files do (`qkv`); diffusers
# holds them as three layers. BFL's names are those of its own checkpoints and ComfyUI's Flux2
# model: a patch table may name them, a band picking a part.
DOUBLE_LINEARS = {
    "img_qkv": (("attn.to_q", "attn.to_k", "attn.to_v"), "img_attn.qkv"),
    "txt_qkv": (("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"), "txt_attn.qkv"),
    "img_out": (("attn.to_out.0",), "img_attn.proj"),
    "txt_out": (("attn.to_add_out",), "txt_attn.proj"),
    "img_ff_in": (("ff.linear_in",), "img_mlp.0"),
    "img_ff_out": (("ff.linear_out",), "img_mlp.2"),
    "txt_ff_in": (("ff_context.linear_in",), "txt_mlp.0"),
    "txt_ff_out": (("ff_context.linear_out",), "txt_mlp.2"),
}
SINGLE_LINEARS = {
    "qkv_mlp": (("attn.to_qkv_mlp_proj",), "linear1"),
    "out": (("attn.to_out",), "linear2"),
}
# A block's norm scales: tree key -> (diffusers' name, BFL's, which BFL's files end in `.scale`).
DOUBLE_NORMS = {
    "norm_q": ("attn.norm_q", "img_attn.norm.query_norm"),
    "norm_k": ("attn.norm_k", "img_attn.norm.key_norm"),
    "norm_added_q": ("attn.norm_added_q", "txt_attn.norm.query_norm"),
    "norm_added_k": ("attn.norm_added_k", "txt_attn.norm.key_norm"),
}
SINGLE_NORMS = {
    "norm_q": ("attn.norm_q", "norm.query_norm"),
    "norm_k": ("attn.norm_k", "norm.key_norm"),
}


@dataclass(frozen=True)
class BlockStack:
    """One stack of blocks: its key in the forward's weight tree, block N's name prefix in
    diffusers' naming and in BFL's, its linear layers and norm scales (tables as above), and the
    config field that counts its blocks."""

    key: str
    prefix: str
    bfl_prefix: str
    linears: dict[str, tuple[tuple[str, ...], str]]
    norms: dict[str, tuple[str, str]]
    depth_field: str

    def depth(self, config: DiTConfig) -> int:
        return getattr(config, self.depth_field)

    @property
    def diffusers_linears(self) -> dict[str, tuple[str, ...]]:
        """Tree key -> the diffusers names of the layers its weight is made of, in row order."""
        return {key: names for key, (names, _) in self.linears.items()}

    @property
    def diffusers_norms(self) -> dict[str, str]:
        """Tree key -> the diffusers name of the norm scale."""
        return {key: name for key, (name, _) in self.norms.items()}


DOUBLE_STACK = BlockStack(
    "double", DOUBLE, BFL_DOUBLE_BLOCK, DOUBLE_LINEARS, DOUBLE_NORMS, "num_layers"
)
SINGLE_STACK = BlockStack(
    "single", SINGLE, BFL_SINGLE_BLOCK, SINGLE_LINEARS, SINGLE_NORMS, "num_single_layers"
)
STACKS = (DOUBLE_STACK, SINGLE_STACK)
# Norm scales stay float32 (the norms run in float32); every other weight takes the compute dtype.
F32_WEIGHTS = tuple(
    dict.fromkeys(name + ".weight" for stack in STACKS for name in stack.diffusers_norms.values())
)


# BFL's names of the linear layers outside the blocks.
# Not norm_out.linear's BFL name (final_layer.adaLN_modulation.1): its halves are swapped.
BFL_TOP = {
    "x_in": "img_in",
    "ctx_in": "txt_in",
    "time_1": "time_in.in_layer",
    "time_2": "time_in.out_layer",
    "mod_img": "double_stream_modulation_img.lin",
    "mod_txt": "double_stream_modulation_txt.lin",
    "mod_single": "single_stream_modulation.lin",
    "final": "final_layer.linear",
}
# BFL's final modulation is norm_out.linear with its two halves swapped: (shift, scale) where
# diffusers has (scale, shift). LoRA files name it (ComfyUI's Flux2 patches it as its weight).
BFL_SWAPPED_HALVES = {"final_mod": "final_layer.adaLN_modulation.1"}


def tensor_shapes(config: DiTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the DiT reads, by diffusers name, with the shape `config` gives it."""
    dim, mlp, head = config.dim, config.mlp_dim, (config.head_dim,)
    top = {
        "x_in": (dim, config.in_channels),
        "ctx_in": (dim, config.joint_attention_dim),
        "time_1": (dim, config.time_dim),
        "time_2": (dim, dim),
        "mod_img": (6 * dim, dim),
        "mod_txt": (6 * dim, dim),
        "mod_single": (3 * dim, dim),
        "final_mod": (2 * dim, dim),
        "final": (config.in_channels, dim),
    }
    shapes = {TOP_LINEARS[key] + ".weight": shape for key, shape in top.items()}
    double = {
        **dict.fromkeys(("img_qkv", "txt_qkv", "img_out", "txt_out"), (dim, dim)),
        **dict.fromkeys(("img_ff_in", "txt_ff_in"), (2 * mlp, dim)),
        **dict.fromkeys(("img_ff_out", "txt_ff_out"), (dim, mlp)),
    }
    single = {"qkv_mlp": (3 * dim + 2 * mlp, dim), "out": (dim, dim + mlp)}
    for stack, linear_shapes in ((DOUBLE_STACK, double), (SINGLE_STACK, single)):
        for i in range(stack.depth(config)):
            prefix = stack.prefix.format(i)
            for key, parts in stack.diffusers_linears.items():
                for name in parts:
                    shapes[prefix + name + ".weight"] = linear_shapes[key]
            for name in stack.diffusers_norms.values():
                shapes[prefix + name + ".weight"] = head
    return shapes
