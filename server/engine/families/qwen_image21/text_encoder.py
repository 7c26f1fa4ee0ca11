"""Qwen-Image 2.1's prompt encoder: Qwen3-VL (language model and vision tower) in MLX.

Only what diffusers' `QwenImage21Pipeline.encode_prompt` uses: the vision tower turns each
reference into merged patch features (plus DeepStack features from some of its blocks), those
replace the `<|image_pad|>` embeddings, the DeepStack features are added to the image rows after
the first decoder layers, and the result is the last decoder layer's output *before* the final
RMSNorm (the pipeline neutralises that norm; the DiT was trained on the un-normalised states).
The system-message rows are dropped; the image-pad rows are cut out into `image_slots`.
Weights load from `text_encoder/` by transformers' names; `lm_head` and the final norm are unused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...nn.activations import hidden_activation
from ...nn.attention import chunked_attention
from ...nn.rope import apply_rotary, cos_sin, inverse_frequencies
from ...weights import load_weights, read_config
from .images import (  # reference_size is re-exported for the family
    ReferenceImage,
    VisionPreprocessor,
    prepare_reference,
    reference_size,
)
from .tokenizer import QwenPromptTokenizer

__all__ = [
    "PromptEncoding",
    "QwenImage21PromptEncoder",
    "reference_size",
]

# ----------------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]
    attention_bias: bool

    @classmethod
    def from_dict(cls, config: dict) -> TextConfig:
        # transformers 5 writes rope_parameters; older files carry rope_scaling + rope_theta.
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        heads = config["num_attention_heads"]
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 500000.0))),
            mrope_section=tuple(rope.get("mrope_section", (24, 20, 20))),
            attention_bias=config.get("attention_bias", False),
        )


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_indexes: tuple[int, ...]
    rope_theta: float
    hidden_act: str

    @classmethod
    def from_dict(cls, config: dict) -> VisionConfig:
        rope = config.get("rope_parameters") or {}
        return cls(
            depth=config["depth"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_heads=config["num_heads"],
            in_channels=config.get("in_channels", 3),
            patch_size=config["patch_size"],
            temporal_patch_size=config.get("temporal_patch_size", 2),
            merge_size=config.get("spatial_merge_size", 2),
            out_hidden_size=config["out_hidden_size"],
            num_position_embeddings=config["num_position_embeddings"],
            deepstack_indexes=tuple(config.get("deepstack_visual_indexes", ())),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            hidden_act=config.get("hidden_act", "gelu_pytorch_tanh"),
        )


# -------------------------------------------------------------------------------- text model


class TextAttention(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        width, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(width, config.num_heads * config.head_dim, bias=bias)
        self.k_proj = nn.Linear(width, config.num_kv_heads * config.head_dim, bias=bias)
        self.v_proj = nn.Linear(width, config.num_kv_heads * config.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, width, bias=bias)
        self.q_norm = nn.RMSNorm(config.head_dim, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(config.head_dim, eps=config.rms_norm_eps)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        batch, length, _ = x.shape
        shape = (batch, length, -1, self.head_dim)
        # Qwen3 norms each head's queries and keys before the rotary embedding.
        q = self.q_norm(self.q_proj(x).reshape(shape)).transpose(0, 2, 1, 3)
        k = self.k_norm(self.k_proj(x).reshape(shape)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(shape).transpose(0, 2, 1, 3)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = chunked_attention(q, k, v, self.scale, causal=True)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))


class TextMLP(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class TextDecoderLayer(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.self_attn = TextAttention(config)
        self.mlp = TextMLP(config)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class TextModel(nn.Module):
    """Qwen3-VL's language model up to (not including) its final norm."""

    def __init__(self, config: TextConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = [TextDecoderLayer(config) for _ in range(config.num_layers)]
        self._inv_freq = inverse_frequencies(config.rope_theta, config.head_dim)

    def rotary(self, positions: np.ndarray, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """Interleaved multimodal RoPE for positions (3, L) = (t, h, w) rows: frequency j follows
        h when j % 3 == 1 and j < 3 * sections[1], w when j % 3 == 2 and j < 3 * sections[2],
        else t."""
        angles = positions.astype(np.float32)[:, :, None] * self._inv_freq  # (3, L, D/2)
        axis = np.zeros(self._inv_freq.shape[0], dtype=np.int64)
        index = np.arange(axis.shape[0])
        sections = self.config.mrope_section
        axis[(index % 3 == 1) & (index < 3 * sections[1])] = 1
        axis[(index % 3 == 2) & (index < 3 * sections[2])] = 2
        mixed = angles[axis[None, :], np.arange(angles.shape[1])[:, None], index[None, :]]
        return cos_sin(mixed, dtype)

    def __call__(
        self,
        embeds: mx.array,
        positions: np.ndarray,
        deepstack: list[mx.array],
        image_rows: mx.array | None,
    ) -> mx.array:
        """embeds (1, L, D) -> hidden states after the last layer, before the final norm.
        deepstack[k] (n_image_rows, D) is added to the image rows after layer k."""
        cos, sin = self.rotary(positions, embeds.dtype)
        hidden = embeds
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden, cos, sin)
            if index < len(deepstack):
                hidden = hidden.at[:, image_rows].add(deepstack[index][None].astype(hidden.dtype))
        return hidden


# ------------------------------------------------------------------------------ vision tower


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        length = x.shape[0]
        qkv = self.qkv(x).reshape(length, 3, self.num_heads, self.head_dim).transpose(1, 2, 0, 3)
        q, k, v = qkv[0], qkv[1], qkv[2]  # (heads, N, head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = chunked_attention(q[None], k[None], v[None], self.head_dim**-0.5, causal=False)
        return self.proj(out[0].transpose(1, 0, 2).reshape(length, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.act = hidden_activation(config.hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each 2x2 block of patches -> one language-model row. The final merger norms each patch
    before joining them; the DeepStack mergers norm the joined block."""

    def __init__(self, config: VisionConfig, norm_after_join: bool):
        super().__init__()
        self.joined = config.hidden_size * config.merge_size**2
        self.norm_after_join = norm_after_join
        self.norm = nn.LayerNorm(self.joined if norm_after_join else config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.joined, self.joined, bias=True)
        self.linear_fc2 = nn.Linear(self.joined, config.out_hidden_size, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        if self.norm_after_join:
            x = self.norm(x.reshape(-1, self.joined))
        else:
            x = self.norm(x).reshape(-1, self.joined)
        return self.linear_fc2(nn.gelu(self.linear_fc1(x)))


class PatchEmbed(nn.Module):
    """The Conv3d whose kernel equals its stride is a linear map of each flattened patch."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        patch_width = (
            config.in_channels * config.temporal_patch_size * config.patch_size * config.patch_size
        )
        self.proj = nn.Linear(patch_width, config.hidden_size, bias=True)

    def __call__(self, pixel_values: mx.array) -> mx.array:
        return self.proj(pixel_values)


@dataclass
class VisionFeatures:
    merged: mx.array  # (rows, out_hidden)
    deepstack: list[mx.array] = field(default_factory=list)  # each (rows, out_hidden)


class VisionModel(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = [VisionBlock(config) for _ in range(config.depth)]
        self.merger = PatchMerger(config, norm_after_join=False)
        self.deepstack_merger_list = [
            PatchMerger(config, norm_after_join=True) for _ in config.deepstack_indexes
        ]
        self._grid_side = int(config.num_position_embeddings**0.5)
        head_dim = config.hidden_size // config.num_heads
        self._inv_freq = inverse_frequencies(config.rope_theta, head_dim // 2)

    def patch_coordinates(self, grid_h: int, grid_w: int) -> tuple[np.ndarray, np.ndarray]:
        """Row and column of each patch in the processor's merge-block order."""
        m = self.config.merge_size
        rows, cols = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij")
        block = (grid_h // m, m, grid_w // m, m)
        return (
            rows.reshape(block).transpose(0, 2, 1, 3).reshape(-1),
            cols.reshape(block).transpose(0, 2, 1, 3).reshape(-1),
        )

    def position_embedding(self, rows: np.ndarray, cols: np.ndarray, grid_h: int, grid_w: int):
        """The learned square position table resampled bilinearly (align_corners) to the grid."""
        side = self._grid_side

        def taps(index: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
            src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
            floor = np.floor(src)
            raw = floor.astype(np.int64)[:, None] + np.arange(2)
            distance = np.abs(src[:, None] - floor[:, None] - np.arange(2, dtype=np.float32))
            return raw.clip(0, side - 1), np.clip(1 - distance, 0, None).astype(np.float32)

        h_taps, h_weights = taps(rows, grid_h)
        w_taps, w_weights = taps(cols, grid_w)
        indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
        weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
        table = self.pos_embed.weight[mx.array(indices)]  # (N, 4, hidden)
        return (table * mx.array(weights)[:, :, None].astype(table.dtype)).sum(axis=1)

    def rotary(self, rows: np.ndarray, cols: np.ndarray, dtype: mx.Dtype):
        """2D RoPE: the same frequencies over rows then columns, repeated to the head width."""
        angles = np.concatenate(
            [
                rows.astype(np.float32)[:, None] * self._inv_freq,
                cols.astype(np.float32)[:, None] * self._inv_freq,
            ],
            axis=-1,
        )
        return cos_sin(angles, dtype)

    def __call__(self, pixel_values: mx.array, grid_thw: tuple[int, int, int]) -> VisionFeatures:
        """One image's patches (N, C*T*P*P) -> its merged rows and DeepStack features."""
        grid_t, grid_h, grid_w = grid_thw
        if grid_t != 1:
            raise ValueError("only still images (one temporal patch) are encoded")
        rows, cols = self.patch_coordinates(grid_h, grid_w)
        dtype = self.patch_embed.proj.weight.dtype
        hidden = self.patch_embed(pixel_values.astype(dtype))
        hidden = hidden + self.position_embedding(rows, cols, grid_h, grid_w).astype(dtype)
        cos, sin = self.rotary(rows, cols, dtype)
        deepstack = []
        for index, block in enumerate(self.blocks):
            hidden = block(hidden, cos, sin)
            if index in self.config.deepstack_indexes:
                merger = self.deepstack_merger_list[self.config.deepstack_indexes.index(index)]
                deepstack.append(merger(hidden))
        return VisionFeatures(self.merger(hidden), deepstack)


# ------------------------------------------------------------------------------- the encoder


class Qwen3VLEncoder(nn.Module):
    """The parts of `Qwen3VLForConditionalGeneration` the encode path runs."""

    def __init__(self, text: TextConfig, vision: VisionConfig):
        super().__init__()
        self.language_model = TextModel(text)
        self.visual = VisionModel(vision)


_PREFIXES = (
    ("model.language_model.", "language_model."),
    ("model.visual.", "visual."),
    # Older Qwen-VL layouts.
    ("language_model.model.", "language_model."),
    ("visual.", "visual."),
    ("model.", "language_model."),
)
_UNUSED = ("lm_head.", "language_model.norm.")


def encoder_weight_names(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Checkpoint names -> module names; unused tensors dropped; the Conv3d patch kernel flattened."""
    renamed: dict[str, mx.array] = {}
    for name, value in weights.items():
        for prefix, target in _PREFIXES:
            if name.startswith(prefix):
                name = target + name[len(prefix) :]
                break
        if name.startswith(_UNUSED):
            continue
        if name == "visual.patch_embed.proj.weight":
            value = value.reshape(value.shape[0], -1)
        renamed[name] = value
    return renamed


@dataclass
class PromptEncoding:
    cond: np.ndarray  # (1, L, D) float32, text rows only
    image_slots: list[int]  # per image, the text row before which its pad rows stood
    vae_images: list[np.ndarray]  # each (H, W, 4) float32 in [0, 1]
    token_ids: np.ndarray | None = None  # (L_all,) the ids after the dropped system prefix


class QwenImage21PromptEncoder:
    def __init__(
        self,
        encoder: Qwen3VLEncoder,
        tokenizer: QwenPromptTokenizer,
        preprocessor: VisionPreprocessor,
        weight_bytes: int,
    ):
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.preprocessor = preprocessor
        self.weight_bytes = weight_bytes
        self.hidden_size = encoder.language_model.config.hidden_size
        self.merge_size = encoder.visual.config.merge_size

    @classmethod
    def load(cls, model_dir: Path, dtype: mx.Dtype = mx.float32) -> QwenImage21PromptEncoder:
        model_dir = Path(model_dir)
        config = read_config(model_dir / "text_encoder")
        text = TextConfig.from_dict(config["text_config"])
        vision = VisionConfig.from_dict(config["vision_config"])
        encoder = Qwen3VLEncoder(text, vision)
        weights = encoder_weight_names(load_weights(model_dir / "text_encoder", dtype))
        encoder.load_weights(list(weights.items()), strict=True)
        mx.eval(encoder.parameters())
        weight_bytes = sum(value.nbytes for value in weights.values())
        tokenizer = QwenPromptTokenizer.load(model_dir / "processor")
        if tokenizer.image_pad_id != config.get("image_token_id", tokenizer.image_pad_id):
            raise ValueError("the tokenizer's <|image_pad|> id differs from the text encoder's")
        preprocessor = VisionPreprocessor.load(model_dir / "processor")
        return cls(encoder, tokenizer, preprocessor, weight_bytes)

    def prepare_images(self, images: list[np.ndarray]) -> list[ReferenceImage]:
        return [prepare_reference(image, self.preprocessor) for image in images]

    def encode(self, text: str, images: list[np.ndarray]) -> PromptEncoding:
        references = self.prepare_images(images)
        return self.encode_prepared(text, references)

    def encode_prepared(self, text: str, references: list[ReferenceImage]) -> PromptEncoding:
        prompt = self.tokenizer.encode(text, [ref.slot_count for ref in references])
        hidden = self.hidden_states(prompt.ids, prompt.image_spans, references)
        keep = self.tokenizer.drop_index
        is_image = np.zeros(prompt.ids.shape[0], dtype=bool)
        for start, end in prompt.image_spans:
            is_image[start:end] = True
        text_rows = np.flatnonzero(~is_image[keep:]) + keep
        # Text rows (after the dropped prefix) that precede each image's first pad row.
        slots = [int(np.count_nonzero(~is_image[keep:start])) for start, _ in prompt.image_spans]
        cond = hidden[mx.array(text_rows)].astype(mx.float32)
        return PromptEncoding(
            cond=np.asarray(cond)[None],
            image_slots=slots,
            vae_images=[ref.vae_image for ref in references],
            token_ids=prompt.ids[keep:],
        )

    def hidden_states(
        self,
        ids: np.ndarray,
        spans: list[tuple[int, int]],
        references: list[ReferenceImage],
    ) -> mx.array:
        """(L, D) last-layer states before the final norm, for the expanded ids."""
        language, visual = self.encoder.language_model, self.encoder.visual
        embeds = language.embed_tokens(mx.array(ids))
        deepstack: list[mx.array] = []
        image_rows = None
        if references:
            features = [visual(mx.array(ref.pixel_values), ref.grid_thw) for ref in references]
            image_rows = mx.array(np.concatenate([np.arange(s, e) for s, e in spans]))
            merged = mx.concatenate([f.merged for f in features]).astype(embeds.dtype)
            embeds[image_rows] = merged
            deepstack = [
                mx.concatenate([f.deepstack[k] for f in features])
                for k in range(len(visual.config.deepstack_indexes))
            ]
        positions = self.positions(ids.shape[0], spans, references)
        hidden = language(embeds[None], positions, deepstack, image_rows)[0]
        mx.eval(hidden)
        return hidden

    def positions(
        self, length: int, spans: list[tuple[int, int]], references: list[ReferenceImage]
    ) -> np.ndarray:
        """Multimodal RoPE positions (3, L) as Qwen3-VL's `get_rope_index` gives them: text runs
        count up on all three axes; an image's rows take (t, h, w) grid positions offset by the
        running position, which then advances by the larger merged grid side."""
        positions = np.zeros((3, length), dtype=np.int64)
        current, cursor = 0, 0
        for (start, end), ref in zip(spans, references, strict=True):
            run = start - cursor
            positions[:, cursor:start] = np.arange(run) + current
            current += run
            _, grid_h, grid_w = ref.grid_thw
            merged_h, merged_w = grid_h // self.merge_size, grid_w // self.merge_size
            h, w = np.meshgrid(np.arange(merged_h), np.arange(merged_w), indexing="ij")
            positions[0, start:end] = current
            positions[1, start:end] = h.reshape(-1) + current
            positions[2, start:end] = w.reshape(-1) + current
            current += max(merged_h, merged_w)
            cursor = end
        positions[:, cursor:] = np.arange(length - cursor) + current
        return positions
