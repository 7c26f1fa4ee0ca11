"""Build a tiny Qwen3-VL text encoder and processor folder for Qwen-Image 2.1 tests.

`build_text_encoder(model_dir)` writes `model_dir/text_encoder` (a random
`Qwen3VLForConditionalGeneration` saved with `save_pretrained`) and `model_dir/processor` (a small
byte-level BPE trained offline with `tokenizers`, Qwen's special tokens in Qwen's order, the
tokenizer config, a Qwen3-VL style chat template and the image-processor config). Nothing is
downloaded. Torch and transformers are development dependencies: only tests import this module.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers.trainers import BpeTrainer

# Qwen2/Qwen3 added tokens in the order of their ids (151643 onwards in the real vocabulary);
# the last four are added tokens that are not special.
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
]
QWEN_PLAIN_ADDED_TOKENS = ["<tool_response>", "</tool_response>", "<think>", "</think>"]

# Qwen2's pre-tokenizer split, as the real tokenizer.json carries it.
QWEN_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# A small fixed corpus so the BPE learns merges for the words the tests use.
_CORPUS = [
    "Comprehend and analyze the provided prompt.",
    "A capybara wearing a wizard hat, reading a book by candlelight, oil painting",
    "a red fox in the snow, photograph, 35mm, golden hour light",
    "Replace the background of picture 1 with the sky of picture 2.",
    "system user assistant image picture the of and with in on a an",
    "0123456789 The quick brown fox jumps over the lazy dog.",
    "Ein Fuchs im Schnee. Un renard dans la neige. 雪の中のキツネ。",
]

# Qwen3-VL's chat template, reduced to the message forms these tests render (system, user and
# assistant turns whose content is a string or a list of text and image parts).
CHAT_TEMPLATE = (
    "{%- set image_count = namespace(value=0) -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for content in message['content'] -%}"
    "{%- if content['type'] == 'image' or 'image' in content -%}"
    "{%- set image_count.value = image_count.value + 1 -%}"
    "{%- if add_vision_id -%}Picture {{ image_count.value }}: {% endif -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif 'text' in content -%}"
    "{{- content['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

TINY_TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    # Interleaved multimodal RoPE: sections (T, H, W) sum to half the head dim.
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 5000000.0,
        "mrope_section": [4, 2, 2],
        "mrope_interleaved": True,
    },
}
TINY_VISION = {
    "depth": 3,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 64,
    "num_position_embeddings": 16,
    "deepstack_visual_indexes": [0, 2],
}
# Below Qwen3-VL's stock 65,536 so that tiny test images keep their own slot count.
TINY_MIN_PIXELS = 32 * 32
TINY_MAX_PIXELS = 1024 * 1024


def build_tokenizer(vocab_size: int = 320) -> Tokenizer:
    """A byte-level BPE with Qwen's normalizer and pre-tokenizer, then Qwen's added tokens."""
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS]
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in QWEN_PLAIN_ADDED_TOKENS]
    )
    return tokenizer


def _token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    return {t: tokenizer.token_to_id(t) for t in QWEN_SPECIAL_TOKENS + QWEN_PLAIN_ADDED_TOKENS}


def write_processor(processor_dir: Path, tokenizer: Tokenizer, min_pixels: int, max_pixels: int):
    processor_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(processor_dir / "tokenizer.json"))
    ids = _token_ids(tokenizer)
    added = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in QWEN_SPECIAL_TOKENS,
        }
        for t in QWEN_SPECIAL_TOKENS + QWEN_PLAIN_ADDED_TOKENS
    }
    tokenizer_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 262144,
        "split_special_tokens": False,
        "processor_class": "Qwen3VLProcessor",
    }
    (processor_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (processor_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    image_config = {
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "processor_class": "Qwen3VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "resample": 3,
        "patch_size": TINY_VISION["patch_size"],
        "temporal_patch_size": TINY_VISION["temporal_patch_size"],
        "merge_size": TINY_VISION["spatial_merge_size"],
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
    }
    (processor_dir / "preprocessor_config.json").write_text(json.dumps(image_config, indent=2))


def tiny_config(tokenizer: Tokenizer, text: dict | None = None, vision: dict | None = None):
    from transformers import Qwen3VLConfig

    ids = _token_ids(tokenizer)
    text_config = {**TINY_TEXT, **(text or {}), "vocab_size": tokenizer.get_vocab_size()}
    text_config["pad_token_id"] = ids["<|endoftext|>"]
    return Qwen3VLConfig(
        text_config=text_config,
        vision_config={**TINY_VISION, **(vision or {})},
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


@torch.no_grad()
def _redraw(model: torch.nn.Module, seed: int):
    """Default init hides the prompt's effect (the DESIGN note): draw every weight larger and give
    constant-initialised parameters (norm scales, biases) small noise."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
        if param.ndim >= 2:
            fan_in = param[0].numel()
            param.copy_(noise * (1.0 / fan_in) ** 0.5)
        elif name.endswith("weight"):
            param.copy_(1.0 + 0.1 * noise)
        else:
            param.copy_(0.1 * noise)


def build_text_encoder(model_dir: Path, seed: int = 0, **overrides) -> Path:
    """Write model_dir/text_encoder and model_dir/processor; returns model_dir.

    overrides: `text` and `vision` (dicts merged into the tiny configs), `min_pixels`,
    `max_pixels`, `vocab_size`.
    """
    from transformers import Qwen3VLForConditionalGeneration

    model_dir = Path(model_dir)
    tokenizer = build_tokenizer(overrides.get("vocab_size", 320))
    write_processor(
        model_dir / "processor",
        tokenizer,
        overrides.get("min_pixels", TINY_MIN_PIXELS),
        overrides.get("max_pixels", TINY_MAX_PIXELS),
    )
    config = tiny_config(tokenizer, overrides.get("text"), overrides.get("vision"))
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).eval()
    _redraw(model, seed)
    model.save_pretrained(model_dir / "text_encoder")
    return model_dir
