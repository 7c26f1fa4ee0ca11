"""Qwen3.5 as a chat model: its language model (text.py) and LM head generating greedily, one
token at a time over cached layers (transformers' `generate(do_sample=False)` on a causal
Qwen3.5 checkpoint). A prompt upsampler is one: the request in, a longer prompt out.

The prompt runs once through every layer (`prefill`), which leaves each layer's cache: the
gated attention layers' keys and values, the Gated DeltaNet layers' last convolution inputs and
their delta rule state. Each new token then runs through the layers at its position alone
(`step`), so a token costs the same at the 3,000th as at the first for the DeltaNet layers, and
a pass over the cached keys for the attention layers.

The chat template is the checkpoint's own (`chat_template.jinja`, or the `chat_template` of
tokenizer_config.json), rendered with jinja2 as transformers renders it; the tokens with the
folder's tokenizer.json. Weights load by transformers' names (`model.language_model.` or
`model.` before the language model, `lm_head.weight`, or the token table where the head is tied).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from tokenizers import Tokenizer

from ...base import EngineInputError
from ...nn.dtypes import tree_bytes
from ...nn.rope import cos_sin, inverse_frequencies
from ...precision import Quantization
from ...weights import load_module, load_weights, read_config
from ..qwen3.tokenizer import read_tokenizer
from .text import TextConfig, TextModel, module_name

HEAD = "lm_head.weight"
TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"


class ChatModelError(EngineInputError):
    """A chat model folder that cannot be used, saying which file and why (400)."""


class ChatNetwork(nn.Module):
    """The language model and its head (tied to the token table where the checkpoint says so)."""

    def __init__(self, config: TextConfig, tied: bool):
        super().__init__()
        self.model = TextModel(config)
        if not tied:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def logits(self, hidden: mx.array) -> mx.array:
        if "lm_head" in self:
            return self.lm_head(hidden)
        return self.model.embed_tokens.as_linear(hidden)


@dataclass
class Generated:
    ids: list[int]  # the new tokens, the stop token left out
    stopped: bool  # a stop token ended it (else the token limit did)


class ChatModel:
    """A Qwen3.5 chat checkpoint's network, tokenizer, chat template and stop tokens."""

    def __init__(
        self,
        network: ChatNetwork,
        tokenizer: Tokenizer,
        template: str,
        stop_ids: frozenset[int],
        weight_bytes: int,
    ):
        self.network = network
        self.tokenizer = tokenizer
        self.template = template
        self.stop_ids = stop_ids
        self.weight_bytes = weight_bytes

    @classmethod
    def load(
        cls, folder: Path, dtype: mx.Dtype = mx.float32, quantization: Quantization | None = None
    ) -> ChatModel:
        """The chat model of a transformers folder (config.json, its safetensors, tokenizer.json,
        its chat template); with a `quantization`, its decoder layers' linears, the token table
        and the head quantized as they load."""
        folder = Path(folder)
        config = read_config(folder)
        text = config.get("text_config", config)
        tied = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        network = ChatNetwork(TextConfig.from_dict(text), tied)

        def from_folder() -> dict:
            named = {}
            for name, value in load_weights(folder, dtype).items():
                module = module_name(name)
                if module is not None:
                    named["model." + module] = value
                elif name == HEAD and not tied:
                    named[HEAD] = value
            return named

        load_module(network, folder, quantization, quantized, None, from_folder)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ChatModelError(f"{folder} has no tokenizer.json")
        tokenizer = read_tokenizer(tokenizer_file)
        return cls(
            network,
            tokenizer,
            chat_template(folder),
            stop_tokens(folder, tokenizer),
            tree_bytes(network.parameters()),
        )

    # -- the prompt ------------------------------------------------------------------------

    def prompt_ids(self, messages: list[dict], **variables) -> np.ndarray:
        """The token ids of `messages` under the chat template, the generation prompt added
        (`variables`: the template's own, such as enable_thinking)."""
        text = render_template(self.template, messages, add_generation_prompt=True, **variables)
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- generation --------------------------------------------------------------------------

    def rotary(self, start: int, length: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        config = self.network.model.config
        inverse = inverse_frequencies(config.rope_theta, config.rotary_dim)
        positions = np.arange(start, start + length, dtype=np.float32)[:, None]
        return cos_sin(positions * inverse[None, :], dtype)

    def greedy(self, ids: np.ndarray, max_new_tokens: int) -> Generated:
        """The most likely next token, each after the last, until a stop token or
        `max_new_tokens` new ones."""
        model = self.network.model
        x = model.embed_tokens(mx.array(np.asarray(ids, np.int32))[None])
        cos, sin = self.rotary(0, x.shape[1], x.dtype)
        caches = []
        for layer in model.layers:
            x, cache = layer.prefill(x, cos, sin)
            caches.append(cache)
        out: list[int] = []
        position = len(ids)
        while len(out) < max_new_tokens:
            token = self.next_token(x[:, -1:])
            if token in self.stop_ids:
                return Generated(out, True)
            out.append(token)
            if len(out) == max_new_tokens:
                break
            x = model.embed_tokens(mx.array([[token]], dtype=mx.int32))
            cos, sin = self.rotary(position, 1, x.dtype)
            for index, layer in enumerate(model.layers):
                x, caches[index] = layer.step(x, cos, sin, caches[index])
            position += 1
        return Generated(out, False)

    def next_token(self, hidden: mx.array) -> int:
        logits = self.network.logits(self.network.model.norm(hidden))
        return int(mx.argmax(logits.astype(mx.float32)[0, -1]).item())


def quantized(path: str) -> bool:
    """The layers a quantized load of the chat model quantizes, by module path: its decoder
    layers' linears, the token table and the head."""
    return path in ("model.embed_tokens", "lm_head") or path.startswith("model.layers.")


def chat_template(folder: Path) -> str:
    """The checkpoint's chat template: chat_template.jinja, else tokenizer_config.json's."""
    file = Path(folder) / TEMPLATE_FILE
    if file.is_file():
        return file.read_text(encoding="utf-8")
    config = Path(folder) / TOKENIZER_CONFIG
    template = (
        json.loads(config.read_text(encoding="utf-8")).get("chat_template")
        if config.is_file()
        else None
    )
    if not isinstance(template, str):
        raise ChatModelError(
            f"{folder} has no chat template ({TEMPLATE_FILE}, or chat_template in"
            f" {TOKENIZER_CONFIG})"
        )
    return template


def stop_tokens(folder: Path, tokenizer: Tokenizer) -> frozenset[int]:
    """The ids generation stops at: generation_config.json's `eos_token_id` (an id or a list),
    else config.json's, else the chat turn's end (<|im_end|>)."""
    for name in (GENERATION_CONFIG, "config.json"):
        path = Path(folder) / name
        if path.is_file():
            found = json.loads(path.read_text(encoding="utf-8"))
            found = found.get("eos_token_id", found.get("text_config", {}).get("eos_token_id"))
            if found is not None:
                return frozenset(found if isinstance(found, list) else [found])
    end = tokenizer.token_to_id("<|im_end|>")
    if end is None:
        raise ChatModelError(f"{folder} names no stop token (eos_token_id) and has no <|im_end|>")
    return frozenset([end])


def render_template(template: str, messages: list[dict], **variables) -> str:
    """A chat template rendered as transformers renders it: jinja2's sandbox, blocks trimmed
    and left-stripped, `raise_exception` and a `tojson` that keeps non-ASCII text."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    return environment.from_string(template).render(messages=messages, **variables)
