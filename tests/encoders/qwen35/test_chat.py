"""Qwen3.5 as a chat model (encoders/qwen35/chat.py) against transformers on tiny random
checkpoints of two shapes, float32: the prompt's tokens under the checkpoint's chat template
are transformers' `apply_chat_template`'s, and greedy generation over the cached layers is
transformers' `generate(do_sample=False)` token for token, through prompts of one and of several
delta-rule chunks, and ends where it does at a stop token."""

from __future__ import annotations

import numpy as np
import pytest
from gmlx_server.engine.embedded import BPE_VOCAB_SIZE, TOKENIZER_CORPUS
from gmlx_server.engine.encoders.qwen3.tiny_tokenizer import train_tokenizer, write_tokenizer
from gmlx_server.engine.encoders.qwen35.chat import ChatModel, render_template

from tests.encoders.qwen35.test_text_parity import CONFIGS
from tests.families.tiny_weights import redraw

# A chat template in Qwen3.5's form: turns of text parts, the generation prompt with thinking on
# unless the caller turns it off.
TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'text' %}{{- part.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def chat(request, tmp_path_factory):
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    folder = tmp_path_factory.mktemp(f"qwen35_chat_{request.param}")
    tokenizer = train_tokenizer(TOKENIZER_CORPUS, BPE_VOCAB_SIZE)
    write_tokenizer(folder, tokenizer)
    end = tokenizer.token_to_id("<|im_end|>")
    config = Qwen3_5TextConfig(
        vocab_size=tokenizer.get_vocab_size(), eos_token_id=end, **CONFIGS[request.param]
    )
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config).eval()
    redraw(model, torch.Generator().manual_seed(1), 1.0, 0.3, lambda n, p: p.ndim >= 2)
    model.save_pretrained(str(folder))
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return model, ChatModel.load(folder), folder


def messages(request: str) -> list[dict]:
    return [
        {"role": "system", "content": [{"type": "text", "text": "Expand the request."}]},
        {"role": "user", "content": [{"type": "text", "text": request}]},
    ]


def reference_ids(folder, request: str) -> list[int]:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    tokenizer.chat_template = TEMPLATE
    return tokenizer.apply_chat_template(
        messages(request), add_generation_prompt=True, tokenize=True, enable_thinking=False
    )["input_ids"]


REQUESTS = ["a red fox", "a lighthouse on a cliff at dusk, oil painting " * 9]


@pytest.mark.parametrize("request_text", REQUESTS)
def test_the_prompt_is_transformers_chat_template(chat, request_text):
    _, ours, folder = chat
    ids = ours.prompt_ids(messages(request_text), enable_thinking=False)
    assert ids.tolist() == list(reference_ids(folder, request_text))
    rendered = render_template(TEMPLATE, messages("x"), add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n<think>\n")  # thinking on unless turned off


@pytest.mark.parametrize("request_text", REQUESTS)
def test_greedy_generation_is_transformers_token_for_token(chat, request_text):
    import torch

    reference, ours, _ = chat
    ids = ours.prompt_ids(messages(request_text), enable_thinking=False)
    assert len(ids) > (64 if len(request_text) > 100 else 0)  # one chunk, and several
    steps = 24
    with torch.no_grad():
        expected = reference.generate(
            torch.from_numpy(ids.astype(np.int64))[None],
            max_new_tokens=steps,
            do_sample=False,
            eos_token_id=sorted(ours.stop_ids),
            pad_token_id=0,
        )[0, len(ids) :].tolist()
    got = ours.greedy(ids, steps)
    stop = sorted(ours.stop_ids)[0]
    assert got.ids == [t for t in expected if t != stop]
    assert got.stopped == (stop in expected)
    assert len(set(got.ids)) > 1  # not one token over and over: the caches carry the sequence


def test_generation_ends_at_a_stop_token_as_transformers_does(chat):
    """A token the generation reaches, named as the stop token: both stop before it."""
    import torch

    reference, ours, _ = chat
    ids = ours.prompt_ids(messages(REQUESTS[0]), enable_thinking=False)
    free = ours.greedy(ids, 12).ids
    stop = free[6]
    first = free.index(stop)
    stopping = ChatModel(ours.network, ours.tokenizer, ours.template, frozenset([stop]), 0)
    got = stopping.greedy(ids, 12)
    with torch.no_grad():
        expected = reference.generate(
            torch.from_numpy(ids.astype(np.int64))[None],
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=[stop],
            pad_token_id=0,
        )[0, len(ids) :].tolist()
    assert got.stopped and got.ids == free[:first] == expected[:first]
    assert expected[first] == stop


def test_a_quantized_load_generates_from_quantized_layers(chat):
    """With a quantization (the model entry's), the decoder layers, the token table and the head
    load quantized, and generation runs on them."""
    import mlx.nn as nn
    from gmlx_server.engine.precision import Quantization

    _, ours, folder = chat
    if ours.network.model.config.hidden_size % 32:
        pytest.skip("a width of no group of 32 keeps its layers float")
    quantized = ChatModel.load(folder, quantization=Quantization(8, 32))
    layers = [m for _, m in quantized.network.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert len(layers) >= 7 * ours.network.model.config.num_layers
    assert quantized.weight_bytes < ours.weight_bytes
    ids = ours.prompt_ids(messages(REQUESTS[0]), enable_thinking=False)
    got = quantized.greedy(ids, 8)
    assert len(got.ids) == 8 or got.stopped
