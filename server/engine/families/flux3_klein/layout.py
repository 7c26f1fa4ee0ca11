"""FLUX.3 klein's DiT as data, without MLX: its config (diffusers' `Flux3Transformer2DModel`
keys), the diffusers names of its weights by the forward's tree keys, and every tensor's shape
(`tensor_shapes`). The network (dit.py), the single-file checks and the embedded model's recipe
read these one tables, so `gmlx list` names the embedded FLUX.3 klein in a Python without MLX."""

from __future__ import annotations

from dataclasses import dataclass

from ...config_keys import FluxWidths, check_rope_axes, read_settings, setting

TIME_FACTOR = 1000.0  # the DiT embeds 1000 t
IMAGE_ROPE_SCALE = 0.5  # the pipeline's image positions: (row, column) x 0.5


@dataclass(frozen=True)
class DiTConfig(FluxWidths):
    """Flux3Transformer2DModel's config (`setting`: its key and default)."""

    in_channels: int = setting("in_channels", 128)  # the image tokens' (latents patchified 2x2)
    cond_in_channels: int = setting("cond_in_channels", 128)  # the reference tokens'
    num_layers: int = setting("num_layers", 5)  # per-mode blocks of each mode
    num_single_layers: int = setting("num_single_layers", 28)
    num_heads: int = setting("num_attention_heads", 24)
    head_dim: int = setting("attention_head_dim", 128)
    joint_attention_dim: int = setting("joint_attention_dim", 20480)  # the stacked text layers'
    time_dim: int = setting("timestep_channels", 256)  # the sinusoidal time projection's
    mlp_ratio: float = setting("mlp_ratio", 3.0, float)
    axes_dims: tuple[int, ...] = setting("axes_dims_rope", (32, 32, 32, 32), tuple)
    rope_theta: float = setting("rope_theta", 10000, float)
    eps: float = setting("eps", 1e-6, float)
    # a step-distilled checkpoint: it also embeds the time each step jumps to
    flow_map: bool = setting("flow_map", False, bool)

    @classmethod
    def from_dict(cls, config: dict) -> DiTConfig:
        made = read_settings(cls, config)
        check_rope_axes(made.axes_dims, made.head_dim)
        return made


# ---------------------------------------------------------------------------------------------
# The diffusers names of the weights, in one place

# The three token modes: tree key -> diffusers name of the mode. The image tokens run at the
# step's time, the references (`image_cond`) and the text at time 0.
MODES = {"image": "image", "cond": "image_cond", "txt": "txt"}
# Linear layers outside the blocks: tree key -> diffusers name.
TOP_LINEARS = {
    "x_in": "x_embedders.image",
    "cond_in": "x_embedders.image_cond",
    "ctx_in": "context_embedder",
    "time_1": "timestep_embedder.linear_1",
    "time_2": "timestep_embedder.linear_2",
    **{f"early_{key}": f"early_stream_modulations.{name}.linear" for key, name in MODES.items()},
    **{f"single_{key}": f"single_stream_modulations.{name}.linear" for key, name in MODES.items()},
    "final_mod": "norm_out.linear",
    "final": "proj_out",
}
# A flow-map checkpoint's embedder of the time each step jumps to.
TARGET_LINEARS = {
    "target_1": "target_timestep_embedder.linear_1",
    "target_2": "target_timestep_embedder.linear_2",
}
# The block stacks: tree key -> diffusers prefix, in the order the forward runs them.
STACKS = {
    "txt_blocks": "txt_mode_blocks.{}.",
    "image_blocks": "mode_blocks.image.{}.",
    "cond_blocks": "mode_blocks.image_cond.{}.",
    "single": "single_transformer_blocks.{}.",
}
# Every block (per-mode or joint) is alike: its linear layers by diffusers name, grouped into the
# fused weights the forward uses (q, k and v as one matrix).
BLOCK_LINEARS = {
    "qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "out": ("attn.to_out.0",),
    "ff_in": ("ff.linear_in",),
    "ff_out": ("ff.linear_out",),
}
BLOCK_NORMS = {"norm_q": "attn.norm_q", "norm_k": "attn.norm_k"}
# The QK norms run in float32 and their scales stay float32 (the reference keeps them so).
F32_WEIGHTS = tuple(name + ".weight" for name in BLOCK_NORMS.values())


def top_linears(config: DiTConfig) -> dict[str, str]:
    """The linear layers outside the blocks this config has (a flow map's target embedder)."""
    return {**TOP_LINEARS, **(TARGET_LINEARS if config.flow_map else {})}


def stack_depth(stack: str, config: DiTConfig) -> int:
    return config.num_single_layers if stack == "single" else config.num_layers


def tensor_shapes(config: DiTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the DiT reads, by diffusers name, with the shape `config` gives it."""
    dim, mlp, head = config.dim, config.mlp_dim, (config.head_dim,)
    top = {
        "x_in": (dim, config.in_channels),
        "cond_in": (dim, config.cond_in_channels),
        "ctx_in": (dim, config.joint_attention_dim),
        "time_1": (dim, config.time_dim),
        "time_2": (dim, dim),
        "target_1": (dim, config.time_dim),
        "target_2": (dim, dim),
        **{f"early_{key}": (3 * dim, dim) for key in MODES},
        **{f"single_{key}": (3 * dim, dim) for key in MODES},
        "final_mod": (2 * dim, dim),
        "final": (config.in_channels, dim),
    }
    shapes = {name + ".weight": top[key] for key, name in top_linears(config).items()}
    block = {"qkv": (dim, dim), "out": (dim, dim), "ff_in": (2 * mlp, dim), "ff_out": (dim, mlp)}
    for stack, prefix in STACKS.items():
        for i in range(stack_depth(stack, config)):
            p = prefix.format(i)
            for key, parts in BLOCK_LINEARS.items():
                for name in parts:
                    shapes[p + name + ".weight"] = block[key]
            for name in BLOCK_NORMS.values():
                shapes[p + name + ".weight"] = head
    return shapes


# BFL's names of the DiT's tensors (its own checkpoints, the GGUF files converted from them and
# the LoRA files trained on them), as diffusers' single-file conversion
# (`convert_flux3_transformer_checkpoint_to_diffusers`) maps them: whole names by tree key,
# name prefixes, and the names inside a block; a modulation's `.lin` is `.linear`.
BFL_TOP = {
    "time_1": "time_in.in_layer",
    "time_2": "time_in.out_layer",
    "target_1": "ref_time_in.in_layer",
    "target_2": "ref_time_in.out_layer",
    "final": "final_layer.image.linear",
}
# BFL's final modulation holds (shift, scale) where diffusers' norm_out.linear holds (scale,
# shift).
BFL_SWAPPED_HALVES = {"final_mod": "final_layer.image.adaLN_modulation.1"}
BFL_PREFIXES = {
    "emb_in.": "x_embedders.",
    "txt_in.": "context_embedder.",
    "content_mode_blocks.": "mode_blocks.",
    "single_blocks.": "single_transformer_blocks.",
}
BFL_BLOCK = {
    "q_proj": "attn.to_q",
    "k_proj": "attn.to_k",
    "v_proj": "attn.to_v",
    "attn_out": "attn.to_out.0",
    "mlp_in": "ff.linear_in",
    "mlp_out": "ff.linear_out",
    "norm.query_norm": "attn.norm_q",
    "norm.key_norm": "attn.norm_k",
}
BFL_MODULATION = (".lin.", ".linear.")


TOP_NAMES = {**TOP_LINEARS, **TARGET_LINEARS}


def bfl_name(layer: str) -> str:
    """BFL's name of a diffusers linear layer (bfl_naming's inverse, for LoRA files)."""
    for key, bfl in BFL_TOP.items():
        if layer == TOP_NAMES[key]:
            return bfl
    dotted = layer + "."
    for bfl, name in BFL_PREFIXES.items():
        if dotted.startswith(name):
            dotted = bfl + dotted[len(name) :]
            break
    layer = dotted[:-1]
    stem, _, last = layer.rpartition(".")
    if last == BFL_MODULATION[1].strip("."):
        return stem + BFL_MODULATION[0].rstrip(".")
    for bfl, name in BFL_BLOCK.items():
        if layer.endswith("." + name):
            return layer[: -len(name)] + bfl
    return layer
