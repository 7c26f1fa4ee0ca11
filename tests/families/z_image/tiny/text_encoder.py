"""A tiny random Qwen3 text encoder and tokenizer folder for Z-Image tests.

`build_text_encoder(model_dir)` writes `model_dir/text_encoder` (a random `Qwen3ForCausalLM`
saved with `save_pretrained`) and `model_dir/tokenizer` (a small byte-level BPE with Qwen's
added tokens, the Qwen-style tokenizer the project's tiny Qwen folders use, and a compact
Qwen3 chat template with its thinking switch). Nothing is downloaded; torch and transformers are
test-only.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from gmlx_server.engine.families.qwen_image21 import embedded

# A small corpus so the BPE learns merges for the words the tests use.
CORPUS = [
    "A capybara wearing a wizard hat, reading a book by candlelight, oil painting",
    "a red fox in the snow, photograph, 35mm, golden hour light",
    "user assistant system the of and with in on a an",
    "0123456789 The quick brown fox jumps over the lazy dog.",
    "Ein Fuchs im Schnee. Un renard dans la neige. 雪の中のキツネ。",
]
TINY_TEXT = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 1024,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
}
# Qwen3's chat template as far as a prompt encoder uses it: turns of string content, the
# generation prompt, and the empty thinking block written when thinking is switched off.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- if enable_thinking is defined and enable_thinking is false -%}\n"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}\n"
)


def write_tokenizer(folder: Path) -> int:
    """Write folder/tokenizer.json and tokenizer_config.json; return the vocabulary size."""
    tokenizer = embedded.build_tokenizer(CORPUS * 4, 320)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n")
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 131072,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tokenizer.get_vocab_size()


@torch.no_grad()
def _redraw(model: torch.nn.Module, seed: int):
    """Default init hides the prompt's effect: draw every matrix with a full 1/sqrt(fan_in)
    spread and give norm scales noise."""
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
        if param.ndim >= 2:
            param.copy_(noise * (1.0 / param.shape[1]) ** 0.5)
        else:
            param.copy_(1.0 + 0.1 * noise)


def build_text_encoder(model_dir: Path, seed: int = 0) -> Path:
    """Write model_dir/text_encoder and model_dir/tokenizer; returns model_dir."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model_dir = Path(model_dir)
    vocab_size = write_tokenizer(model_dir / "tokenizer")
    config = Qwen3Config(**TINY_TEXT, vocab_size=vocab_size)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval()
    _redraw(model, seed)
    model.save_pretrained(model_dir / "text_encoder")
    return model_dir
