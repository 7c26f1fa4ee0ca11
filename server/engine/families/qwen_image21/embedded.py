"""The embedded default model: a small Qwen-Image 2.1 with random weights, generated on first use.

With no model configured, the server and `gmlx image sample` use this folder so the whole pipeline
(prompt encoder, DiT, VAE, step routes) can be tried without downloading anything. It is a
complete diffusers-layout checkpoint with the real file formats, config keys and weight names of
Qwen-Image 2.1, at a small size, with weights drawn from a fixed seed: it makes noise-like
pictures, and its name says so ("qwen-image21-random-tiny"). A real model folder replaces it.

Choices worth knowing:
- Interface sizes match the real model where clients can see them: 64 latent channels at stride
  16, an RGBA VAE, the Qwen token ids' order; the networks inside are narrow and shallow (a
  2-block DiT of width 128, a VAE whose full-resolution stage has 8 channels) so a 512x512
  image takes seconds on a CPU and the folder is a few MB.
- `sample_sigmas` holds the turbo variant's eight fixed sigmas, so an image takes 8 steps rather
  than the base variant's 40: MLX's CPU backend is slow at the element-wise work of attention
  and convolutions, and trying the pipeline should take seconds. The scheduler config still
  carries the base rule's constants (docs/contract.md §5.3). Set SAMPLE_SIGMAS to None for a base
  variant whose step count is the caller's choice.
- Made with numpy, safetensors and tokenizers only (no torch, diffusers or transformers), in a
  temporary folder renamed into place, with a stamp whose fingerprint covers the generator's
  version, seed and configs: a different generator regenerates, the same one reuses the folder
  (engine/embedded.py, shared with the other embedded models).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from ...embedded import (
    DIFFUSERS_FORMAT,
    GAIN,
    MATRIX,
    SHIFT,
    Recipe,
    dumps,
    interleaved_mrope,
    qwen3_vl_config,
    qwen3_vl_tensors,
    table_inventory,
    write_drawn,
)
from ...encoders.qwen3.tiny_tokenizer import (
    PLAIN_ADDED_TOKENS,
    SPECIAL_TOKENS,
    token_ids,
    train_tokenizer,
)
from .layout import TEXT_NORM, DiTConfig, tensor_shapes

MODEL_NAME = "qwen-image21-random-tiny"
# A turbo-like variant: these fixed sigmas (Qwen-Image 2.1 turbo's, docs/contract.md §2.3) set 8 steps.
SAMPLE_SIGMAS = [1.0, 0.978453, 0.95418, 0.926626, 0.89508, 0.845148, 0.704534, 0.414568]

TRANSFORMER_CONFIG = {
    "_class_name": "QwenImage21Transformer2DModel",
    "_diffusers_version": DIFFUSERS_FORMAT,
    "patch_size": 1,
    "in_channels": 64,
    "out_channels": 64,
    "num_layers": 2,
    "attention_head_dim": 64,
    "num_attention_heads": 2,
    "context_in_dim": 128,  # = the text encoder's hidden size and the vision output width
    "mlp_ratio": 3,
    "axes_dims_rope": [16, 24, 24],  # sums to attention_head_dim, all even
    "eps": 1e-06,
    "causal_condition": True,
}

VAE_CONFIG = {
    "_class_name": "AutoencoderKLQwenImage21",
    "_diffusers_version": DIFFUSERS_FORMAT,
    "base_dim": 4,
    "decoder_base_dim": 8,
    "z_dim": 64,  # = the transformer's channels
    "dim_mult": [1, 2, 4, 4, 4],  # five entries: four 2x downsamplings, stride 16
    "num_res_blocks": 1,
    "attn_scales": [],
    "temperal_downsample": [False, True, True, True],  # the config's own spelling
    "dropout": 0.0,
    "is_residual": True,
    "in_channels": 4,  # RGBA
    "out_channels": 4,
    "patch_size": None,
    "scale_factor_spatial": 16,
    "scale_factor_temporal": 8,
    # latents_mean and latents_std are drawn with the weights (see _vae_config).
}

TEXT_CONFIG = {
    "model_type": "qwen3_vl_text",
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-06,
    "max_position_embeddings": 262144,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "use_cache": True,
    "rope_parameters": interleaved_mrope(5000000.0, [6, 5, 5]),
    # vocab_size and the token ids come from the tokenizer (engine/embedded.py: qwen3_vl_config).
}

VISION_CONFIG = {
    "model_type": "qwen3_vl_vision",
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 2,
    "hidden_act": "gelu_pytorch_tanh",
    "in_channels": 3,
    "patch_size": 16,  # patch 16 x merge 2 = 32 pixels = one image-pad slot = 2x2 latents
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 128,  # = the text hidden size
    "num_position_embeddings": 64,  # a square: an 8x8 grid, interpolated to any image
    "deepstack_visual_indexes": [0],
    "initializer_range": 0.02,
}

SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "_diffusers_version": DIFFUSERS_FORMAT,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "time_shift_type": "exponential",
    # The qwen_image21 rule's constants (docs/contract.md §5.3).
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "shift_terminal": 0.02,
}

# Qwen3-VL's stock minimum (256x256) upscales smaller references, so their image-pad slots would
# outnumber their latents' 2x2 groups; one 32x32 slot keeps small references usable.
MIN_PIXELS = 32 * 32
MAX_PIXELS = 16777216


def image_processor_config(vision: dict, min_pixels: int, max_pixels: int) -> dict:
    """preprocessor_config.json for a Qwen3-VL vision tower `vision` and a pixel-count range."""
    return {
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
        "patch_size": vision["patch_size"],
        "temporal_patch_size": vision["temporal_patch_size"],
        "merge_size": vision["spatial_merge_size"],
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
    }


def video_processor_config(vision: dict) -> dict:
    """video_preprocessor_config.json: transformers' Qwen3VLProcessor also wants its video
    processor (torchvision-gated); the server never reads this file."""
    return {
        "video_processor_type": "Qwen3VLVideoProcessor",
        "processor_class": "Qwen3VLProcessor",
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "patch_size": vision["patch_size"],
        "temporal_patch_size": vision["temporal_patch_size"],
        "merge_size": vision["spatial_merge_size"],
    }


IMAGE_PROCESSOR_CONFIG = image_processor_config(VISION_CONFIG, MIN_PIXELS, MAX_PIXELS)
VIDEO_PROCESSOR_CONFIG = video_processor_config(VISION_CONFIG)

BPE_VOCAB_SIZE = 640  # an upper bound; the small corpus below yields what it yields

# What the BPE learns its merges from: the pipeline's system prompt and prompt-like phrases.
TOKENIZER_CORPUS = [
    "Comprehend and analyze the provided prompt.",
    "A photograph of a cat sitting on a wooden table next to a window, soft morning light.",
    "An oil painting of a lighthouse on a cliff above a stormy sea at night.",
    "A watercolor illustration of a small red fox in the snow, white background.",
    "Replace the background of picture 1 with the sky of picture 2, keep the person.",
    "A cozy kitchen with plants, a teapot and a bowl of oranges, studio lighting, 35mm.",
    "Portrait of an old man with a beard and a blue hat, detailed, realistic, close-up.",
    "A city street in the rain with neon signs and reflections, cinematic, wide angle.",
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "user assistant system image picture the of and with in on at a an is to for",
]

# A compact Qwen3-VL chat template: system, user and assistant turns whose content is a string
# or a list of text and image parts; the pipeline reads the system turn's length from it.
CHAT_TEMPLATE = (
    "{%- set image_count = namespace(value=0) -%}\n"
    "{%- for message in messages -%}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}\n"
    "{%- if message['content'] is string -%}{{- message['content'] -}}\n"
    "{%- else -%}{%- for part in message['content'] -%}\n"
    "{%- if part['type'] == 'image' or 'image' in part -%}\n"
    "{%- set image_count.value = image_count.value + 1 -%}\n"
    "{%- if add_vision_id -%}Picture {{ image_count.value }}: {% endif -%}\n"
    "<|vision_start|><|image_pad|><|vision_end|>\n"
    "{%- elif 'text' in part -%}{{- part['text'] -}}\n"
    "{%- endif -%}{%- endfor -%}{%- endif -%}\n"
    "{{- '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}\n"
)

# Noise given to parameters that start constant (engine/embedded.py's `draw`).
CONSTANT_NOISE = 0.1


class TinyQwenImage21:
    """The whole checkpoint but its scheduler: one noise for every component's constant
    parameters (CONSTANT_NOISE) and the VAE's latent statistics drawn with the weights."""

    recipe = {
        "transformer": TRANSFORMER_CONFIG,
        "vae": VAE_CONFIG,
        "text": TEXT_CONFIG,
        "vision": VISION_CONFIG,
        "image_processor": IMAGE_PROCESSOR_CONFIG,
        "video_processor": VIDEO_PROCESSOR_CONFIG,
        "tokens": [SPECIAL_TOKENS, PLAIN_ADDED_TOKENS, BPE_VOCAB_SIZE, TOKENIZER_CORPUS],
        "chat_template": CHAT_TEMPLATE,
        "sample_sigmas": SAMPLE_SIGMAS,
    }

    def write(self, root: Path, seed: int, noise: None) -> None:
        tokenizer = build_tokenizer()
        rng = np.random.default_rng(seed)
        text_encoder_config = qwen3_vl_config(
            tokenizer,
            TEXT_CONFIG,
            VISION_CONFIG,
            "Qwen3VLForConditionalGeneration",
            bos_token_id="<|endoftext|>",
            eos_token_id="<|im_end|>",
        )
        vae_config = _vae_config(rng)
        components = {
            "transformer": (TRANSFORMER_CONFIG, transformer_tensors(TRANSFORMER_CONFIG)),
            "vae": (vae_config, vae_tensors(vae_config)),
            "text_encoder": (text_encoder_config, qwen3_vl_tensors(text_encoder_config)),
        }
        for name, (config, inventory) in components.items():
            write_drawn(root / name, name, config, inventory, seed, CONSTANT_NOISE)
        write_processor(root / "processor", tokenizer)
        (root / "model_index.json").write_text(dumps(model_index()))


def model_index(sample_sigmas: list[float] | None = SAMPLE_SIGMAS) -> dict:
    """model_index.json of a Qwen-Image 2.1 folder; fixed `sample_sigmas` make it a turbo variant."""
    return {
        "_class_name": "QwenImage21Pipeline",
        "_diffusers_version": DIFFUSERS_FORMAT,
        "processor": ["transformers", "Qwen3VLProcessor"],
        "sample_sigmas": sample_sigmas,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
        "transformer": ["diffusers", "QwenImage21Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLQwenImage21"],
    }


# What decides the folder's files (engine/embedded.py: its stamp's fingerprint).
RECIPE = Recipe(MODEL_NAME, None, (TinyQwenImage21(),), {"scheduler": SCHEDULER_CONFIG})
ensure_embedded_model = RECIPE.ensure
write_embedded_model = RECIPE.write_folder


# ---- weights ------------------------------------------------------------------------------


def transformer_tensors(config: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Names, shapes and kinds of QwenImage21Transformer2DModel's parameters for `config`: the
    DiT's own table (layout.tensor_shapes), its zero-centred text norm drawn as SHIFT."""
    inventory = table_inventory(tensor_shapes(DiTConfig.from_dict(config)), GAIN)
    inventory[TEXT_NORM] = (inventory[TEXT_NORM][0], SHIFT)
    return inventory


def _vae_config(rng) -> dict:
    """The VAE config with per-channel latent statistics drawn away from 0 and 1, so a loader
    that skips the normalisation shows."""
    z_dim = VAE_CONFIG["z_dim"]
    means = rng.standard_normal(z_dim) * 0.5
    stds = 0.5 + rng.random(z_dim) * 2.0
    return {
        **VAE_CONFIG,
        "latents_mean": [round(float(v), 4) for v in means],
        "latents_std": [round(float(v), 4) for v in stds],
    }


def vae_tensors(config: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Names, shapes and kinds of AutoencoderKLQwenImage21's parameters (the residual form with no
    attention scales and no patching, as Qwen-Image 2.1 ships it) for `config`."""
    if not config["is_residual"] or config["attn_scales"] or config["patch_size"] not in (None, 1):
        raise ValueError("only the residual VAE without attention scales or patching is described")
    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    z_dim, mults, blocks = config["z_dim"], config["dim_mult"], config["num_res_blocks"]
    last = len(mults) - 1

    # Encoder: dims base x [1, *mults]; every stage but the last downsamples by 2.
    dims = [config["base_dim"] * m for m in [1, *mults]]
    _conv(tensors, "encoder.conv_in", config["in_channels"], dims[0], 3)
    for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:], strict=False)):
        prefix = f"encoder.down_blocks.{i}"
        for r in range(blocks):
            _residual(tensors, f"{prefix}.resnets.{r}", in_dim if r == 0 else out_dim, out_dim)
        if i != last:
            _conv(tensors, f"{prefix}.downsampler.resample.1", out_dim, out_dim, 3)
            if config["temperal_downsample"][i]:
                _conv(tensors, f"{prefix}.downsampler.time_conv", out_dim, out_dim, 1)
    _mid_block(tensors, "encoder.mid_block", dims[-1])
    _norm(tensors, "encoder.norm_out", dims[-1], images=False)
    _conv(tensors, "encoder.conv_out", dims[-1], 2 * z_dim, 3)
    _conv(tensors, "quant_conv", 2 * z_dim, 2 * z_dim, 1)
    _conv(tensors, "post_quant_conv", z_dim, z_dim, 1)

    # Decoder: dims decoder_base x [mults[-1], *reversed(mults)]; every stage but the last
    # upsamples by 2, with a time conv where the reversed temporal flags say so.
    base = config["decoder_base_dim"] or config["base_dim"]
    dims = [base * m for m in [mults[-1], *mults[::-1]]]
    temporal_up = config["temperal_downsample"][::-1]
    _conv(tensors, "decoder.conv_in", z_dim, dims[0], 3)
    _mid_block(tensors, "decoder.mid_block", dims[0])
    for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:], strict=False)):
        prefix = f"decoder.up_blocks.{i}"
        for r in range(blocks + 1):
            _residual(tensors, f"{prefix}.resnets.{r}", in_dim if r == 0 else out_dim, out_dim)
        if i != last:
            _conv(tensors, f"{prefix}.upsampler.resample.1", out_dim, out_dim, 3)
            if temporal_up[i]:
                _conv(tensors, f"{prefix}.upsampler.time_conv", out_dim, 2 * out_dim, 1)
    _norm(tensors, "decoder.norm_out", dims[-1], images=False)
    _conv(tensors, "decoder.conv_out", dims[-1], config["out_channels"], 3)
    return tensors


def _conv(tensors: dict, prefix: str, in_dim: int, out_dim: int, kernel: int) -> None:
    # The VAE's "3D" convolutions are stored as 2D kernels: the checkpoint is single-frame.
    tensors[f"{prefix}.weight"] = ((out_dim, in_dim, kernel, kernel), MATRIX)
    tensors[f"{prefix}.bias"] = ((out_dim,), SHIFT)


def _norm(tensors: dict, prefix: str, dim: int, images: bool) -> None:
    # RMS-norm gains broadcast over (H, W) for images, over (T, H, W) otherwise.
    tensors[f"{prefix}.gamma"] = ((dim, 1, 1) if images else (dim, 1, 1, 1), GAIN)


def _residual(tensors: dict, prefix: str, in_dim: int, out_dim: int) -> None:
    _norm(tensors, f"{prefix}.norm1", in_dim, images=False)
    _conv(tensors, f"{prefix}.conv1", in_dim, out_dim, 3)
    _norm(tensors, f"{prefix}.norm2", out_dim, images=False)
    _conv(tensors, f"{prefix}.conv2", out_dim, out_dim, 3)
    if in_dim != out_dim:
        _conv(tensors, f"{prefix}.conv_shortcut", in_dim, out_dim, 1)


def _mid_block(tensors: dict, prefix: str, dim: int) -> None:
    _residual(tensors, f"{prefix}.resnets.0", dim, dim)
    _norm(tensors, f"{prefix}.attentions.0.norm", dim, images=True)
    _conv(tensors, f"{prefix}.attentions.0.to_qkv", dim, 3 * dim, 1)
    _conv(tensors, f"{prefix}.attentions.0.proj", dim, dim, 1)
    _residual(tensors, f"{prefix}.resnets.1", dim, dim)


# ---- tokenizer and processor files --------------------------------------------------------


def build_tokenizer(
    corpus: list[str] = TOKENIZER_CORPUS, vocab_size: int = BPE_VOCAB_SIZE
) -> Tokenizer:
    """The embedded model's tokenizer (`tiny_tokenizer.train_tokenizer`), by default on its
    own corpus."""
    return train_tokenizer(corpus, vocab_size)


def write_processor(
    folder: Path,
    tokenizer: Tokenizer,
    vision: dict = VISION_CONFIG,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
) -> None:
    """Write a Qwen3-VL processor folder: `tokenizer`, its config, the chat template and the
    image and video processor configs for the vision tower `vision`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n")
    ids = token_ids(tokenizer)
    added = {
        str(ids[token]): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token in SPECIAL_TOKENS,
        }
        for token in SPECIAL_TOKENS + PLAIN_ADDED_TOKENS
    }
    tokenizer_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "processor_class": "Qwen3VLProcessor",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 262144,
        "split_special_tokens": False,
    }
    image_config = image_processor_config(vision, min_pixels, max_pixels)
    (folder / "tokenizer_config.json").write_text(dumps(tokenizer_config))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (folder / "preprocessor_config.json").write_text(dumps(image_config))
    (folder / "video_preprocessor_config.json").write_text(dumps(video_processor_config(vision)))
