"""Prompt upsampling on encode (docs/contract.md §2.6, engine/upsampling.py) with a tiny
Qwen3.5 upsampler beside the embedded FLUX.3 klein: the revised prompt is what diffusers'
FLUX.3 `upsample_prompt` writes with transformers' model on the same folder (its system prompt
from the folder's system_prompts.json, the chat template, greedy generation); `cond` is the
encoding of the revised prompt and `cond_typed` of the prompt as typed; the entry's setting,
the request's true and false, and images decide whether it runs."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from gmlx_contract import wire
from gmlx_contract.hashing import tensor_hash

from tests.encoders.qwen35.test_chat import TEMPLATE
from tests.encoders.qwen35.test_text_parity import CONFIGS
from tests.families.tiny_weights import redraw

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def upsampler(tmp_path_factory):
    return write_upsampler(tmp_path_factory.mktemp("upsampler"))


def write_upsampler(folder):
    """A tiny Qwen3.5 chat checkpoint with the pipeline's system prompts, written into `folder`,
    and transformers' model and tokenizer of it."""
    import torch
    from diffusers.modular_pipelines.flux3.prompt_upsampler import SYSTEM_PROMPTS
    from gmlx_server.engine.embedded import BPE_VOCAB_SIZE, TOKENIZER_CORPUS
    from gmlx_server.engine.encoders.qwen3.tiny_tokenizer import train_tokenizer, write_tokenizer
    from transformers import PreTrainedTokenizerFast, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    tokenizer = train_tokenizer(TOKENIZER_CORPUS, BPE_VOCAB_SIZE)
    write_tokenizer(folder, tokenizer)
    config = Qwen3_5TextConfig(
        vocab_size=tokenizer.get_vocab_size(),
        eos_token_id=tokenizer.token_to_id("<|im_end|>"),
        **CONFIGS["grouped"],
    )
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config).eval()
    redraw(model, torch.Generator().manual_seed(1), 1.0, 0.3, lambda n, p: p.ndim >= 2)
    model.save_pretrained(str(folder))
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    (folder / "system_prompts.json").write_text(json.dumps(SYSTEM_PROMPTS))
    processor = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    processor.chat_template = TEMPLATE
    return folder, model, processor


@pytest.fixture(scope="module")
def served(upsampler, tmp_path_factory):
    from gmlx_server.config import ServerConfig
    from gmlx_server.engine import upsampling

    from tests.server.conftest import serve

    registry = upsampling_registry(tmp_path_factory.mktemp("embedded"), upsampler[0])
    keep, upsampling.MAX_NEW_TOKENS = upsampling.MAX_NEW_TOKENS, NEW_TOKENS
    server = serve(ServerConfig(host="127.0.0.1", port=0), registry)
    yield server, registry.default_model
    server.close()
    upsampling.MAX_NEW_TOKENS = keep


def upsampling_registry(root, upsampler_folder, rewrites: bool = False):
    """The embedded FLUX.3 klein (written under `root`) as two models: its own id, whose entry
    names the upsampler (and with `rewrites` rewrites every prompt), and `upsampling`, whose
    entry rewrites every prompt."""
    from gmlx_server.config import ModelSettings
    from gmlx_server.engine.families.flux3_klein import embedded
    from gmlx_server.engine.registry import ModelRegistry

    folder = embedded.ensure_embedded_model(root)
    entries = {
        folder.name: ModelSettings(prompt_upsampler=upsampler_folder, prompt_upsampling=rewrites),
        "upsampling": ModelSettings(prompt_upsampler=upsampler_folder, prompt_upsampling=True),
    }
    link = folder.parent / "upsampling"
    link.symlink_to(folder)
    return ModelRegistry(
        [], folder.name, extra_models=[folder, link], settings=lambda m: entries[m]
    )


def reference_rewrite(upsampler, request: str) -> str:
    from diffusers.modular_pipelines.flux3.prompt_upsampler import upsample_prompt

    _, model, processor = upsampler
    return upsample_prompt(model, processor, request, max_new_tokens=NEW_TOKENS)


def encode(server, model: str, **fields) -> wire.Container:
    reply = server.post_json("encode", {"model": model, **fields})
    assert reply.status_code == 200, reply.text
    return wire.read_container(reply.content)


def png_b64(pixels: np.ndarray) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


REQUEST = "a red fox in the snow"


def test_an_asked_rewrite_is_the_pipelines_and_both_prompts_are_encoded(served, upsampler):
    server, model = served
    answer = encode(server, model, text=REQUEST, prompt_upsampling=True)
    revised = answer.fields["revised_prompt"]
    assert revised == reference_rewrite(upsampler, REQUEST) and revised != REQUEST
    plain = encode(server, model, text=REQUEST).tensors["cond"]  # the entry's setting: off
    rewritten = encode(server, model, text=revised).tensors["cond"]
    assert np.array_equal(answer.tensors["cond_typed"], plain)
    assert np.array_equal(answer.tensors["cond"], rewritten)
    assert answer.fields["cond_typed"] == tensor_hash(plain)
    assert answer.fields["cond"] == tensor_hash(rewritten)
    assert answer.fields["num_tokens"] == rewritten.shape[1]
    assert server.call("HEAD", f"tensors/{answer.fields['cond_typed']}").status_code == 200


def test_a_prompt_longer_than_the_plan_counts_is_refused_before_the_chat_model_runs(served):
    from gmlx_server.engine.upsampling import PROMPT_TOKENS_PLANNED

    server, model = served
    long = " ".join(["fox"] * (PROMPT_TOKENS_PLANNED + 10))
    reply = server.post_json("encode", {"model": model, "text": long, "prompt_upsampling": True})
    assert reply.status_code == 400, reply.text
    assert f"rewrites at most {PROMPT_TOKENS_PLANNED}" in reply.json()["error"]
    assert encode(server, model, text=long, prompt_upsampling=False).tensors["cond"].size


def test_the_entry_decides_what_the_request_leaves_open(served):
    server, _ = served
    on = encode(server, "upsampling", text=REQUEST)
    assert "revised_prompt" in on.fields and "cond_typed" in on.tensors
    off = encode(server, "upsampling", text=REQUEST, prompt_upsampling=False)
    assert "revised_prompt" not in off.fields and "cond_typed" not in off.tensors
    assert np.array_equal(off.tensors["cond"], on.tensors["cond_typed"])


def test_an_empty_prompt_is_never_rewritten(served):
    """The empty negative prompt of a guided sampling stays empty, on an entry that rewrites
    every prompt (the pipelines rewrite the prompt alone)."""
    server, _ = served
    answer = encode(server, "upsampling", text="", prompt_upsampling=True)
    assert "revised_prompt" not in answer.fields and "cond_typed" not in answer.tensors


def test_with_images_it_never_runs(served):
    """An edit's encode (FLUX.3 klein's references) on the entry that rewrites every prompt:
    the prompt stays as typed."""
    server, _ = served
    picture = png_b64(np.zeros((64, 64, 3), np.uint8))
    answer = encode(server, "upsampling", text=REQUEST, images=[picture])
    assert "revised_prompt" not in answer.fields and "cond_typed" not in answer.tensors
    assert len(answer.fields["ref_latents"]) == 1
    plain = encode(server, "upsampling", text=REQUEST, prompt_upsampling=False)
    assert np.array_equal(answer.tensors["cond"], plain.tensors["cond"])


def test_asking_a_model_without_an_upsampler_is_refused(live):
    reply = live.post_json("encode", {"text": "x", "prompt_upsampling": True})
    assert reply.status_code == 400 and "prompt_upsampler" in reply.text
