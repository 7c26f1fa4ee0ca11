"""MOSS-Image's DiT as data, without MLX: its config (`DiTConfig`), the file names of its
weights by tree key, the norm scales kept in float32 and `tensor_shapes`, which the network
(dit.py), the single-file checks and the embedded recipe read; so `gmlx list` names the embedded
MOSS-Image in a Python without MLX.

The names are the upstream `MOSSImageTransformer`'s state-dict keys (its diffusers custom
pipeline's transformer/ folder), which the published LoRA files name too.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...config_keys import HeadsOfDim, read_settings, setting

TEXT_BLOCKS = 2  # the text projection's own blocks (fixed in the upstream network)
NORM_EPS = 1e-6
TIME_MAX_PERIOD = 10000.0  # the sinusoid's frequencies: 10000^(-i / half)


@dataclass(frozen=True)
class DiTConfig(HeadsOfDim):
    """MOSSImageTransformer's config (`setting`: its key and default)."""

    dim: int = setting("dim", 3072, int)
    ffn_dim: int = setting("ffn_dim", 8192, int)
    num_heads: int = setting("num_heads", 24, int)
    num_layers: int = setting("num_layers", 42, int)
    text_dim: int = setting("text_dim", 4096, int)
    freq_dim: int = setting("freq_dim", 256, int)
    latent_channels: int = setting("latent_channels", 128, int)
    rope_base: float = setting("rope_base", 10000.0, float)

    @property
    def cond_width(self) -> int:
        """A row's conditioning width (the wire's D): the text encoder's last hidden state."""
        return self.text_dim

    @classmethod
    def from_dict(cls, config: dict) -> DiTConfig:
        made = read_settings(cls, config)
        if made.dim % made.num_heads:
            raise ValueError(f"dim {made.dim} is no multiple of num_heads {made.num_heads}")
        if made.head_dim % 8:
            # four RoPE axes, each rotating head_dim / 8 frequency pairs
            raise ValueError(f"the head width {made.head_dim} is no multiple of 8")
        if made.freq_dim % 2:
            raise ValueError(f"freq_dim {made.freq_dim} must be even")
        return made

    @property
    def mlp_dim(self) -> int:
        """The feed-forward's width (the joint-token memory plan's name for it)."""
        return self.ffn_dim


# ---------------------------------------------------------------------------------------------
# Weights: the file names mapped to the forward's tree, in one place

STACKS = {"text_blocks": "text_embedder.blocks.{}.", "blocks": "layers.{}."}
# A block's linear layers by file name, grouped into the fused weights the forward uses (the
# SITU feed-forward's up half first, then its gate, as one matmul).
TEXT_BLOCK_LINEARS = {
    "qkv": ("qkv",),
    "out": ("proj",),
    "up_gate": ("ffn_up", "ffn_gate"),
    "down": ("ffn_down",),
}
BLOCK_LINEARS = {
    "qkv": ("proj.q", "proj.k", "proj.v"),
    "out": ("proj.o",),
    "up_gate": ("proj.ffn_up_gate",),
    "down": ("proj.ffn_down",),
}
BLOCK_NORMS = {"norm_q": "q_norm", "norm_k": "k_norm", "norm1": "norm1", "norm2": "norm2"}
# Linear layers outside the blocks: tree key -> file name; all have biases but `final`.
TOP_LINEARS = {
    "video_in": "video_embedder",
    "text_in": "text_embedder.proj",
    "time_1": "time_embedding.0",
    "time_2": "time_embedding.2",
    "modulation": "shared_block_modulation",
    "head_modulation": "video_head_modulation",
    "final": "final_linear_video",
}
UNBIASED = ("final",)
FINAL_NORM = "final_norm_video.weight"
# The RMS norms' scales stay float32 (they are applied in float32).
F32_WEIGHTS = tuple(f"{name}.weight" for name in BLOCK_NORMS.values()) + (FINAL_NORM,)


def stack_linears(stack: str) -> dict[str, tuple[str, ...]]:
    return TEXT_BLOCK_LINEARS if stack == "text_blocks" else BLOCK_LINEARS


def stack_depth(stack: str, config: DiTConfig) -> int:
    return TEXT_BLOCKS if stack == "text_blocks" else config.num_layers


def tensor_shapes(config: DiTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the DiT reads, by file name, with the shape `config` gives it."""
    dim, ffn = config.dim, config.ffn_dim
    linears = {
        "video_in": (dim, config.latent_channels),
        "text_in": (dim, config.text_dim),
        "time_1": (dim, config.freq_dim),
        "time_2": (dim, dim),
        "modulation": (6 * dim, dim),
        "head_modulation": (2 * dim, dim),
        "final": (config.latent_channels, dim),
    }
    shapes: dict[str, tuple[int, ...]] = {FINAL_NORM: (dim,)}
    for key, shape in linears.items():
        name = TOP_LINEARS[key]
        shapes[name + ".weight"] = shape
        if key not in UNBIASED:
            shapes[name + ".bias"] = shape[:1]
    text_block = {"qkv": (3 * dim, dim), "proj": (dim, dim), "ffn_up": (ffn, dim)}
    text_block |= {"ffn_gate": (ffn, dim), "ffn_down": (dim, ffn)}
    block = {f"proj.{n}": (dim, dim) for n in "qkvo"}
    block |= {"proj.ffn_up_gate": (2 * ffn, dim), "proj.ffn_down": (dim, ffn)}
    for stack, prefix in STACKS.items():
        text = stack == "text_blocks"
        for i in range(stack_depth(stack, config)):
            p = prefix.format(i)
            for name, shape in (text_block if text else block).items():
                shapes[p + name + ".weight"] = shape
                if text:
                    shapes[p + name + ".bias"] = shape[:1]
            shapes[p + "q_norm.weight"] = shapes[p + "k_norm.weight"] = (config.head_dim,)
            shapes[p + "norm1.weight"] = shapes[p + "norm2.weight"] = (dim,)
    return shapes
