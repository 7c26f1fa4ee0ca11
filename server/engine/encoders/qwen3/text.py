"""Qwen3's decoder in MLX, by transformers' names: the text encoder of the families that
prompt with Qwen3 (alone: `Qwen3TextEncoder`, plain RoPE over positions 0..L-1; or inside
Qwen3-VL: see vl.py). A family says which layers it reads (`taps`); the final norm and `lm_head`
are never run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from gguf import MODEL_ARCH
from mlx.utils import tree_flatten

from ...module_files import ModuleFiles, llama_cpp_names
from ...nn.attention import chunked_attention
from ...nn.dtypes import tree_bytes
from ...nn.rope import apply_rotary, cos_sin, inverse_frequencies
from ...precision import Quantization
from ...weights import gguf_file, load_module, load_weights, read_config
from ..config import DecoderConfig, decoder_settings
from ..prompt import PromptEncoder
from .tokenizer import PromptTemplate, QwenPromptTokenizer


@dataclass(frozen=True)
class TextConfig(DecoderConfig):
    mrope_section: tuple[int, int, int]
    attention_bias: bool

    @classmethod
    def from_dict(cls, config: dict) -> TextConfig:
        # transformers 5 writes rope_parameters; older files carry rope_scaling + rope_theta.
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        return cls(
            **decoder_settings(config, rope, 500000.0),
            mrope_section=tuple(rope.get("mrope_section", (24, 20, 20))),
            attention_bias=config.get("attention_bias", False),
        )


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

    def __call__(
        self, x: mx.array, cos: mx.array, sin: mx.array, valid_keys: int | None = None
    ) -> mx.array:
        batch, length, _ = x.shape
        shape = (batch, length, -1, self.head_dim)
        # Qwen3 norms each head's queries and keys before the rotary embedding.
        q = self.q_norm(self.q_proj(x).reshape(shape)).transpose(0, 2, 1, 3)
        k = self.k_norm(self.k_proj(x).reshape(shape)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(shape).transpose(0, 2, 1, 3)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = chunked_attention(q, k, v, self.scale, causal=True, valid_keys=valid_keys)
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

    def __call__(
        self, x: mx.array, cos: mx.array, sin: mx.array, valid_keys: int | None = None
    ) -> mx.array:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, valid_keys)
        return x + self.mlp(self.post_attention_layernorm(x))


class TextModel(nn.Module):
    """Qwen3's decoder (the language model of Qwen3 and of Qwen3-VL) up to, not including, its
    final norm: the families read hidden states before it. Positions come in as the rotary
    tables (`cos`, `sin`) the caller's position scheme gives, from `inv_freq`."""

    def __init__(self, config: TextConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = [TextDecoderLayer(config) for _ in range(config.num_layers)]
        self.inv_freq = inverse_frequencies(config.rope_theta, config.head_dim)

    def __call__(
        self,
        embeds: mx.array,
        cos: mx.array,
        sin: mx.array,
        taps: tuple[int, ...] = (-1,),
        after_layer: Callable[[int, mx.array], mx.array] | None = None,
        valid_keys: int | None = None,
    ) -> list[mx.array]:
        """embeds (1, L, D) -> the hidden states after each layer `taps` names (an index into
        the layers; -1 is the last), before the final norm. `after_layer(index, hidden)`, when
        given, runs after every layer (Qwen3-VL adds its DeepStack features there).
        `valid_keys`: the tokens from that index on are right padding, attended by none."""
        wanted = {tap % len(self.layers) for tap in taps}
        hidden, tapped = embeds, {}
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden, cos, sin, valid_keys)
            if after_layer is not None:
                hidden = after_layer(index, hidden)
            if index in wanted:
                tapped[index] = hidden
            if len(tapped) == len(wanted):
                break
        return [tapped[tap % len(self.layers)] for tap in taps]


# Checkpoint prefixes of Qwen3's decoder: Qwen3ForCausalLM's ("model.") and Qwen3Model's (none).
_DECODER_PREFIX = "model."
_UNUSED = ("lm_head.", "norm.")
_LAYERS = "layers."


def gguf_files(model: TextModel, path: Path) -> ModuleFiles:
    """Qwen3's decoder in a llama.cpp GGUF file (`token_embd.weight`, `blk.N.attn_q.weight`
    ...): the module's parameters by the names llama.cpp's converter gives their transformers
    names (module_files.llama_cpp_names). The converter maps Qwen3's tensors by name alone: no q/k
    permutation (Qwen3's rotary halves are llama.cpp's NEOX order) and no norm offset."""
    shapes = {name: tuple(value.shape) for name, value in tree_flatten(model.parameters())}
    hf_names = {_DECODER_PREFIX + name: name for name in shapes}
    mapped = llama_cpp_names(MODEL_ARCH.QWEN3, model.config.num_layers, hf_names)
    unmapped = sorted(set(hf_names) - set(mapped))
    if unmapped:
        raise ValueError(f"llama.cpp's tables name no tensor for {unmapped[0]}")
    names = {hf_names[hf]: (0, file_name) for hf, file_name in mapped.items()}
    return ModuleFiles((Path(path),), names, shapes, "Qwen3 text encoder")


def module_name(name: str, layers: int | None = None) -> str | None:
    """A checkpoint name as TextModel's parameter name; None for a tensor the encoder does not
    use (lm_head, the final norm, and with `layers` every decoder layer from that index on)."""
    name = name.removeprefix(_DECODER_PREFIX)
    if name.startswith(_UNUSED):
        return None
    if layers is not None and name.startswith(_LAYERS):
        index = int(name[len(_LAYERS) :].split(".", 1)[0])
        return None if index >= layers else name
    return name


def quantized(path: str) -> bool:
    """The layers a quantized load of Qwen3 alone quantizes, by module path (the choice of the
    families prompting with it): the linear layers of its decoder layers and the token table
    (151,936 rows at Qwen3-4B's width 2560)."""
    return path == "embed_tokens" or path.startswith(_LAYERS)


def encoder_config(component_dir: Path, layers: int | None = None) -> TextConfig:
    """The config of a Qwen3 folder (text_encoder/config.json); with `layers`, its first
    `layers` decoder layers alone (a family that reads no later one: a ValueError when the
    folder has fewer)."""
    config = TextConfig.from_dict(read_config(component_dir))
    if layers is None:
        return config
    if config.num_layers < layers:
        raise ValueError(
            f"{component_dir} has {config.num_layers} decoder layers; the family reads the"
            f" first {layers}"
        )
    return replace(config, num_layers=layers)


def component_gguf(
    component_dir: Path, text_encoder: Path | None = None, layers: int | None = None
) -> ModuleFiles | None:
    """The text encoder's GGUF file (a model entry's `text_encoder`, else the one `.gguf` in
    the folder) as Qwen3 reads it (`gguf_files`: its first `layers` decoder layers, None: all);
    None for the folder's safetensors."""
    path = gguf_file(component_dir, text_encoder)
    if path is None:
        return None
    return gguf_files(TextModel(encoder_config(component_dir, layers)), path)


@dataclass(frozen=True)
class Qwen3Part:
    """Qwen3 as a family's text encoder (a Qwen3Prompt's PART): its GGUF file, the
    file tensors a load reads, and what a quantized load quantizes. `layers`: the first
    `layers` decoder layers alone load (None: all)."""

    layers: int | None = None

    def gguf(self, component_dir: Path, files: dict) -> ModuleFiles | None:
        """The entry's `text_encoder` GGUF file (else the folder's one .gguf), or None."""
        return component_gguf(component_dir, files.get("text_encoder"), self.layers)

    @staticmethod
    def source(component_dir: Path, files: dict) -> Path | None:
        """The GGUF file a load reads its weights from (None: the folder's safetensors)."""
        return gguf_file(component_dir, files.get("text_encoder"))

    @property
    def include(self) -> Callable[[str], bool] | None:
        """Which of the folder's tensors a load reads, by file name (None: every one)."""
        if self.layers is None:
            return None
        return lambda name: module_name(name, self.layers) is not None

    @staticmethod
    def module_name(name: str) -> str | None:
        """A file name as its module path (every layer: a quantized folder stays whole)."""
        return module_name(name)

    quantized = staticmethod(quantized)


class Qwen3Prompt(PromptEncoder):
    """A family's prompt encoder over Qwen3 alone: the family's `TEMPLATE` tokenized by the
    folder's tokenizer/, through Qwen3TextEncoder (the first `PART.layers` decoder layers;
    None: all; a GGUF file is llama.cpp's of Qwen3, text_encoder/config.json still describing
    it; a quantized load quantizes Qwen3's choice, `quantized`). A subclass sets the two and
    says how it encodes (`encode`); one that needs more of the folder builds itself in `of`."""

    TEMPLATE: PromptTemplate
    PART = Qwen3Part()

    def __init__(self, encoder: Qwen3TextEncoder, tokenizer: QwenPromptTokenizer, dtype: mx.Dtype):
        """`dtype`: the dtype it computes in, the one it loaded at (its weights may be held
        quantized, a GGUF file's token table too)."""
        super().__init__(encoder, tokenizer, encoder.weight_bytes, encoder.hidden_size, dtype)

    @property
    def network(self) -> nn.Module:
        return self.encoder.model

    @classmethod
    def from_folder(cls, model_dir: Path, dtype: mx.Dtype, quantization, gguf):
        folder = model_dir / "text_encoder"
        layers = cls.PART.layers
        encoder = Qwen3TextEncoder.load(folder, dtype, quantization, gguf, layers)
        tokenizer = QwenPromptTokenizer.load(model_dir / "tokenizer", cls.TEMPLATE)
        return cls.of(model_dir, encoder, tokenizer, dtype)

    @classmethod
    def of(cls, model_dir: Path, encoder, tokenizer, dtype: mx.Dtype):
        return cls(encoder, tokenizer, dtype)


class Qwen3TextEncoder:
    """Qwen3 alone (a transformers `Qwen3Model` or `Qwen3ForCausalLM` folder) as a prompt
    encoder: token ids -> the hidden states of the tapped layers, positions 0..L-1."""

    def __init__(self, model: TextModel, weight_bytes: int):
        self.model = model
        self.weight_bytes = weight_bytes

    @classmethod
    def load(
        cls,
        component_dir: Path,
        dtype: mx.Dtype = mx.float32,
        quantization: Quantization | None = None,
        gguf: Path | None = None,
        layers: int | None = None,
    ) -> Qwen3TextEncoder:
        """The encoder of a transformers folder (its config.json), its weights from the
        folder's safetensors or from `gguf`, a llama.cpp GGUF file of Qwen3 (`gguf_files`),
        kept quantized as the file holds them. With a `quantization`, the float linear layers
        Qwen3's choice picks (`quantized`) are quantized as they load
        (quantize.quantize_module); a folder stored quantized loads as stored. With `layers`,
        only the first `layers` decoder layers load (`encoder_config`): a family that taps no
        later layer never reads the rest."""
        model = TextModel(encoder_config(component_dir, layers))

        def from_folder() -> dict:
            named = {
                module_name(n, layers): v for n, v in load_weights(component_dir, dtype).items()
            }
            return {name: value for name, value in named.items() if name is not None}

        from_gguf = None if gguf is None else lambda: gguf_files(model, gguf).weights(dtype)
        load_module(model, component_dir, quantization, quantized, from_gguf, from_folder)
        return cls(model, tree_bytes(model.parameters()))

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    def rotary(self, length: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """Plain RoPE tables for positions 0..length-1 (transformers' Qwen3RotaryEmbedding)."""
        angles = np.arange(length, dtype=np.float32)[:, None] * self.model.inv_freq[None, :]
        return cos_sin(angles, dtype)

    def hidden_states(
        self, ids: np.ndarray, taps: tuple[int, ...] = (-1,), valid_keys: int | None = None
    ) -> list[mx.array]:
        """(L, D) states after the decoder layers `taps` names (before the final norm). With
        `valid_keys` the ids from that index on are right padding: every row of a padded
        prompt, the padding's rows too, as transformers computes them under its attention
        mask (positions still 0..L-1)."""
        embeds = self.model.embed_tokens(mx.array(np.asarray(ids, np.int32)))
        cos, sin = self.rotary(embeds.shape[0], embeds.dtype)
        hiddens = self.model(embeds[None], cos, sin, taps, valid_keys=valid_keys)
        tapped = [hidden[0] for hidden in hiddens]
        mx.eval(tapped)
        return tapped
