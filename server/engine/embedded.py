"""What the embedded random-weight models share: a folder generated on first use, stamped and
moved into place atomically, and weights drawn so that every input visibly moves the output.

An embedded model's module (a family folder's `embedded.py`, found by its name)
provides its `RECIPE`: `RECIPE.name`, and `RECIPE.ensure(cache_dir=None)` -> its folder under
`default_cache_dir()`. A `Recipe` is the folder as data: its parts (`Drawn` components
and shared pairs such as `TinyQwen3VL`, each with what decides its files), its JSON documents
and the rest; the folder is written (`write_folder`) into a temporary folder renamed into
place, with a stamp whose fingerprint covers the generator's version, seed, noise and every
part's recipe: a different generator regenerates, the same one reuses the folder. Made with
numpy, safetensors and tokenizers only (no torch, diffusers or transformers).

Weights: default initialisation makes the prompt move the output by about 0.1 %, so matrices
get a full 1/sqrt(fan_in) spread (MATRIX), and parameters that start constant get a little
noise around one (GAIN: norm scales) or zero (SHIFT: biases, pad tokens), as the project's tiny
test checkpoints do.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
from safetensors.numpy import save_file

from .cache_home import cache_home
from .encoders.qwen3.tiny_tokenizer import (
    BPE_VOCAB_SIZE,
    CHAT_TEMPLATE,
    PLAIN_ADDED_TOKENS,
    SPECIAL_TOKENS,
    TOKENIZER_CORPUS,
    token_ids,
    train_tokenizer,
    write_tokenizer,
)

STAMP_FILE = "gmlx_embedded.json"
# The diffusers release whose file layout and config keys the embedded folders follow.
DIFFUSERS_FORMAT = "0.42.1"
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
TRANSFORMERS_WEIGHTS = "model.safetensors"
MATRIX, GAIN, SHIFT = "matrix", "gain", "shift"
SEED = 0  # what every embedded model's weights are drawn from

Inventory = dict[str, tuple[tuple[int, ...], str]]  # tensor name -> (shape, kind)


def default_cache_dir() -> Path:
    """The embedded models' folder in the user's cache (cache_home: ~/.cache/gmlx-steps)."""
    return cache_home() / "models"


class Part(Protocol):
    """One component of an embedded folder (or two that go together, a tokenizer and its text
    encoder): what decides its files (`recipe`, entries of the stamp's fingerprint) and how
    it writes them into the folder, drawn from the seed with the recipe's noise."""

    recipe: dict

    def write(self, root: Path, seed: int, noise: dict[str, float] | None) -> None: ...


@dataclass(frozen=True)
class Drawn:
    """A component drawn from its inventory: root/<component>/config.json and its weights
    (`write_drawn`, the recipe's noise for the component); `undrawn`: tensors written as
    they are."""

    component: str
    config: dict
    inventory: Inventory
    undrawn: dict | None = None

    @property
    def recipe(self) -> dict:
        return {self.component: self.config}

    def write(self, root: Path, seed: int, noise: dict[str, float]) -> None:
        folder = root / self.component
        draws = (self.component, self.config, self.inventory, seed, noise[self.component])
        write_drawn(folder, *draws, self.undrawn)


# Where a recipe's documents are written, by their entry in its stamp.
DOCUMENT_PATHS = {"scheduler": "scheduler/scheduler_config.json", "model_index": "model_index.json"}


@dataclass(frozen=True)
class Recipe:
    """An embedded model's name and what decides its folder's files: each component's
    constant noise (`draw`; None for a model that draws its own way), its parts (`Part`s),
    its JSON documents (by DOCUMENT_PATHS' names), anything else (`extra`), the generator's
    version (a module passes the next one when its code writes something different for the
    same recipe) and the seed, all fingerprinted in its stamp."""

    name: str
    noise: dict[str, float] | None
    parts: tuple[Part, ...]
    documents: dict[str, dict] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    generator: int = 1
    seed: int = SEED

    def stamp(self) -> dict:
        """Who made the folder: its name, the generator's version and a fingerprint of the
        recipe."""
        noise = {} if self.noise is None else {"noise": self.noise}
        entries = {k: v for part in self.parts for k, v in part.recipe.items()}
        recipe = {
            "generator": self.generator,
            "seed": self.seed,
            **noise,
            **self.extra,
            **entries,
            **self.documents,
        }
        fingerprint = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()
        return {
            "name": self.name,
            "note": "random weights from a fixed seed, for trying the pipeline; not a trained model",
            "generator": self.generator,
            "fingerprint": fingerprint,
        }

    def folder(self, cache_dir: Path | None = None) -> Path:
        """Where `ensure` keeps the folder: under `cache_dir` (default: `default_cache_dir()`)."""
        return (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / self.name

    def ensure(self, cache_dir: Path | None = None) -> Path:
        """The model's folder under `cache_dir` (default: `default_cache_dir()`), generated
        first if it is missing or was made by a different generator."""
        return ensure(cache_dir, self.name, self.stamp(), self.write_folder)

    def write_folder(self, root: Path, seed: int | None = None) -> None:
        """Write every file of the folder into `root` (created if missing), its weights drawn
        from `seed` (default: the recipe's)."""
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        seed = self.seed if seed is None else seed
        for part in self.parts:
            part.write(root, seed, self.noise)
        for entry, document in self.documents.items():
            path = root / DOCUMENT_PATHS[entry]
            path.parent.mkdir(exist_ok=True)
            path.write_text(dumps(document))


def ensure(cache_dir: Path | None, name: str, wanted: dict, write: Callable[[Path], None]) -> Path:
    """The folder `name` under `cache_dir` (default: `default_cache_dir()`) stamped `wanted`,
    written first by `write(folder)` if it is missing or was made by a different generator."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / name
    if read_stamp(target) == wanted:
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_builds(cache_dir, name)
    building = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir))
    try:
        write(building)
        (building / STAMP_FILE).write_text(dumps(wanted))
        _move_into_place(building, target, wanted)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return target


def read_stamp(folder: Path) -> dict | None:
    try:
        return json.loads((folder / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None


def _remove_abandoned_builds(cache_dir: Path, name: str, older_than_s: float = 3600.0) -> None:
    """Temporary folders that an interrupted generation left behind (a live one is seconds old)."""
    cutoff = time.time() - older_than_s
    for folder in cache_dir.glob(f".{name}-*"):
        try:
            if folder.is_dir() and folder.stat().st_mtime < cutoff:
                shutil.rmtree(folder, ignore_errors=True)
        except OSError:
            pass


def _move_into_place(building: Path, target: Path, wanted: dict) -> None:
    """Rename the finished folder to `target`; an outdated `target` is moved aside first. If
    another process placed a current one meanwhile, keep theirs."""
    if target.exists():
        if read_stamp(target) == wanted:
            return
        outdated = Path(tempfile.mkdtemp(prefix=f".{target.name}-old-", dir=target.parent))
        os.replace(target, outdated / target.name)
        shutil.rmtree(outdated, ignore_errors=True)
    try:
        os.rename(building, target)
    except OSError:
        if read_stamp(target) != wanted:
            raise


def draw(inventory: Inventory, rng, constant_noise: float) -> dict[str, np.ndarray]:
    """Random float32 tensors for an inventory, in sorted-name order: MATRIX ~ N(0, 1/fan_in),
    GAIN ~ 1 + constant_noise N(0, 1), SHIFT ~ constant_noise N(0, 1)."""
    weights = {}
    for name in sorted(inventory):
        shape, kind = inventory[name]
        noise = rng.standard_normal(shape, dtype=np.float32)
        if kind == MATRIX:
            fan_in = int(np.prod(shape[1:]))
            weights[name] = noise / np.float32(np.sqrt(fan_in))
        elif kind == GAIN:
            weights[name] = np.float32(1.0) + np.float32(constant_noise) * noise
        else:
            weights[name] = np.float32(constant_noise) * noise
    return weights


# Each component's weights draw from a stream of their own, [seed, index], so a component
# written alone equals the same component of a whole folder of that seed.
COMPONENT_INDEX = {"transformer": 0, "vae": 1, "text_encoder": 2}
# The noise a recipe gives the parameters that start constant (`draw`), per component: the
# DiTs' pad tokens and norms need more to matter.
CONSTANT_NOISE = {"transformer": 0.3, "vae": 0.1, "text_encoder": 0.1}
# The width of the tiny text encoders (Qwen3, Qwen3-VL's and Qwen3.5's language models).
TINY_TEXT_WIDTH = 32
# The tiny Qwen3 the embedded models prompt with (transformers' Qwen3ForCausalLM config; its
# vocabulary and token ids come from the tiny tokenizer, its depth from the family).
TINY_QWEN3_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "dtype": "float32",
    "hidden_size": TINY_TEXT_WIDTH,
    "intermediate_size": 64,
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
}

# The body of a tiny AutoencoderKL (diffusers' class, FLUX.1's VAE, and the FLUX.2 VAE's
# body): RGB in and out, four blocks to a widest stage of 32 channels (stride 8), one attention
# in each mid block.
TINY_AUTOENCODER_KL_BODY = {
    "_diffusers_version": DIFFUSERS_FORMAT,
    "act_fn": "silu",
    "in_channels": 3,
    "out_channels": 3,
    "block_out_channels": [16, 32, 32, 32],  # four blocks: stride 8
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "norm_num_groups": 8,
    "mid_block_add_attention": True,
}
# A tiny AutoencoderKLFlux2 (FLUX.2 klein's and FLUX.3 klein's VAE): the real 32 latent channels
# at stride 8, patchified 2x2 under its batch norm, a widest stage of 32 channels.
TINY_FLUX2_VAE_CONFIG = {
    "_class_name": "AutoencoderKLFlux2",
    **TINY_AUTOENCODER_KL_BODY,
    "latent_channels": 32,
    "layers_per_block": 1,
    "use_quant_conv": True,
    "use_post_quant_conv": True,
    "batch_norm_eps": 0.0001,
    "batch_norm_momentum": 0.1,
    "patch_size": [2, 2],
    "sample_size": 1024,
    "force_upcast": True,
}
# Its batch norm over the patchified latents: statistics of its own (running_var positive).
FLUX2_BATCH_NORM = {"bn.running_mean": SHIFT, "bn.running_var": GAIN}
# The VAE's batch-norm step counter, which nothing reads, is written, not drawn.
FLUX2_VAE_UNDRAWN = {"bn.num_batches_tracked": np.array(0, np.int64)}


def flux2_vae_tensors(config: dict = TINY_FLUX2_VAE_CONFIG) -> Inventory:
    """AutoencoderKLFlux2's parameters: the AutoencoderKL body and the batch norm's statistics."""
    channels = 4 * config["latent_channels"]
    return {
        **autoencoder_kl_tensors(config),
        **{name: ((channels,), kind) for name, kind in FLUX2_BATCH_NORM.items()},
    }


def table_inventory(shapes: dict[str, tuple[int, ...]], vectors: str) -> Inventory:
    """A network's inventory from its own table of shapes: its matrices drawn as MATRIX, its
    vectors as `vectors` (GAIN: norm scales around one; SHIFT: biases, or scales around 0)."""
    return {name: (shape, MATRIX if len(shape) > 1 else vectors) for name, shape in shapes.items()}


def interleaved_mrope(theta: float, sections: list[int]) -> dict:
    """A Qwen3-VL text config's `rope_parameters`: multimodal RoPE of base `theta` whose
    (T, H, W) `sections` (summing to half the head) are interleaved."""
    return {
        "rope_type": "default",
        "rope_theta": theta,
        "mrope_section": sections,
        "mrope_interleaved": True,
    }


# Qwen3VLModel over the tiny Qwen3's text width: four layers, interleaved multimodal RoPE
# sections of its 8-wide heads, and a one-block vision tower (loaded, never run by a family that reads text alone).
TINY_QWEN3_VL_TEXT = {
    **{k: v for k, v in TINY_QWEN3_CONFIG.items() if k not in ("architectures", "model_type")},
    "num_hidden_layers": 4,
    "rope_parameters": interleaved_mrope(1000000.0, [2, 1, 1]),
}
# The layers a DiT over the tiny Qwen3-VL taps: the hidden states after the first three of
# its four (as the real pipelines tap layers spread over the encoder's depth).
TINY_QWEN3_VL_TAPS = [1, 2, 3]
TINY_QWEN3_VL_VISION = {
    "depth": 1,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": TINY_TEXT_WIDTH,
    "num_position_embeddings": 16,
    "deepstack_visual_indexes": [0],
}


def qwen3_vl_config(
    tokenizer, text: dict, vision: dict, architecture: str, **special_ids: str
) -> dict:
    """A Qwen3-VL checkpoint's config (`architecture`'s) for a `text` and a `vision` config,
    with the token ids of `tokenizer`: the vision tokens', the pad token's (<|endoftext|>) and
    any other `special_ids` of the text config (name -> token)."""
    ids = token_ids(tokenizer)
    special = {name: ids[token] for name, token in special_ids.items()}
    return {
        "architectures": [architecture],
        "model_type": "qwen3_vl",
        "dtype": "float32",
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "tie_word_embeddings": False,
        "text_config": {
            **text,
            "vocab_size": tokenizer.get_vocab_size(),
            **special,
            "pad_token_id": ids["<|endoftext|>"],
        },
        "vision_config": dict(vision),
    }


class TinyTextEncoder(ABC):
    """root/tokenizer, the tests' Qwen tokenizer, and root/text_encoder drawn from its stream:
    a subclass says its config from the tokenizer (`config_of`) and its inventory from that
    config (`tensors_of`)."""

    def write(self, root: Path, seed: int, noise: dict[str, float]) -> None:
        tokenizer = train_tokenizer(TOKENIZER_CORPUS, BPE_VOCAB_SIZE)
        write_tokenizer(root / "tokenizer", tokenizer)
        config = self.config_of(tokenizer)
        Drawn("text_encoder", config, self.tensors_of(config)).write(root, seed, noise)

    @abstractmethod
    def config_of(self, tokenizer) -> dict: ...

    @abstractmethod
    def tensors_of(self, config: dict) -> Inventory: ...


class TinyQwen3VL(TinyTextEncoder):
    """The text encoder of a family whose text encoder is the tiny Qwen3-VL (TINY_QWEN3_VL_*),
    which it runs on text alone: the Qwen3VLModel's weights, their names without a prefix and
    no language-model head."""

    recipe = {
        "text": TINY_QWEN3_VL_TEXT,
        "vision": TINY_QWEN3_VL_VISION,
        "tokens": [BPE_VOCAB_SIZE, TOKENIZER_CORPUS],
        "chat_template": CHAT_TEMPLATE,
    }

    def config_of(self, tokenizer) -> dict:
        return qwen3_vl_config(tokenizer, TINY_QWEN3_VL_TEXT, TINY_QWEN3_VL_VISION, "Qwen3VLModel")

    def tensors_of(self, config: dict) -> Inventory:
        return qwen3_vl_tensors(config, "", False)


@dataclass(frozen=True)
class TinyQwen3(TinyTextEncoder):
    """A Qwen3ForCausalLM of `config` (TINY_QWEN3_CONFIG at a family's depth), its vocabulary
    the tokenizer's, no special token ids set."""

    config: dict

    @property
    def recipe(self) -> dict:
        tokens = [SPECIAL_TOKENS, PLAIN_ADDED_TOKENS, BPE_VOCAB_SIZE, TOKENIZER_CORPUS]
        return {"text": self.config, "tokens": tokens, "chat_template": CHAT_TEMPLATE}

    def config_of(self, tokenizer) -> dict:
        text = {**self.config, "vocab_size": tokenizer.get_vocab_size()}
        return {**text, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}

    def tensors_of(self, config: dict) -> Inventory:
        return qwen3_tensors(config)


def write_drawn(
    folder: Path,
    component: str,
    config: dict,
    inventory: Inventory,
    seed: int,
    noise: float,
    extra: dict | None = None,
) -> None:
    """A component's folder: its config and the weights drawn for its inventory from its own
    stream (`extra`: tensors beside them, such as a buffer that is not drawn), in diffusers' or
    (the text encoder) transformers' file name."""
    weights = draw(inventory, np.random.default_rng([seed, COMPONENT_INDEX[component]]), noise)
    weights.update(extra or {})
    file_name = TRANSFORMERS_WEIGHTS if component == "text_encoder" else DIFFUSERS_WEIGHTS
    write_component(folder, config, weights, file_name)


def write_component(folder: Path, config: dict, weights: dict, file_name: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(dumps(config))
    save_file(weights, str(folder / file_name), metadata={"format": "pt"})


def dumps(document: dict) -> str:
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


# ---- the inventories of the parts several families' embedded models share ----------------
# (diffusers' AutoencoderKL, the FLUX.1 and FLUX.2 body, and AutoencoderKLQwenImage;
# transformers' Qwen3ForCausalLM and Qwen3-VL)


def block_stack_tensors(
    tensors: Inventory, stack: str, dims: list, resnets: int, resamplers: str
) -> None:
    """AutoencoderKL's down (or up) blocks: `resnets` resnets a block at its width, the first
    from the block before's width, and a resampling conv after every block but the last."""
    for i, out_dim in enumerate(dims):
        prefix = f"{stack}.{i}"
        for r in range(resnets):
            in_dim = dims[max(i - 1, 0)] if r == 0 else out_dim
            resnet_tensors(tensors, f"{prefix}.resnets.{r}", in_dim, out_dim)
        if i != len(dims) - 1:
            conv_tensors(tensors, f"{prefix}.{resamplers}.0.conv", out_dim, out_dim, 3)


def autoencoder_kl_tensors(config: dict) -> Inventory:
    """Names, shapes and kinds of AutoencoderKL's parameters (its down and up encoder blocks,
    one attention in each mid block) for `config`."""
    tensors: Inventory = {}
    dims, blocks = list(config["block_out_channels"]), config["layers_per_block"]
    latent = config["latent_channels"]
    conv_tensors(tensors, "encoder.conv_in", config["in_channels"], dims[0], 3)
    block_stack_tensors(tensors, "encoder.down_blocks", dims, blocks, "downsamplers")
    mid_block_tensors(tensors, "encoder.mid_block", dims[-1])
    norm_tensors(tensors, "encoder.conv_norm_out", dims[-1])
    conv_tensors(tensors, "encoder.conv_out", dims[-1], 2 * latent, 3)
    if config.get("use_quant_conv", True):
        conv_tensors(tensors, "quant_conv", 2 * latent, 2 * latent, 1)
    if config.get("use_post_quant_conv", True):
        conv_tensors(tensors, "post_quant_conv", latent, latent, 1)
    dims = list(config.get("decoder_block_out_channels") or dims)[::-1]
    conv_tensors(tensors, "decoder.conv_in", latent, dims[0], 3)
    mid_block_tensors(tensors, "decoder.mid_block", dims[0])
    block_stack_tensors(tensors, "decoder.up_blocks", dims, blocks + 1, "upsamplers")
    norm_tensors(tensors, "decoder.conv_norm_out", dims[-1])
    conv_tensors(tensors, "decoder.conv_out", dims[-1], config["out_channels"], 3)
    return tensors


def qwen3_tensors(config: dict) -> Inventory:
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


def qwen3_vl_tensors(config: dict, prefix: str = "model.", head: bool = True) -> Inventory:
    """Names, shapes and kinds of Qwen3-VL's parameters for `config`: its language model and
    vision tower under `prefix` (Qwen3VLForConditionalGeneration's "model.", with its `lm_head`
    when `head`; Qwen3VLModel's "" without)."""
    text, vision = config["text_config"], config["vision_config"]
    lm = f"{prefix}language_model"
    tensors = {
        name.replace("model.", f"{lm}.", 1): value
        for name, value in qwen3_tensors(text).items()
        if head or name != "lm_head.weight"
    }
    width, patch = vision["hidden_size"], vision["patch_size"]
    merged = width * vision["spatial_merge_size"] ** 2
    visual = f"{prefix}visual"
    patch_shape = (width, vision["in_channels"], vision["temporal_patch_size"], patch, patch)
    tensors[f"{visual}.patch_embed.proj.weight"] = (patch_shape, MATRIX)
    tensors[f"{visual}.patch_embed.proj.bias"] = ((width,), SHIFT)
    tensors[f"{visual}.pos_embed.weight"] = ((vision["num_position_embeddings"], width), MATRIX)
    for block in range(vision["depth"]):
        block_prefix = f"{visual}.blocks.{block}"
        norm_tensors(tensors, f"{block_prefix}.norm1", width)
        norm_tensors(tensors, f"{block_prefix}.norm2", width)
        linear_tensors(tensors, f"{block_prefix}.attn.qkv", width, 3 * width)
        linear_tensors(tensors, f"{block_prefix}.attn.proj", width, width)
        linear_tensors(
            tensors, f"{block_prefix}.mlp.linear_fc1", width, vision["intermediate_size"]
        )
        linear_tensors(
            tensors, f"{block_prefix}.mlp.linear_fc2", vision["intermediate_size"], width
        )
    # The final merger normalises before the 2x2 shuffle, the deepstack mergers after it.
    _merger_tensors(tensors, f"{visual}.merger", merged, vision["out_hidden_size"], norm=width)
    for index in range(len(vision["deepstack_visual_indexes"])):
        merger = f"{visual}.deepstack_merger_list.{index}"
        _merger_tensors(tensors, merger, merged, vision["out_hidden_size"], norm=merged)
    return tensors


def _merger_tensors(tensors: Inventory, prefix: str, merged: int, out: int, norm: int) -> None:
    norm_tensors(tensors, f"{prefix}.norm", norm)
    linear_tensors(tensors, f"{prefix}.linear_fc1", merged, merged)
    linear_tensors(tensors, f"{prefix}.linear_fc2", merged, out)


def qwen_image_vae_tensors(config: dict) -> Inventory:
    """Names, shapes and kinds of AutoencoderKLQwenImage's parameters for `config` (Wan 2.1's
    layout: causal 3D kernels, 2D resampling convolutions, a temporal conv beside each temporal
    resample, RMS gains broadcast over (T, H, W), or over (H, W) in the attentions)."""
    tensors: Inventory = {}
    base, mults = config["base_dim"], list(config["dim_mult"])
    z_dim, blocks, temporal = (
        config["z_dim"],
        config["num_res_blocks"],
        config["temperal_downsample"],
    )
    channels = config.get("input_channels", 3)
    dims = [base * m for m in [1, *mults]]
    last = len(mults) - 1
    _causal(tensors, "encoder.conv_in", channels, dims[0], 3)
    index = 0
    for i in range(len(mults)):
        in_dim = dims[i]
        for _ in range(blocks):
            _wan_residual(tensors, f"encoder.down_blocks.{index}", in_dim, dims[i + 1])
            in_dim, index = dims[i + 1], index + 1
        if i != last:
            _resample(
                tensors, f"encoder.down_blocks.{index}", dims[i + 1], dims[i + 1], temporal[i], 1
            )
            index += 1
    _wan_mid(tensors, "encoder.mid_block", dims[-1])
    tensors["encoder.norm_out.gamma"] = ((dims[-1], 1, 1, 1), GAIN)
    _causal(tensors, "encoder.conv_out", dims[-1], 2 * z_dim, 3)
    _causal(tensors, "quant_conv", 2 * z_dim, 2 * z_dim, 1)
    _causal(tensors, "post_quant_conv", z_dim, z_dim, 1)
    up = [base * m for m in [mults[-1], *mults[::-1]]]
    _causal(tensors, "decoder.conv_in", z_dim, up[0], 3)
    _wan_mid(tensors, "decoder.mid_block", up[0])
    for i in range(len(mults)):
        in_dim = up[i] if i == 0 else up[i] // 2
        for r in range(blocks + 1):
            _wan_residual(tensors, f"decoder.up_blocks.{i}.resnets.{r}", in_dim, up[i + 1])
            in_dim = up[i + 1]
        if i != last:
            prefix = f"decoder.up_blocks.{i}.upsamplers.0"
            _resample(tensors, prefix, up[i + 1], up[i + 1] // 2, temporal[::-1][i], 2)
    tensors["decoder.norm_out.gamma"] = ((up[-1], 1, 1, 1), GAIN)
    _causal(tensors, "decoder.conv_out", up[-1], channels, 3)
    return tensors


def _causal(tensors: Inventory, prefix: str, in_dim: int, out_dim: int, kernel: int) -> None:
    tensors[f"{prefix}.weight"] = ((out_dim, in_dim, kernel, kernel, kernel), MATRIX)
    tensors[f"{prefix}.bias"] = ((out_dim,), SHIFT)


def _wan_residual(tensors: Inventory, prefix: str, in_dim: int, out_dim: int) -> None:
    tensors[f"{prefix}.norm1.gamma"] = ((in_dim, 1, 1, 1), GAIN)
    _causal(tensors, f"{prefix}.conv1", in_dim, out_dim, 3)
    tensors[f"{prefix}.norm2.gamma"] = ((out_dim, 1, 1, 1), GAIN)
    _causal(tensors, f"{prefix}.conv2", out_dim, out_dim, 3)
    if in_dim != out_dim:
        _causal(tensors, f"{prefix}.conv_shortcut", in_dim, out_dim, 1)


def _wan_mid(tensors: Inventory, prefix: str, dim: int) -> None:
    _wan_residual(tensors, f"{prefix}.resnets.0", dim, dim)
    tensors[f"{prefix}.attentions.0.norm.gamma"] = ((dim, 1, 1), GAIN)
    conv_tensors(tensors, f"{prefix}.attentions.0.to_qkv", dim, 3 * dim, 1)
    conv_tensors(tensors, f"{prefix}.attentions.0.proj", dim, dim, 1)
    _wan_residual(tensors, f"{prefix}.resnets.1", dim, dim)


def _resample(
    tensors: Inventory, prefix: str, dim: int, out_dim: int, temporal: bool, time_factor: int
) -> None:
    """A Resample: its 2D convolution (`resample.1`) and, temporal, its causal time conv
    (downsampling: dim to dim; upsampling: dim to time_factor x dim, both of kernel (3, 1, 1))."""
    conv_tensors(tensors, f"{prefix}.resample.1", dim, out_dim, 3)
    if temporal:
        time_out = dim * time_factor
        tensors[f"{prefix}.time_conv.weight"] = ((time_out, dim, 3, 1, 1), MATRIX)
        tensors[f"{prefix}.time_conv.bias"] = ((time_out,), SHIFT)


def linear_tensors(tensors: Inventory, prefix: str, in_dim: int, out_dim: int) -> None:
    tensors[f"{prefix}.weight"] = ((out_dim, in_dim), MATRIX)
    tensors[f"{prefix}.bias"] = ((out_dim,), SHIFT)


def conv_tensors(tensors: Inventory, prefix: str, in_dim: int, out_dim: int, kernel: int) -> None:
    tensors[f"{prefix}.weight"] = ((out_dim, in_dim, kernel, kernel), MATRIX)
    tensors[f"{prefix}.bias"] = ((out_dim,), SHIFT)


def norm_tensors(tensors: Inventory, prefix: str, dim: int) -> None:
    tensors[f"{prefix}.weight"] = ((dim,), GAIN)
    tensors[f"{prefix}.bias"] = ((dim,), SHIFT)


def resnet_tensors(tensors: Inventory, prefix: str, in_dim: int, out_dim: int) -> None:
    norm_tensors(tensors, f"{prefix}.norm1", in_dim)
    conv_tensors(tensors, f"{prefix}.conv1", in_dim, out_dim, 3)
    norm_tensors(tensors, f"{prefix}.norm2", out_dim)
    conv_tensors(tensors, f"{prefix}.conv2", out_dim, out_dim, 3)
    if in_dim != out_dim:
        conv_tensors(tensors, f"{prefix}.conv_shortcut", in_dim, out_dim, 1)


def mid_block_tensors(tensors: Inventory, prefix: str, dim: int) -> None:
    resnet_tensors(tensors, f"{prefix}.resnets.0", dim, dim)
    norm_tensors(tensors, f"{prefix}.attentions.0.group_norm", dim)
    for name in ("to_q", "to_k", "to_v", "to_out.0"):
        linear_tensors(tensors, f"{prefix}.attentions.0.{name}", dim, dim)
    resnet_tensors(tensors, f"{prefix}.resnets.1", dim, dim)


# The tiny FLUX.2 VAE (TINY_FLUX2_VAE_CONFIG) as a part of a folder.
TINY_FLUX2_VAE = Drawn("vae", TINY_FLUX2_VAE_CONFIG, flux2_vae_tensors(), FLUX2_VAE_UNDRAWN)
