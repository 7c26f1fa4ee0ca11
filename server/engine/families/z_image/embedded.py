"""The embedded Z-Image: a tiny Z-Image Turbo with random weights, generated on first use.

The server offers it beside the embedded default (`qwen-image21-random-tiny`, which stays the
default) so the second family can be tried without downloading anything: a complete folder in
diffusers' `ZImagePipeline` layout (model_index.json, transformer/, vae/, text_encoder/,
tokenizer/, scheduler/) with the real file formats, config keys and weight names, at a small
size, its weights drawn from a fixed seed (engine/embedded.py's rule: the prompt visibly moves
the output). It makes noise-like pictures, and its name says so ("z-image-random-tiny").

Interface sizes are the real model's where clients see them: 16 latent channels at stride 8,
patch 2, an RGB VAE with FLUX.1's scaling and shift factors and its 1024-pixel tiles, Qwen's
token ids' order; the networks inside are narrow and shallow (a DiT of width 64 with two main
blocks, a VAE whose widest stage has 32 channels, a 3-layer Qwen3 of width 32). The tests'
tiny Z-Image folders are this recipe too (tests/families/z_image/tiny), at their own seeds.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ...embedded import (
    DIFFUSERS_FORMAT,
    DIFFUSERS_WEIGHTS,
    GAIN,
    MATRIX,
    SHIFT,
    TRANSFORMERS_WEIGHTS,
    Inventory,
    default_cache_dir,  # noqa: F401  (what an embedded model's module provides: engine/embedded.py)
    draw,
    dumps,
    ensure,
    stamp,
    write_component,
)
from ...encoders.qwen3.tiny_tokenizer import PLAIN_ADDED_TOKENS, SPECIAL_TOKENS, train_tokenizer
from . import spec

MODEL_NAME = "z-image-random-tiny"
# Bump when the code below writes something different for the same configs.
GENERATOR_VERSION = 1
SEED = 0
VARIANT = "turbo"
# Each component draws from its own stream, [seed, index], so a component written alone equals
# the same component of a whole folder of that seed.
COMPONENT_INDEX = {"transformer": 0, "vae": 1, "text_encoder": 2}

TRANSFORMER_CONFIG = {
    "_class_name": "ZImageTransformer2DModel",
    "_diffusers_version": DIFFUSERS_FORMAT,
    "all_patch_size": [2],
    "all_f_patch_size": [1],
    "in_channels": 16,
    "dim": 64,
    "n_layers": 2,
    "n_refiner_layers": 1,
    "n_heads": 2,
    "n_kv_heads": 2,
    "norm_eps": 1e-05,
    "qk_norm": True,
    "cap_feat_dim": 32,  # = the text encoder's hidden size
    "rope_theta": 256.0,
    "t_scale": 1000.0,
    "axes_dims": [8, 12, 12],  # sums to the head dim (64 / 2)
    "axes_lens": [256, 64, 64],
}
# diffusers' constants: the time embedder's sinusoid width and hidden width, and the widest
# modulation input.
TIME_FREQUENCIES = 256
TIME_MID_SIZE = 1024
ADALN_EMBED_DIM = 256

VAE_CONFIG = {
    "_class_name": "AutoencoderKL",
    "_diffusers_version": DIFFUSERS_FORMAT,
    "act_fn": "silu",
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 16,
    "block_out_channels": [16, 32, 32, 32],  # four blocks: stride 8
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "layers_per_block": 2,
    "norm_num_groups": 8,
    "mid_block_add_attention": True,
    "force_upcast": True,
    "latents_mean": None,
    "latents_std": None,
    "sample_size": 1024,  # FLUX.1's: images up to 1024 pixels are not tiled
    "scaling_factor": 0.3611,  # FLUX.1's
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}

TEXT_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "dtype": "float32",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-06,
    "max_position_embeddings": 1024,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "use_cache": True,
    # vocab_size and the token ids come from the tokenizer (see _text_config).
}

# Noise given to parameters that start constant, per component (the DiT's pad tokens and
# norms need more to matter).
CONSTANT_NOISE = {"transformer": 0.3, "vae": 0.1, "text_encoder": 0.1}

# What the BPE learns its merges from, and its vocabulary bound.
TOKENIZER_CORPUS = [
    "A capybara wearing a wizard hat, reading a book by candlelight, oil painting",
    "a red fox in the snow, photograph, 35mm, golden hour light",
    "user assistant system the of and with in on a an",
    "0123456789 The quick brown fox jumps over the lazy dog.",
    "Ein Fuchs im Schnee. Un renard dans la neige. 雪の中のキツネ。",
] * 4
BPE_VOCAB_SIZE = 320
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

MODEL_INDEX = {**spec.MODEL_INDEX, "_diffusers_version": DIFFUSERS_FORMAT}


def scheduler_config(variant: str) -> dict:
    """scheduler_config.json: the pipeline's flow-matching Euler at the variant's static shift."""
    return {**spec.scheduler_config(variant), "_diffusers_version": DIFFUSERS_FORMAT}


def ensure_embedded_model(cache_dir: Path | None = None) -> Path:
    """The embedded Z-Image's folder under `cache_dir` (default: `default_cache_dir()`),
    generated first if it is missing or was made by a different generator."""
    return ensure(cache_dir, MODEL_NAME, _stamp(), write_embedded_model)


def write_embedded_model(
    root: Path, seed: int = SEED, variant: str = VARIANT, transformer: dict | None = None
) -> None:
    """Write every file of a tiny Z-Image folder into `root` (created if missing): the
    embedded model at the defaults; `transformer`: overrides of its DiT config."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    write_transformer(root / "transformer", seed, **(transformer or {}))
    write_vae(root / "vae", seed)
    write_text_encoder(root, seed)
    (root / "scheduler").mkdir(exist_ok=True)
    (root / "scheduler" / "scheduler_config.json").write_text(dumps(scheduler_config(variant)))
    (root / "model_index.json").write_text(dumps(MODEL_INDEX))


def write_transformer(folder: Path, seed: int = SEED, **overrides) -> None:
    config = {**TRANSFORMER_CONFIG, **overrides}
    _write(Path(folder), "transformer", config, transformer_tensors(config), seed)


def write_vae(folder: Path, seed: int = SEED, **overrides) -> None:
    config = {**VAE_CONFIG, **overrides}
    _write(Path(folder), "vae", config, vae_tensors(config), seed)


def write_text_encoder(root: Path, seed: int = SEED) -> None:
    """Write root/text_encoder (Qwen3ForCausalLM) and root/tokenizer."""
    root = Path(root)
    tokenizer = train_tokenizer(TOKENIZER_CORPUS, BPE_VOCAB_SIZE)
    write_tokenizer(root / "tokenizer", tokenizer)
    config = _text_config(tokenizer.get_vocab_size())
    _write(root / "text_encoder", "text_encoder", config, text_encoder_tensors(config), seed)


def _write(folder: Path, component: str, config: dict, inventory: Inventory, seed: int) -> None:
    rng = np.random.default_rng([seed, COMPONENT_INDEX[component]])
    weights = draw(inventory, rng, CONSTANT_NOISE[component])
    file_name = TRANSFORMERS_WEIGHTS if component == "text_encoder" else DIFFUSERS_WEIGHTS
    write_component(folder, config, weights, file_name)


def _stamp() -> dict:
    """Who made the folder: a fingerprint over everything that decides its contents."""
    recipe = {
        "generator": GENERATOR_VERSION,
        "seed": SEED,
        "variant": VARIANT,
        "transformer": TRANSFORMER_CONFIG,
        "vae": VAE_CONFIG,
        "text": TEXT_CONFIG,
        "noise": CONSTANT_NOISE,
        "scheduler": scheduler_config(VARIANT),
        "model_index": MODEL_INDEX,
        "tokens": [SPECIAL_TOKENS, PLAIN_ADDED_TOKENS, BPE_VOCAB_SIZE, TOKENIZER_CORPUS],
        "chat_template": CHAT_TEMPLATE,
    }
    return stamp(MODEL_NAME, GENERATOR_VERSION, recipe)


# ---- weights ------------------------------------------------------------------------------


def transformer_tensors(config: dict) -> Inventory:
    """Names, shapes and kinds of ZImageTransformer2DModel's parameters for `config`."""
    dim, heads = config["dim"], config["n_heads"]
    head, hidden = dim // heads, int(dim / 3 * 8)
    kv = config.get("n_kv_heads", heads) * head
    adaln = min(dim, ADALN_EMBED_DIM)
    patch = config["all_patch_size"][0]
    key = f"{patch}-{config['all_f_patch_size'][0]}"
    patch_values = patch * patch * config["all_f_patch_size"][0] * config["in_channels"]
    tensors: Inventory = {
        "x_pad_token": ((1, dim), SHIFT),
        "cap_pad_token": ((1, dim), SHIFT),
        "cap_embedder.0.weight": ((config["cap_feat_dim"],), GAIN),
    }
    _linear(tensors, f"all_x_embedder.{key}", patch_values, dim)
    _linear(tensors, f"all_final_layer.{key}.linear", dim, patch_values)
    _linear(tensors, f"all_final_layer.{key}.adaLN_modulation.1", adaln, dim)
    _linear(tensors, "t_embedder.mlp.0", TIME_FREQUENCIES, TIME_MID_SIZE)
    _linear(tensors, "t_embedder.mlp.2", TIME_MID_SIZE, adaln)
    _linear(tensors, "cap_embedder.1", config["cap_feat_dim"], dim)
    stacks = {
        "noise_refiner": (config["n_refiner_layers"], True),
        "context_refiner": (config["n_refiner_layers"], False),
        "layers": (config["n_layers"], True),
    }
    for stack, (depth, modulated) in stacks.items():
        for index in range(depth):
            prefix = f"{stack}.{index}."
            for name, shape in {
                "attention.to_q": (heads * head, dim),
                "attention.to_k": (kv, dim),
                "attention.to_v": (kv, dim),
                "attention.to_out.0": (dim, heads * head),
                "feed_forward.w1": (hidden, dim),
                "feed_forward.w2": (dim, hidden),
                "feed_forward.w3": (hidden, dim),
            }.items():
                tensors[prefix + name + ".weight"] = (shape, MATRIX)
            for name in ("attention.norm_q", "attention.norm_k"):
                tensors[prefix + name + ".weight"] = ((head,), GAIN)
            for name in ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2"):
                tensors[prefix + name + ".weight"] = ((dim,), GAIN)
            if modulated:
                _linear(tensors, prefix + "adaLN_modulation.0", adaln, 4 * dim)
    return tensors


def vae_tensors(config: dict) -> Inventory:
    """Names, shapes and kinds of AutoencoderKL's parameters (its down and up encoder blocks,
    one attention in each mid block) for `config`."""
    tensors: Inventory = {}
    dims, blocks = list(config["block_out_channels"]), config["layers_per_block"]
    latent = config["latent_channels"]
    last = len(dims) - 1
    _conv(tensors, "encoder.conv_in", config["in_channels"], dims[0], 3)
    for i, out_dim in enumerate(dims):
        prefix = f"encoder.down_blocks.{i}"
        for r in range(blocks):
            _resnet(
                tensors,
                f"{prefix}.resnets.{r}",
                dims[max(i - 1, 0)] if r == 0 else out_dim,
                out_dim,
            )
        if i != last:
            _conv(tensors, f"{prefix}.downsamplers.0.conv", out_dim, out_dim, 3)
    _mid_block(tensors, "encoder.mid_block", dims[-1])
    _norm(tensors, "encoder.conv_norm_out", dims[-1])
    _conv(tensors, "encoder.conv_out", dims[-1], 2 * latent, 3)
    if config.get("use_quant_conv", True):
        _conv(tensors, "quant_conv", 2 * latent, 2 * latent, 1)
    if config.get("use_post_quant_conv", True):
        _conv(tensors, "post_quant_conv", latent, latent, 1)
    dims = dims[::-1]
    _conv(tensors, "decoder.conv_in", latent, dims[0], 3)
    _mid_block(tensors, "decoder.mid_block", dims[0])
    for i, out_dim in enumerate(dims):
        prefix = f"decoder.up_blocks.{i}"
        for r in range(blocks + 1):
            _resnet(
                tensors,
                f"{prefix}.resnets.{r}",
                dims[max(i - 1, 0)] if r == 0 else out_dim,
                out_dim,
            )
        if i != last:
            _conv(tensors, f"{prefix}.upsamplers.0.conv", out_dim, out_dim, 3)
    _norm(tensors, "decoder.conv_norm_out", dims[-1])
    _conv(tensors, "decoder.conv_out", dims[-1], config["out_channels"], 3)
    return tensors


def text_encoder_tensors(config: dict) -> Inventory:
    """Names, shapes and kinds of Qwen3ForCausalLM's parameters for `config`."""
    hidden, head, inner = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    q_width = config["num_attention_heads"] * head
    kv_width = config["num_key_value_heads"] * head
    vocab = config["vocab_size"]
    tensors: Inventory = {
        "model.embed_tokens.weight": ((vocab, hidden), MATRIX),
        "model.norm.weight": ((hidden,), GAIN),
        "lm_head.weight": ((vocab, hidden), MATRIX),
    }
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        for name, shape in {
            "self_attn.q_proj": (q_width, hidden),
            "self_attn.k_proj": (kv_width, hidden),
            "self_attn.v_proj": (kv_width, hidden),
            "self_attn.o_proj": (hidden, q_width),
            "mlp.gate_proj": (inner, hidden),
            "mlp.up_proj": (inner, hidden),
            "mlp.down_proj": (hidden, inner),
        }.items():
            tensors[prefix + name + ".weight"] = (shape, MATRIX)
        for name, width in {
            "self_attn.q_norm": head,
            "self_attn.k_norm": head,
            "input_layernorm": hidden,
            "post_attention_layernorm": hidden,
        }.items():
            tensors[prefix + name + ".weight"] = ((width,), GAIN)
    return tensors


def _linear(tensors: Inventory, prefix: str, in_dim: int, out_dim: int) -> None:
    tensors[f"{prefix}.weight"] = ((out_dim, in_dim), MATRIX)
    tensors[f"{prefix}.bias"] = ((out_dim,), SHIFT)


def _conv(tensors: Inventory, prefix: str, in_dim: int, out_dim: int, kernel: int) -> None:
    tensors[f"{prefix}.weight"] = ((out_dim, in_dim, kernel, kernel), MATRIX)
    tensors[f"{prefix}.bias"] = ((out_dim,), SHIFT)


def _norm(tensors: Inventory, prefix: str, dim: int) -> None:
    tensors[f"{prefix}.weight"] = ((dim,), GAIN)
    tensors[f"{prefix}.bias"] = ((dim,), SHIFT)


def _resnet(tensors: Inventory, prefix: str, in_dim: int, out_dim: int) -> None:
    _norm(tensors, f"{prefix}.norm1", in_dim)
    _conv(tensors, f"{prefix}.conv1", in_dim, out_dim, 3)
    _norm(tensors, f"{prefix}.norm2", out_dim)
    _conv(tensors, f"{prefix}.conv2", out_dim, out_dim, 3)
    if in_dim != out_dim:
        _conv(tensors, f"{prefix}.conv_shortcut", in_dim, out_dim, 1)


def _mid_block(tensors: Inventory, prefix: str, dim: int) -> None:
    _resnet(tensors, f"{prefix}.resnets.0", dim, dim)
    _norm(tensors, f"{prefix}.attentions.0.group_norm", dim)
    for name in ("to_q", "to_k", "to_v", "to_out.0"):
        _linear(tensors, f"{prefix}.attentions.0.{name}", dim, dim)
    _resnet(tensors, f"{prefix}.resnets.1", dim, dim)


# ---- text encoder config and tokenizer ----------------------------------------------------


def _text_config(vocab_size: int) -> dict:
    return {
        **TEXT_CONFIG,
        "vocab_size": vocab_size,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }


def write_tokenizer(folder: Path, tokenizer) -> None:
    """folder/tokenizer.json and tokenizer_config.json (with Qwen3's chat template)."""
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
