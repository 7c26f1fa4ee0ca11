"""Prompt upsampling (docs/contract.md §2.6): a model entry's chat model rewrites a short request
into the long prompt the image model is encoded with, as FLUX.3 klein's pipelines do with their
upsampler (diffusers' `modular_pipelines/flux3/prompt_upsampler.py`, text to image: a Qwen3.5-9B
fine-tune, one greedy generation of at most 3,584 tokens).

The conversation is the upsampler's system prompt, when its folder ships one
(`system_prompts.json`'s text-to-image entry, as BFL's upsampler holds them), then the request
as the user's turn, under the checkpoint's chat template with thinking off; the answer is the
generated text less special tokens, stripped. With images it never runs (the contract).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from .encoders.qwen35.chat import ChatModel, ChatModelError
from .precision import Quantization
from .weights import estimated_bytes, read_config

MAX_NEW_TOKENS = 3584  # the pipelines' default
SYSTEM_PROMPTS = "system_prompts.json"
TEXT_TO_IMAGE = "t2i"  # its key there
# A token's cached keys and values, per attention layer, in float32 at the most (a bound for
# the memory plan): the conversation (the upsampler's system prompt, often a thousand words,
# and the request) and MAX_NEW_TOKENS new ones. A longer conversation is refused.
PROMPT_TOKENS_PLANNED = 4096


def system_prompt(folder: Path) -> str | None:
    """The upsampler's text-to-image system prompt from its folder (None: it ships none)."""
    path = Path(folder) / SYSTEM_PROMPTS
    if not path.is_file():
        return None
    prompts = json.loads(path.read_text(encoding="utf-8"))
    found = prompts.get(TEXT_TO_IMAGE) if isinstance(prompts, dict) else None
    if not isinstance(found, str):
        raise ChatModelError(f"{path} has no {TEXT_TO_IMAGE!r} system prompt (a string)")
    return found


def messages(request: str, system: str | None) -> list[dict]:
    """The conversation, its contents as lists of text parts (as the pipelines send them)."""
    turns = [] if system is None else [{"role": "system", "content": [text_part(system)]}]
    return [*turns, {"role": "user", "content": [text_part(request)]}]


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def upsampled(chat: ChatModel, request: str, system: str | None, max_new_tokens: int) -> str:
    """The rewritten prompt: one greedy generation of at most `max_new_tokens` tokens, from a
    conversation of at most PROMPT_TOKENS_PLANNED (what the memory plan counts: a longer one
    is refused before the chat model runs)."""
    ids = chat.prompt_ids(messages(request, system), enable_thinking=False)
    if len(ids) > PROMPT_TOKENS_PLANNED:
        raise ChatModelError(
            f"the prompt to rewrite is {len(ids)} tokens with the upsampler's template; it"
            f" rewrites at most {PROMPT_TOKENS_PLANNED}: shorten it, or send"
            " prompt_upsampling false"
        )
    answer = chat.decode(chat.greedy(ids, max_new_tokens).ids).strip()
    if not answer:
        raise ChatModelError("the prompt upsampler answered an empty prompt")
    return answer


def rewrite(
    folder: Path, request: str, dtype: mx.Dtype, quantization: Quantization | None = None
) -> str:
    """`request` rewritten by the upsampler of `folder` (at most MAX_NEW_TOKENS tokens), loaded
    for it and let go after."""
    chat = ChatModel.load(folder, dtype, quantization)
    try:
        return upsampled(chat, request, system_prompt(folder), MAX_NEW_TOKENS)
    finally:
        del chat
        mx.clear_cache()


def need_bytes(folder: Path, dtype: mx.Dtype) -> int:
    """What a rewrite holds at its peak: the weights at `dtype` and the attention layers' keys
    and values for a prompt of PROMPT_TOKENS_PLANNED and MAX_NEW_TOKENS new tokens."""
    config = read_config(folder)
    text = config.get("text_config", config)
    layers = text["num_hidden_layers"] // text.get("full_attention_interval", 4)
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    width = text.get("num_key_value_heads", text["num_attention_heads"]) * head_dim
    tokens = PROMPT_TOKENS_PLANNED + MAX_NEW_TOKENS
    return estimated_bytes(folder, dtype) + 2 * layers * tokens * width * 4
