"""Z-Image's DiT as data, without MLX: its config (diffusers' `ZImageTransformer2DModel` keys),
the diffusers names of its weights by the forward's tree keys, and every tensor's shape
(`tensor_shapes`). The network (dit.py), the single-file checks, the component files
(components.py) and the embedded model's recipe (embedded.py, which the listing imports without
MLX) read these one tables."""

from __future__ import annotations

from dataclasses import dataclass

from ...config_keys import HeadsOfDim, check_fixed, read_settings, setting

ADALN_DIM = 256  # the time embedding's width (at most the model's)
TIME_MID_DIM = 1024  # the time embedder's hidden width

# Config keys fixed to what the network builds (engine/config_keys.py): QK RMS norms, and as
# many key/value heads as query heads (n_kv_heads, checked against n_heads).
FIXED = {"qk_norm": True}


@dataclass(frozen=True)
class DiTConfig(HeadsOfDim):
    """ZImageTransformer2DModel's config (`setting`: its key and default)."""

    in_channels: int = setting("in_channels", 16)
    dim: int = setting("dim", 3840)
    num_layers: int = setting("n_layers", 30)
    num_refiner_layers: int = setting("n_refiner_layers", 2)
    num_heads: int = setting("n_heads", 30)
    norm_eps: float = setting("norm_eps", 1e-5)
    cap_feat_dim: int = setting("cap_feat_dim", 2560)
    rope_theta: float = setting("rope_theta", 256.0, float)
    t_scale: float = setting("t_scale", 1000.0, float)
    axes_dims: tuple[int, ...] = setting("axes_dims", (32, 48, 48), tuple)
    axes_lens: tuple[int, ...] = setting("axes_lens", (1024, 512, 512), tuple)
    patch_size: int = 2  # all_patch_size's one entry (`from_dict`)
    time_dim: int = 256  # the time embedder's sinusoid width (fixed: no config key)

    @property
    def cond_width(self) -> int:
        """A row's conditioning width (the wire's D): the caption's."""
        return self.cap_feat_dim

    @classmethod
    def from_dict(cls, config: dict) -> DiTConfig:
        patches = tuple(config.get("all_patch_size", (2,)))
        frame_patches = tuple(config.get("all_f_patch_size", (1,)))
        if patches != (2,) or frame_patches != (1,):
            raise ValueError(
                f"Z-Image's DiT patches latents 2x2 (all_patch_size (2,), all_f_patch_size (1,)),"
                f" got {patches} and {frame_patches}"
            )
        if config.get("siglip_feat_dim") is not None:
            raise ValueError("the Omni variant (siglip_feat_dim) is not supported")
        made = read_settings(cls, config, patch_size=patches[0])
        check_fixed(config, {**FIXED, "n_kv_heads": made.num_heads}, "Z-Image's DiT")
        return made

    @property
    def hidden_dim(self) -> int:
        return int(self.dim / 3 * 8)

    @property
    def adaln_dim(self) -> int:
        return min(self.dim, ADALN_DIM)

    @property
    def patch_channels(self) -> int:
        return self.patch_size * self.patch_size * self.in_channels


# ---------------------------------------------------------------------------------------------
# The diffusers names of the weights, in one place

# The three block stacks: tree key -> (diffusers prefix, whether its blocks are modulated).
STACKS = {
    "noise_refiner": ("noise_refiner.{}.", True),
    "context_refiner": ("context_refiner.{}.", False),
    "layers": ("layers.{}.", True),
}
# Linear layers of a block by diffusers name, grouped into the fused weights the forward uses.
BLOCK_LINEARS = {
    "qkv": ("attention.to_q", "attention.to_k", "attention.to_v"),
    "out": ("attention.to_out.0",),
    "gate_up": ("feed_forward.w1", "feed_forward.w3"),
    "down": ("feed_forward.w2",),
}
MODULATION = "adaLN_modulation.0"  # a modulated block's linear (with bias)
BLOCK_NORMS = {
    "norm_q": "attention.norm_q",
    "norm_k": "attention.norm_k",
    "attention_norm1": "attention_norm1",
    "attention_norm2": "attention_norm2",
    "ffn_norm1": "ffn_norm1",
    "ffn_norm2": "ffn_norm2",
}
HEAD_NORMS = ("norm_q", "norm_k")  # the norms over a head (the others span the model's width)
# ComfyUI's names where they differ from diffusers' (its Lumina2 `NextDiT`, which the Z-Image
# GGUF files ComfyUI-GGUF converts use; diffusers' single-file conversion maps the same): a
# block's q, k and v as one `qkv`, the attention's output and its q/k norms, by tree key. A key
# of several diffusers parts is one fused tensor in ComfyUI's files (as `qkv`).
COMFY_BLOCK = {
    "qkv": "attention.qkv",
    "out": "attention.out",
    "norm_q": "attention.q_norm",
    "norm_k": "attention.k_norm",
}
# Linear layers outside the blocks (all with biases): tree key -> diffusers name ("{patch}" is
# the patch key, "2-1").
TOP_LINEARS = {
    "time_1": "t_embedder.mlp.0",
    "time_2": "t_embedder.mlp.2",
    "cap_in": "cap_embedder.1",
    "x_in": "all_x_embedder.{patch}",
    "final_modulation": "all_final_layer.{patch}.adaLN_modulation.1",
    "final": "all_final_layer.{patch}.linear",
}
# ComfyUI's names of the patch-keyed layers: without the patch key (these layers alone: a
# file's other `final_layer.` names are not renamed). Its `norm_final` the
# forward does not read.
COMFY_TOP = {
    "x_in": "x_embedder",
    "final_modulation": "final_layer.adaLN_modulation.1",
    "final": "final_layer.linear",
}
COMFY_UNREAD = ("norm_final.weight",)
CAP_NORM = "cap_embedder.0.weight"
PAD_TOKENS = {"x_pad": "x_pad_token", "cap_pad": "cap_pad_token"}
# Norm scales stay float32 (the norms run in float32); every other weight takes the compute dtype.
F32_WEIGHTS = tuple(name + ".weight" for name in BLOCK_NORMS.values()) + (CAP_NORM,)


def patch_key(config: DiTConfig) -> str:
    return f"{config.patch_size}-1"


def top_name(name: str, config: DiTConfig) -> str:
    """A TOP_LINEARS name with the config's patch key in it."""
    return name.format(patch=patch_key(config))


def block_parts(key: str) -> tuple[str, ...]:
    """The diffusers names of a block's layer or norm by tree key (a fused layer's several)."""
    return BLOCK_LINEARS[key] if key in BLOCK_LINEARS else (BLOCK_NORMS[key],)


def stack_depth(stack: str, config: DiTConfig) -> int:
    return config.num_layers if stack == "layers" else config.num_refiner_layers


def tensor_shapes(config: DiTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the DiT reads, by diffusers name, with the shape `config` gives it."""
    dim, adaln, hidden = config.dim, config.adaln_dim, config.hidden_dim
    linears = {
        "time_1": (TIME_MID_DIM, config.time_dim),
        "time_2": (adaln, TIME_MID_DIM),
        "cap_in": (dim, config.cap_feat_dim),
        "x_in": (dim, config.patch_channels),
        "final_modulation": (dim, adaln),
        "final": (config.patch_channels, dim),
    }
    shapes: dict[str, tuple[int, ...]] = {}
    for key, shape in linears.items():
        name = top_name(TOP_LINEARS[key], config)
        shapes[name + ".weight"], shapes[name + ".bias"] = shape, shape[:1]
    shapes[CAP_NORM] = (config.cap_feat_dim,)
    for name in PAD_TOKENS.values():
        shapes[name] = (1, dim)
    block = {"qkv": (dim, dim), "out": (dim, dim), "gate_up": (hidden, dim), "down": (dim, hidden)}
    for stack, (prefix, modulated) in STACKS.items():
        for i in range(stack_depth(stack, config)):
            p = prefix.format(i)
            for key, parts in BLOCK_LINEARS.items():
                for name in parts:
                    shapes[p + name + ".weight"] = block[key]
            for key, name in BLOCK_NORMS.items():
                shapes[p + name + ".weight"] = (config.head_dim,) if key in HEAD_NORMS else (dim,)
            if modulated:
                shapes[p + MODULATION + ".weight"] = (4 * dim, adaln)
                shapes[p + MODULATION + ".bias"] = (4 * dim,)
    return shapes
