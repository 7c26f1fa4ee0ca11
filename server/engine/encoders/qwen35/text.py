"""Qwen3.5's language model in MLX (transformers' `Qwen3_5TextModel`), for encoding prompts: a
hybrid decoder whose layers are Gated DeltaNet linear attention, three in four, or gated full
attention, each with a SwiGLU MLP, under zero-centred RMS norms (`x (1 + w)`).

- **Gated DeltaNet** (`GatedDeltaNet`): q, k, v through a causal depthwise convolution (SiLU),
  q and k L2-normalised, a per-head decay `g = -exp(A_log) softplus(a + dt_bias)` and update
  rate `beta = sigmoid(b)`; the state follows the gated delta rule
  `S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T`, `o_t = S_t^T q_t`. It runs
  in the chunked form (`chunked_delta_rule`), as transformers' `torch_chunk_gated_delta_rule`
  does: within a chunk of 64 tokens every update is a few matrix products (the unit lower
  triangular system inverted by repeated squaring, exact for a nilpotent part), and the state
  is carried across chunks. The output is RMS-normed per head and gated by SiLU(z).
- **Gated attention** (`GatedAttention`): the query projection carries a sigmoid output gate
  beside the queries; q and k are RMS-normed per head; RoPE rotates the first
  `partial_rotary_factor` of each head (rotate-half). A prompt alone has one position per
  token on every multimodal axis, so Qwen3.5's multimodal RoPE is plain RoPE here.

Weights load by transformers' names (`model.language_model.` or `model.` or none before
`layers.`); `lm_head` and the vision tower are not read.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
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

CHUNK = 64  # the chunked delta rule's chunk length (transformers' default)
LINEAR, FULL = "linear_attention", "full_attention"
PREFIXES = ("model.language_model.", "language_model.", "model.")


@dataclass(frozen=True)
class TextConfig(DecoderConfig):
    rotary_dim: int
    layer_types: tuple[str, ...]
    conv_kernel: int
    linear_key_heads: int
    linear_value_heads: int
    linear_key_dim: int
    linear_value_dim: int

    @classmethod
    def from_dict(cls, config: dict) -> TextConfig:
        rope = config.get("rope_parameters") or {}
        shared = decoder_settings(config, rope, 10000.0)
        layers = shared["num_layers"]
        interval = config.get("full_attention_interval", 4)
        types = config.get("layer_types") or [
            FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)
        ]
        return cls(
            **shared,
            rotary_dim=int(shared["head_dim"] * rope.get("partial_rotary_factor", 0.25)),
            layer_types=tuple(types[:layers]),
            conv_kernel=config.get("linear_conv_kernel_dim", 4),
            linear_key_heads=config.get("linear_num_key_heads", 16),
            linear_value_heads=config.get("linear_num_value_heads", 32),
            linear_key_dim=config.get("linear_key_head_dim", 128),
            linear_value_dim=config.get("linear_value_head_dim", 128),
        )


class ZeroCenteredRMSNorm(nn.Module):
    """RMS norm with scale 1 + w, in float32."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        normed = mx.fast.rms_norm(x.astype(mx.float32), None, self.eps)
        return (normed * (1.0 + self.weight.astype(mx.float32))).astype(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMS norm (scale w) of the delta rule's output, then gated by SiLU(z), in float32."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        normed = mx.fast.rms_norm(x.astype(mx.float32), None, self.eps).astype(x.dtype)
        return (self.weight * normed).astype(mx.float32) * nn.silu(gate.astype(mx.float32))


class MLP(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        width, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(width, inner, bias=False)
        self.up_proj = nn.Linear(width, inner, bias=False)
        self.down_proj = nn.Linear(inner, width, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class GatedAttention(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.config = config
        width, head = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(width, config.num_heads * head * 2, bias=False)
        self.k_proj = nn.Linear(width, config.num_kv_heads * head, bias=False)
        self.v_proj = nn.Linear(width, config.num_kv_heads * head, bias=False)
        self.o_proj = nn.Linear(config.num_heads * head, width, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(head, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(head, config.rms_norm_eps)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        return self.prefill(x, cos, sin)[0]

    def projected(self, x: mx.array, cos: mx.array, sin: mx.array) -> tuple:
        """(query, key, value, gate): q and k normed and rotated, heads first (B, H, L, D)."""
        batch, length, _ = x.shape
        head = self.config.head_dim
        query_gate = self.q_proj(x).reshape(batch, length, -1, 2 * head)
        query, gate = query_gate[..., :head], query_gate[..., head:]
        gate = gate.reshape(batch, length, -1)
        query = self.q_norm(query).transpose(0, 2, 1, 3)
        key = self.k_norm(self.k_proj(x).reshape(batch, length, -1, head)).transpose(0, 2, 1, 3)
        value = self.v_proj(x).reshape(batch, length, -1, head).transpose(0, 2, 1, 3)
        return rotated(query, cos, sin), rotated(key, cos, sin), value, gate

    def attended(self, query, key, value, gate, causal: bool) -> mx.array:
        batch, _, length, head = query.shape
        out = chunked_attention(query, key, value, head**-0.5, causal=causal)
        out = out.transpose(0, 2, 1, 3).reshape(batch, length, -1)
        return self.o_proj(out * mx.sigmoid(gate))

    def prefill(self, x: mx.array, cos: mx.array, sin: mx.array) -> tuple:
        """The layer over a whole sequence, and its keys and values (the cache of `step`)."""
        query, key, value, gate = self.projected(x, cos, sin)
        return self.attended(query, key, value, gate, causal=True), (key, value)

    def step(self, x: mx.array, cos: mx.array, sin: mx.array, cache: tuple) -> tuple:
        """The layer at one more position (x (B, 1, D), its RoPE tables), over the cached keys
        and values and its own; the cache grown by it."""
        query, key, value, gate = self.projected(x, cos, sin)
        held_keys, held_values = cache
        keys = mx.concatenate([held_keys, key], axis=2)
        values = mx.concatenate([held_values, value], axis=2)
        return self.attended(query, keys, values, gate, causal=False), (keys, values)


def rotated(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate-half RoPE on the first cos.shape[-1] dims of each head; the rest passes."""
    dims = cos.shape[-1]
    return mx.concatenate([apply_rotary(x[..., :dims], cos, sin), x[..., dims:]], axis=-1)


class GatedDeltaNet(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.config = config
        width = config.hidden_size
        self.key_dim = config.linear_key_heads * config.linear_key_dim
        self.value_dim = config.linear_value_heads * config.linear_value_dim
        conv_dim = 2 * self.key_dim + self.value_dim
        # transformers' depthwise Conv1d weight (channels, 1, kernel)
        self.conv1d = {"weight": mx.zeros((conv_dim, 1, config.conv_kernel))}
        # The value heads' order: grouped by key head (transformers': v0 and v1 of k0, then of
        # k1, ...) or tiled (llama.cpp's GGUF files: k0's v0, k1's v0, ..., then each v1).
        self.tiled_heads = False
        self.in_proj_qkv = nn.Linear(width, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(width, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(width, config.linear_value_heads, bias=False)
        self.in_proj_a = nn.Linear(width, config.linear_value_heads, bias=False)
        self.dt_bias = mx.ones((config.linear_value_heads,))
        self.A_log = mx.zeros((config.linear_value_heads,))
        self.norm = GatedRMSNorm(config.linear_value_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, width, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.prefill(x)[0]

    def prefill(self, x: mx.array) -> tuple:
        """The layer over a whole sequence from a zero state, and what `step` carries on from:
        the convolution's last inputs (B, K - 1, C) and the delta rule's state."""
        projected = self.in_proj_qkv(x)
        query, key, value = self.heads(nn.silu(causal_conv(projected, self.conv1d["weight"])))
        decay, beta = self.rates(x)
        out, state = chunked_delta_rule(query, key, value, decay, beta, self.tiled_heads)
        kernel = self.config.conv_kernel
        window = mx.pad(projected, [(0, 0), (max(0, kernel - 1 - x.shape[1]), 0), (0, 0)])
        return self.gated(x, out), (window[:, window.shape[1] - (kernel - 1) :], state)

    def step(self, x: mx.array, cache: tuple) -> tuple:
        """The layer at one more position (x (B, 1, D)): the convolution over its window, one
        step of the delta rule (`delta_rule_step`); the carried inputs and state moved on."""
        inputs, state = cache
        window = mx.concatenate([inputs, self.in_proj_qkv(x)], axis=1)  # (B, K, C)
        taps = self.conv1d["weight"][:, 0, :].T.astype(x.dtype)  # (K, C)
        mixed = nn.silu((window * taps).sum(axis=1, keepdims=True))
        query, key, value = self.heads(mixed)
        decay, beta = self.rates(x)
        out, state = delta_rule_step(query, key, value, decay, beta, state, self.tiled_heads)
        return self.gated(x, out), (window[:, 1:], state)

    def heads(self, mixed: mx.array) -> tuple:
        config = self.config
        batch, length, _ = mixed.shape
        query = mixed[..., : self.key_dim].reshape(batch, length, -1, config.linear_key_dim)
        key = mixed[..., self.key_dim : 2 * self.key_dim].reshape(query.shape)
        value = mixed[..., 2 * self.key_dim :].reshape(batch, length, -1, config.linear_value_dim)
        return query, key, value

    def rates(self, x: mx.array) -> tuple:
        """Per position and value head: the decay g (log) and the update rate beta, float32."""
        beta = mx.sigmoid(self.in_proj_b(x).astype(mx.float32))
        a = self.in_proj_a(x).astype(mx.float32)
        return -mx.exp(self.A_log.astype(mx.float32)) * nn.softplus(a + self.dt_bias), beta

    def gated(self, x: mx.array, out: mx.array) -> mx.array:
        batch, length, _ = x.shape
        z = self.in_proj_z(x).reshape(batch, length, -1, self.config.linear_value_dim)
        gated = self.norm(out.astype(x.dtype), z).astype(x.dtype).reshape(batch, length, -1)
        return self.out_proj(gated)


def causal_conv(x: mx.array, weight: mx.array) -> mx.array:
    """A causal depthwise convolution over the sequence: x (B, L, C), weight (C, 1, K)."""
    kernel = weight.shape[-1]
    padded = mx.pad(x, [(0, 0), (kernel - 1, 0), (0, 0)])
    taps = weight[:, 0, :].T.astype(x.dtype)  # (K, C)
    length = x.shape[1]
    return sum(padded[:, k : k + length] * taps[k] for k in range(kernel))


def l2_normed(x: mx.array, eps: float = 1e-6) -> mx.array:
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


def unit_lower_inverse(lower: mx.array) -> mx.array:
    """(I + L)^-1 for strictly lower triangular L (..., C, C): the product of I + (-L)^(2^k),
    exact since L is nilpotent (L^C = 0)."""
    size = lower.shape[-1]
    eye = mx.eye(size, dtype=lower.dtype)
    power, inverse, span = -lower, eye + -lower, 2
    while span < size:
        power = power @ power
        inverse = inverse @ (eye + power)
        span *= 2
    return inverse


def rule_inputs(query, key, value, decay, beta, tiled: bool = False) -> tuple:
    """The delta rule's inputs heads first in float32: q and k over the value heads they serve
    (consecutive value heads each, or with `tiled` every key_heads-th) and L2-normed (q scaled
    by 1/sqrt(Dk)), (B, H, L, D) and (B, H, L)."""
    key_heads, key_dim = key.shape[-2:]
    value_heads = value.shape[-2]
    if key_heads != value_heads:
        groups = value_heads // key_heads
        if tiled:
            query, key = (mx.tile(t, (1, 1, groups, 1)) for t in (query, key))
        else:
            query, key = (mx.repeat(t, groups, axis=2) for t in (query, key))
    query, key, value = (t.astype(mx.float32).transpose(0, 2, 1, 3) for t in (query, key, value))
    beta, decay = (t.astype(mx.float32).transpose(0, 2, 1) for t in (beta, decay))
    return l2_normed(query) * key_dim**-0.5, l2_normed(key), value, decay, beta


def delta_rule_step(query, key, value, decay, beta, state: mx.array, tiled: bool = False) -> tuple:
    """One position of the gated delta rule (as transformers' recurrent form): q, k (B, 1, Hk,
    Dk), v (B, 1, Hv, Dv), decay and beta (B, 1, Hv), the state (B, Hv, Dk, Dv) float32;
    S <- exp(g) S, then S <- S + k (beta (v - S^T k))^T, o = S^T q. Returns (B, 1, Hv, Dv)."""
    query, key, value, decay, beta = rule_inputs(query, key, value, decay, beta, tiled)
    q, k, v = query[:, :, 0], key[:, :, 0], value[:, :, 0]  # (B, H, D)
    state = state * mx.exp(decay[:, :, 0])[..., None, None]
    remembered = (state * k[..., None]).sum(axis=-2)  # (B, H, Dv)
    delta = (v - remembered) * beta[:, :, 0][..., None]
    state = state + k[..., None] * delta[..., None, :]
    out = (state * q[..., None]).sum(axis=-2)
    return out[:, None], state


def chunked_delta_rule(
    query: mx.array,
    key: mx.array,
    value: mx.array,
    decay: mx.array,
    beta: mx.array,
    tiled: bool = False,
) -> tuple[mx.array, mx.array]:
    """The gated delta rule over a whole sequence, chunked: q, k (B, L, Hk, Dk), v (B, L, Hv,
    Dv), decay and beta (B, L, Hv); returns (B, L, Hv, Dv) float32, from a zero state, and the
    state after the last position (B, Hv, Dk, Dv) (the padding of the last chunk, of rate 0 and
    decay 0, leaves it as it is)."""
    batch, length, _, key_dim = key.shape
    value_heads, value_dim = value.shape[-2:]
    query, key, value, decay, beta = rule_inputs(query, key, value, decay, beta, tiled)
    pad = (-length) % CHUNK
    if pad:
        query, key, value = (
            mx.pad(t, [(0, 0), (0, 0), (0, pad), (0, 0)]) for t in (query, key, value)
        )
        beta, decay = (mx.pad(t, [(0, 0), (0, 0), (0, pad)]) for t in (beta, decay))
    chunks = (length + pad) // CHUNK

    def chunked(t: mx.array) -> mx.array:
        return t.reshape(batch, value_heads, chunks, CHUNK, *t.shape[3:])

    value_beta = chunked(value * beta[..., None])
    key_beta = chunked(key * beta[..., None])
    query, key = chunked(query), chunked(key)
    cumulative = mx.cumsum(chunked(decay), axis=-1)  # (B, H, N, C)
    lower = mx.tril(mx.ones((CHUNK, CHUNK), dtype=mx.bool_))
    gaps = cumulative[..., :, None] - cumulative[..., None, :]
    pairwise = mx.where(lower, mx.exp(mx.where(lower, gaps, 0.0)), 0.0)
    system = (key_beta @ key.swapaxes(-1, -2)) * pairwise
    strictly = mx.tril(mx.ones((CHUNK, CHUNK), dtype=mx.bool_), k=-1)
    inverse = unit_lower_inverse(mx.where(strictly, system, 0.0))
    new_values = inverse @ value_beta
    key_cumulative = inverse @ (key_beta * mx.exp(cumulative)[..., None])
    intra = (query @ key.swapaxes(-1, -2)) * pairwise
    query = query * mx.exp(cumulative)[..., None]
    key = key * mx.exp(cumulative[..., -1:] - cumulative)[..., None]
    chunk_decay = mx.exp(cumulative[..., -1])[..., None, None]
    state = mx.zeros((batch, value_heads, key_dim, value_dim), dtype=mx.float32)
    outputs = []
    for i in range(chunks):
        fresh = new_values[:, :, i] - key_cumulative[:, :, i] @ state
        outputs.append(query[:, :, i] @ state + intra[:, :, i] @ fresh)
        state = state * chunk_decay[:, :, i] + key[:, :, i].swapaxes(-1, -2) @ fresh
    out = mx.concatenate(outputs, axis=2)[:, :, :length]
    return out.transpose(0, 2, 1, 3), state


class DecoderLayer(nn.Module):
    def __init__(self, config: TextConfig, kind: str):
        super().__init__()
        self.kind = kind
        if kind == LINEAR:
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = GatedAttention(config)
        self.mlp = MLP(config)
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        return self.prefill(x, cos, sin)[0]

    def prefill(self, x: mx.array, cos: mx.array, sin: mx.array) -> tuple:
        """The layer over a whole sequence, and its cache for `step`."""
        normed = self.input_layernorm(x)
        if self.kind == LINEAR:
            mixed, cache = self.linear_attn.prefill(normed)
        else:
            mixed, cache = self.self_attn.prefill(normed, cos, sin)
        return self.feed(x + mixed), cache

    def step(self, x: mx.array, cos: mx.array, sin: mx.array, cache: tuple) -> tuple:
        """The layer at one more position, carrying its cache on."""
        normed = self.input_layernorm(x)
        if self.kind == LINEAR:
            mixed, cache = self.linear_attn.step(normed, cache)
        else:
            mixed, cache = self.self_attn.step(normed, cos, sin, cache)
        return self.feed(x + mixed), cache

    def feed(self, x: mx.array) -> mx.array:
        return x + self.mlp(self.post_attention_layernorm(x))


class TextModel(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = [DecoderLayer(config, kind) for kind in config.layer_types]
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def rotary(self, length: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """Plain RoPE tables over the rotated dims for positions 0..length-1."""
        inverse = inverse_frequencies(self.config.rope_theta, self.config.rotary_dim)
        return cos_sin(np.arange(length, dtype=np.float32)[:, None] * inverse[None, :], dtype)

    def hidden_states(self, ids: np.ndarray, taps: Iterable[int]) -> list[mx.array]:
        """The hidden states of one prompt (token ids (L,)) after the layers `taps` names, as
        transformers' `hidden_states` counts them (0: the embeddings; num_layers: after the
        final norm), each (L, hidden)."""
        wanted = sorted(set(taps))
        x = self.embed_tokens(mx.array(np.asarray(ids, np.int32))[None])
        cos, sin = self.rotary(x.shape[1], x.dtype)
        states = {0: x}
        last = max(wanted)
        for index, layer in enumerate(self.layers[: min(last, self.config.num_layers)], 1):
            x = layer(x, cos, sin)
            states[index] = x
        if last == self.config.num_layers:
            states[last] = self.norm(x)
        return [states[t][0] for t in wanted]


def load_text_model(
    component_dir: Path,
    dtype: mx.Dtype = mx.float32,
    quantization: Quantization | None = None,
    gguf: Path | None = None,
) -> tuple[TextModel, int]:
    """Qwen3.5's language model from a transformers folder (its config.json's `text_config`,
    or the config itself for a text-only checkpoint) and the bytes of its weights; the weights
    from the folder's safetensors or from `gguf`, llama.cpp's `qwen35` file (`gguf_files`,
    kept quantized as it holds them). With a `quantization`, its decoder layers' linears and
    token table (`quantized`) are quantized as they load, a folder stored quantized as stored
    (weights.load_module)."""
    model = TextModel(text_config(component_dir))

    def from_folder() -> dict:
        named = {module_name(n): v for n, v in load_weights(component_dir, dtype).items()}
        return {name: value for name, value in named.items() if name is not None}

    from_gguf = None
    if gguf is not None:
        files = gguf_files(model, gguf)
        from_gguf = lambda: gguf_weights(files, dtype)  # noqa: E731
        for layer in model.layers:
            if layer.kind == LINEAR:
                layer.linear_attn.tiled_heads = True
    load_module(model, component_dir, quantization, quantized, from_gguf, from_folder)
    return model, tree_bytes(model.parameters())


def text_config(component_dir: Path) -> TextConfig:
    config = read_config(component_dir)
    return TextConfig.from_dict(config.get("text_config", config))


# llama.cpp's converter (its Qwen3.5 and Qwen3-Next classes) writes these tensors changed:
# the decay's log A_log as A = -exp(A_log), dt_bias as the `dt_proj` bias, the convolution
# squeezed to (channels, kernel), and the zero-centred norms' scales as 1 + w (the delta rule's
# gated norm as it is); it also orders the value heads tiled rather than grouped by key head,
# which the DeltaNet layers then read as such (GatedDeltaNet.tiled_heads).
ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight")
ZERO_CENTRED += ("k_norm.weight",)


def gguf_source_name(name: str) -> str:
    """The transformers name llama.cpp's converter maps a parameter's file tensor from."""
    if name.endswith(".linear_attn.dt_bias"):
        return "model." + name.removesuffix(".dt_bias") + ".dt_proj.bias"
    return "model." + name


def gguf_files(model: TextModel, path: Path) -> ModuleFiles:
    """Qwen3.5's language model in llama.cpp's `qwen35` GGUF file (`token_embd.weight`,
    `blk.N.attn_qkv.weight`, `blk.N.ssm_a`, ...): the module's parameters by the names the gguf
    package's tables give their transformers names, at the shapes the file holds them in (the
    convolution squeezed)."""
    shapes = {name: tuple(value.shape) for name, value in tree_flatten(model.parameters())}
    sources = {gguf_source_name(name): name for name in shapes}
    mapped = llama_cpp_names(MODEL_ARCH.QWEN35, model.config.num_layers, sources)
    unmapped = sorted(set(sources) - set(mapped))
    if unmapped:
        raise ValueError(f"llama.cpp's tables name no tensor for {unmapped[0]}")
    names = {sources[source]: (0, file_name) for source, file_name in mapped.items()}
    for name, shape in shapes.items():
        if name.endswith(".conv1d.weight"):
            shapes[name] = (shape[0], shape[2])
    return ModuleFiles((Path(path),), names, shapes, "Qwen3.5 text encoder")


def gguf_weights(files: ModuleFiles, dtype: mx.Dtype) -> dict:
    """The file's tensors as the module's parameters: the converter's changes undone."""
    weights = files.weights(dtype)
    for name in list(weights):
        value = weights[name]
        if name.endswith(".A_log"):
            weights[name] = mx.log(-value.astype(mx.float32)).astype(value.dtype)
        elif name.endswith(".conv1d.weight"):
            weights[name] = value[:, None, :]
        elif name == "norm.weight" or name.endswith(ZERO_CENTRED):
            weights[name] = (value.astype(mx.float32) - 1.0).astype(value.dtype)
    return weights


def quantized(path: str) -> bool:
    """The layers a quantized load of Qwen3.5 quantizes, by module path: its decoder layers'
    linears (attention, delta rule projections, MLP) and its token table."""
    return path == "embed_tokens" or path.startswith("layers.")


def module_name(name: str) -> str | None:
    """A checkpoint tensor's module name (None: not the language model's)."""
    for prefix in PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    else:
        if not name.startswith(("layers.", "embed_tokens.", "norm.")):
            return None
    if not name.startswith(("layers.", "embed_tokens.", "norm.")):
        return None
    return name


class Qwen35Part:
    """Qwen3.5 as a family's text encoder (its prompt encoder's PART): its weights from
    the folder's safetensors (the language model's alone: the vision tower and the LM head are
    never read) or from llama.cpp's `qwen35` GGUF file (a model entry's `text_encoder`, else the
    folder's one `.gguf`), and what a quantized load quantizes (`quantized`)."""

    quantized = staticmethod(quantized)

    @staticmethod
    def source(component_dir: Path, files: dict) -> Path | None:
        """The GGUF file a load reads its weights from (None: the folder's safetensors)."""
        return gguf_file(component_dir, files.get("text_encoder"))

    @staticmethod
    def gguf(component_dir: Path, files: dict) -> ModuleFiles | None:
        path = gguf_file(component_dir, files.get("text_encoder"))
        if path is None:
            return None
        return gguf_files(TextModel(text_config(component_dir)), path)

    @staticmethod
    def include(name: str) -> bool:
        """Which of the folder's tensors a load reads, by file name."""
        return module_name(name) is not None

    @staticmethod
    def module_name(name: str) -> str | None:
        return module_name(name)
