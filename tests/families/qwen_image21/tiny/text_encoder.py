"""Build a tiny Qwen3-VL text encoder and processor folder for Qwen-Image 2.1 tests.

`build_text_encoder(model_dir)` writes `model_dir/text_encoder` (a random
`Qwen3VLForConditionalGeneration` saved with `save_pretrained`) and `model_dir/processor` (the
embedded model's tokenizer and processor files: a small byte-level BPE trained offline on this
module's corpus, Qwen's added tokens in Qwen's order, the chat template and the processor
configs for this module's vision tower); `build_language_model(root)` writes the bare
`Qwen3VLModel` and its tokenizer other families' folders hold. Nothing is downloaded. Torch
and transformers are development dependencies: only tests import this module.
"""

from __future__ import annotations

from pathlib import Path

import torch
from gmlx_server.engine.families.qwen_image21 import embedded
from tokenizers import Tokenizer

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
    """The embedded model's Qwen-style BPE, trained on the tests' corpus."""
    return embedded.build_tokenizer(_CORPUS * 4, vocab_size)


def tiny_config(tokenizer: Tokenizer, text: dict | None = None, vision: dict | None = None):
    from transformers import Qwen3VLConfig

    ids = embedded.token_ids(tokenizer)
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
    """Default init hides the prompt's effect (docs/engine.md, Testing by parity): draw every
    weight larger and give constant-initialised parameters (norm scales, biases) small noise."""
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


def build_language_model(root: Path, seed: int, text_layers: int) -> None:
    """Write root/tokenizer (the tests' tokenizer) and root/text_encoder: a Qwen3VLModel of the
    tiny configs with `text_layers` decoder layers, drawn from `seed` as build_text_encoder
    draws (the text encoder of FLUX.3 klein's and Krea 2's tiny folders)."""
    from gmlx_server.engine.encoders.qwen3.tiny_tokenizer import write_tokenizer
    from transformers import Qwen3VLModel

    tokenizer = build_tokenizer()
    write_tokenizer(Path(root) / "tokenizer", tokenizer)
    config = tiny_config(tokenizer, text={"num_hidden_layers": text_layers})
    torch.manual_seed(seed)
    encoder = Qwen3VLModel(config).eval()
    _redraw(encoder, seed)
    encoder.save_pretrained(str(Path(root) / "text_encoder"))


def build_text_encoder(model_dir: Path, seed: int = 0, **overrides) -> Path:
    """Write model_dir/text_encoder and model_dir/processor; returns model_dir.

    overrides: `text` and `vision` (dicts merged into the tiny configs), `min_pixels`,
    `max_pixels`, `vocab_size`.
    """
    from transformers import Qwen3VLForConditionalGeneration

    model_dir = Path(model_dir)
    tokenizer = build_tokenizer(overrides.get("vocab_size", 320))
    config = tiny_config(tokenizer, overrides.get("text"), overrides.get("vision"))
    embedded.write_processor(
        model_dir / "processor",
        tokenizer,
        vision=config.vision_config.to_dict(),
        min_pixels=overrides.get("min_pixels", TINY_MIN_PIXELS),
        max_pixels=overrides.get("max_pixels", TINY_MAX_PIXELS),
    )
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).eval()
    _redraw(model, seed)
    model.save_pretrained(model_dir / "text_encoder")
    return model_dir
