"""Qwen3-VL in MLX: the Qwen3 decoder (text.py) and the vision tower (vision.py) composed, as
transformers' `Qwen3VLForConditionalGeneration` runs them to encode a prompt with images.

The vision tower turns each image into merged patch rows (plus DeepStack features from some of
its blocks); those replace the image-pad embeddings, the DeepStack features are added to the
image rows after the first decoder layers, and positions follow Qwen3-VL's multimodal RoPE.
Weights load by transformers' names; `lm_head` and the final norm are unused.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import gguf as gguf_names
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from gguf import MODEL_ARCH, MODEL_TENSOR
from mlx.utils import tree_flatten

from ...module_files import ModuleFiles, llama_cpp_names
from ...nn.dtypes import tree_bytes
from ...nn.rope import cos_sin
from ...precision import Quantization
from ...spec import model_index
from ...weights import gguf_file, load_module, load_weights, read_config
from ..prompt import PromptEncoder
from .text import TextConfig, TextModel
from .vision import VisionConfig, VisionModel


class VisionInput(Protocol):
    """One preprocessed image (processor.VisionPreprocessor.preprocess)."""

    pixel_values: np.ndarray  # (N, C*T*P*P) float32
    grid_thw: tuple[int, int, int]


class Qwen3VLEncoder(nn.Module):
    """The parts of `Qwen3VLForConditionalGeneration` the encode path runs; without a `vision`
    config the language model alone (a family that reads text alone: its vision tower never
    loads)."""

    def __init__(self, text: TextConfig, vision: VisionConfig | None):
        super().__init__()
        self.language_model = TextModel(text)
        if vision is not None:
            self.visual = VisionModel(vision)

    @classmethod
    def load(
        cls,
        component_dir: Path,
        dtype: mx.Dtype = mx.float32,
        quantization: Quantization | None = None,
        quantized: Callable[[str], bool] | None = None,
        gguf: tuple[Path, Path] | None = None,
        text_only: bool = False,
    ) -> tuple[Qwen3VLEncoder, int]:
        """The encoder of a transformers folder (its config.json), and the bytes of its loaded
        weights; the weights from the folder's safetensors or from `gguf`, llama.cpp's pair of
        files (the language model, its `mmproj` vision tower: `gguf_files`), kept quantized as
        they hold them. With a `quantization`, the float linear layers whose module path
        `quantized` picks (the family's choice) are quantized as they load
        (quantize.quantize_module); a folder stored quantized loads as stored. `text_only`: the
        vision tower is not loaded (a GGUF "pair" may then be the language model's file alone,
        its mmproj None)."""
        config = read_config(component_dir)
        vision = None if text_only else config["vision_config"]
        encoder = cls(
            TextConfig.from_dict(config["text_config"]),
            None if vision is None else VisionConfig.from_dict(vision),
        )
        include = language_model_tensor if vision is None else None

        def from_folder() -> dict:
            return sanitize(load_weights(component_dir, dtype, include=include))

        from_gguf = None if gguf is None else lambda: gguf_weights(encoder, *gguf, dtype)
        load_module(encoder, component_dir, quantization, quantized, from_gguf, from_folder)
        return encoder, tree_bytes(encoder.parameters())

    def hidden_states(
        self,
        ids: np.ndarray,
        spans: list[tuple[int, int]],
        images: list[VisionInput],
        taps: tuple[int, ...] = (-1,),
        positions: np.ndarray | None = None,
        valid_keys: int | None = None,
    ) -> list[mx.array]:
        """(L, D) states after the decoder layers `taps` names (before the final norm) for the
        expanded ids; image i's rows are ids[spans[i][0]:spans[i][1]]. `positions` (3, L): the
        caller's multimodal RoPE positions (default: Qwen3-VL's own, `positions`);
        `valid_keys`: the ids from that index on are right padding, attended by none."""
        language = self.language_model
        embeds = language.embed_tokens(mx.array(ids))
        after_layer = None
        if images:
            visual = self.visual
            features = [visual(mx.array(image.pixel_values), image.grid_thw) for image in images]
            image_rows = mx.array(np.concatenate([np.arange(s, e) for s, e in spans]))
            merged = mx.concatenate([f.merged for f in features]).astype(embeds.dtype)
            embeds[image_rows] = merged
            deepstack = [
                mx.concatenate([f.deepstack[k] for f in features])
                for k in range(len(visual.config.deepstack_indexes))
            ]

            def after_layer(index: int, hidden: mx.array) -> mx.array:
                if index >= len(deepstack):
                    return hidden
                return hidden.at[:, image_rows].add(deepstack[index][None].astype(hidden.dtype))

        if positions is None:
            positions = self.positions(ids.shape[0], spans, images)
        cos, sin = self.rotary(positions, embeds.dtype)
        tapped = language(embeds[None], cos, sin, taps, after_layer, valid_keys)
        tapped = [hidden[0] for hidden in tapped]
        mx.eval(tapped)
        return tapped

    def rotary(self, positions: np.ndarray, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """Interleaved multimodal RoPE for positions (3, L) = (t, h, w) rows: frequency j follows
        h when j % 3 == 1 and j < 3 * sections[1], w when j % 3 == 2 and j < 3 * sections[2],
        else t."""
        inv_freq = self.language_model.inv_freq
        angles = positions.astype(np.float32)[:, :, None] * inv_freq  # (3, L, D/2)
        axis = np.zeros(inv_freq.shape[0], dtype=np.int64)
        index = np.arange(axis.shape[0])
        sections = self.language_model.config.mrope_section
        axis[(index % 3 == 1) & (index < 3 * sections[1])] = 1
        axis[(index % 3 == 2) & (index < 3 * sections[2])] = 2
        mixed = angles[axis[None, :], np.arange(angles.shape[1])[:, None], index[None, :]]
        return cos_sin(mixed, dtype)

    def positions(
        self, length: int, spans: list[tuple[int, int]], images: list[VisionInput]
    ) -> np.ndarray:
        """Multimodal RoPE positions (3, L) as Qwen3-VL's `get_rope_index` gives them: text runs
        count up on all three axes; an image's rows take (t, h, w) grid positions offset by the
        running position, which then advances by the larger merged grid side."""
        merge = self.visual.config.merge_size if images else 1
        positions = np.zeros((3, length), dtype=np.int64)
        current, cursor = 0, 0
        for (start, end), image in zip(spans, images, strict=True):
            run = start - cursor
            positions[:, cursor:start] = np.arange(run) + current
            current += run
            _, grid_h, grid_w = image.grid_thw
            merged_h, merged_w = grid_h // merge, grid_w // merge
            h, w = np.meshgrid(np.arange(merged_h), np.arange(merged_w), indexing="ij")
            positions[0, start:end] = current
            positions[1, start:end] = h.reshape(-1) + current
            positions[2, start:end] = w.reshape(-1) + current
            current += max(merged_h, merged_w)
            cursor = end
        positions[:, cursor:] = np.arange(length - cursor) + current
        return positions


def text_quantized(path: str) -> bool:
    """The layers a quantized load quantizes of a Qwen3-VL a family runs on text alone, by
    module path: the decoder's linear layers and the token table. The vision tower, never run,
    keeps its dtype."""
    return path == "language_model.embed_tokens" or path.startswith("language_model.layers.")


def hidden_state_taps(indices: tuple[int, ...], num_layers: int, setting: str) -> tuple[int, ...]:
    """The decoder layers whose outputs a pipeline's `hidden_states` indices name (index i is
    the output of layer i - 1); the embeddings (0) and the final norm's output (num_layers) are
    no tap of this encoder. `setting`: the pipeline's name of the indices, for the error."""
    for index in indices:
        if not 1 <= index < num_layers:
            raise ValueError(
                f"{setting} entry {index} is outside 1..{num_layers - 1} "
                f"(the encoder's {num_layers} decoder layers, before the final norm)"
            )
    return tuple(index - 1 for index in indices)


def language_model_tensor(name: str) -> bool:
    """Whether a checkpoint tensor belongs to the language model (a text-only load's)."""
    module = module_name(name)
    return module is not None and module.startswith("language_model.")


class Qwen3VLPart:
    """Qwen3-VL as a family's text encoder (its prompt encoder's PART): its GGUF pair
    (a model entry's `text_encoder` and `mmproj`), the tensors of its folder a load reads
    (`text_only`: the language model's alone), and the layers a quantized load quantizes
    (`quantized`, the family's choice, by module path)."""

    def __init__(self, quantized: Callable[[str], bool], text_only: bool = False) -> None:
        self.quantized = quantized
        self.text_only = text_only
        self.include = language_model_tensor if text_only else None

    def source(self, component_dir: Path, files: dict) -> tuple[Path, Path | None] | None:
        """The GGUF pair a load reads its weights from (None: the folder's safetensors); for a
        family reading text alone, also the folder's one `.gguf` file (a component set's)."""
        text = files.get("text_encoder")
        if text is None and self.text_only:
            text = gguf_file(component_dir)
        return gguf_pair(text, files.get("mmproj"), self.text_only)

    def gguf(self, component_dir: Path, files: dict) -> ModuleFiles | None:
        pair = self.source(component_dir, files)
        if pair is None:
            return None
        config = read_config(component_dir)
        vision = None if self.text_only else VisionConfig.from_dict(config["vision_config"])
        encoder = Qwen3VLEncoder(TextConfig.from_dict(config["text_config"]), vision)
        return gguf_files(encoder, *pair)

    @staticmethod
    def module_name(name: str) -> str | None:
        return module_name(name)


class TappedTextPrompt(PromptEncoder):
    """A family's prompt encoder over Qwen3-VL's language model alone (its vision tower never
    loads; a GGUF "pair" may be the language model's file alone), whose conditioning is the
    hidden states after the tapped layers stacked per token, each token's layers one after
    another: (1, L, layers x hidden), the wire's (1, L, D). The taps are model_index.json's
    `TAPS_SETTING` entries of `hidden_states` (default: the pipeline's `TAPS`). A subclass
    sets the two, how it reads its tokenizer (`read_tokenizer`) and how it encodes."""

    TAPS_SETTING: str
    TAPS: tuple[int, ...]
    PART = Qwen3VLPart(text_quantized, text_only=True)

    def __init__(
        self,
        encoder: Qwen3VLEncoder,
        tokenizer,
        hidden_states: tuple[int, ...],
        weight_bytes: int,
        dtype: mx.Dtype = mx.float32,
    ):
        config = encoder.language_model.config
        self.taps = hidden_state_taps(hidden_states, config.num_layers, self.TAPS_SETTING)
        self.text_dim = config.hidden_size
        width = len(self.taps) * config.hidden_size
        super().__init__(encoder, tokenizer, weight_bytes, width, dtype)

    @classmethod
    def from_folder(cls, model_dir: Path, dtype: mx.Dtype, quantization, gguf):
        encoder, weight_bytes = Qwen3VLEncoder.load(
            model_dir / "text_encoder", dtype, quantization, text_quantized, gguf, text_only=True
        )
        hidden_states = model_index(model_dir).get(cls.TAPS_SETTING) or cls.TAPS
        tokenizer = cls.read_tokenizer(model_dir / "tokenizer")
        return cls(encoder, tokenizer, tuple(hidden_states), weight_bytes, dtype)

    @staticmethod
    @abstractmethod
    def read_tokenizer(folder: Path):
        """The folder's tokenizer, as the family tokenizes."""

    def stacked(self, ids: np.ndarray, first_row: int = 0, **options) -> np.ndarray:
        """(1, L, layers x hidden) float32: the tapped states of the ids' tokens from
        `first_row` on, each token's layers in tap order (`options`: the encoder's positions
        and valid keys)."""
        tapped = self.encoder.hidden_states(ids, [], [], self.taps, **options)
        joined = mx.stack(tapped, axis=1)[first_row:].astype(mx.float32)  # (L, layers, D)
        return np.asarray(joined).reshape(1, joined.shape[0], -1)


# Checkpoint name prefixes -> module names, newest layout first.
_PREFIXES = (
    ("model.language_model.", "language_model."),
    ("model.visual.", "visual."),
    # Older Qwen-VL layouts.
    ("language_model.model.", "language_model."),
    ("visual.", "visual."),
    ("model.", "language_model."),
)
_UNUSED = ("lm_head.", "language_model.norm.")


PATCH_EMBED = "visual.patch_embed.proj.weight"
# llama.cpp's converter writes Qwen3-VL's vision tower under the gguf package's MMPROJ names,
# with these tensors of its own: the final merger as `mm.0`, `mm.2` and `v.post_ln`, each
# DeepStack merger under the vision block it taps, and the Conv3d patch kernel as one 2-D kernel
# per temporal slice (`v.patch_embd.weight`, `v.patch_embd.weight.1`).
_MERGER = {
    "norm": gguf_names.TENSOR_NAMES[MODEL_TENSOR.V_POST_NORM],
    "linear_fc1": gguf_names.TENSOR_NAMES[MODEL_TENSOR.V_MMPROJ].format(bid=0),
    "linear_fc2": gguf_names.TENSOR_NAMES[MODEL_TENSOR.V_MMPROJ].format(bid=2),
}
_DEEPSTACK = {
    "norm": MODEL_TENSOR.V_DS_NORM,
    "linear_fc1": MODEL_TENSOR.V_DS_FC1,
    "linear_fc2": MODEL_TENSOR.V_DS_FC2,
}


def gguf_pair(
    text_encoder: Path | None, mmproj: Path | None, text_only: bool = False
) -> tuple[Path, Path | None] | None:
    """A model entry's Qwen3-VL GGUF pair, which comes whole (a ValueError names the half
    missing) but for a family reading text alone, which needs no mmproj; None when neither
    is named."""
    if text_encoder is None and mmproj is None:
        return None
    if text_only and text_encoder is not None:
        return Path(text_encoder), None if mmproj is None else Path(mmproj)
    if text_encoder is None or mmproj is None:
        given, missing = (
            ("mmproj", "text_encoder") if text_encoder is None else ("text_encoder", "mmproj")
        )
        raise ValueError(
            f"Qwen3-VL from GGUF needs both text_encoder and mmproj: {given} is set without"
            f" {missing}"
        )
    return Path(text_encoder), Path(mmproj)


def gguf_files(encoder: Qwen3VLEncoder, model_file: Path, mmproj: Path | None) -> ModuleFiles:
    """Qwen3-VL in llama.cpp's pair of GGUF files: the language model in `model_file` under
    Qwen3's names (the converter drops `language_model.`; no q/k permutation, no norm offset),
    the vision tower in `mmproj` (gguf's MMPROJ names, and the converter's own names above;
    the patch kernel's temporal slices as `PATCH_EMBED.0`, `.1`, joined by `gguf_weights`). An
    encoder without its vision tower reads `model_file` alone."""
    shapes = {name: tuple(value.shape) for name, value in tree_flatten(encoder.parameters())}
    names: dict[str, tuple[int, str]] = {}
    text = {
        "model." + n.removeprefix("language_model."): n
        for n in shapes
        if n.startswith("language_model.")
    }
    layers = encoder.language_model.config.num_layers
    for hf, file_name in llama_cpp_names(MODEL_ARCH.QWEN3VL, layers, text).items():
        names[text[hf]] = (0, file_name)
    if "visual" not in encoder:
        return _module_files((Path(model_file),), names, shapes)
    vision = encoder.visual.config
    kernel = (vision.hidden_size, vision.in_channels, vision.patch_size, vision.patch_size)
    shapes.pop(PATCH_EMBED)
    tables = llama_cpp_names(
        MODEL_ARCH.MMPROJ, vision.depth, [n for n in shapes if n.startswith("visual.")]
    )
    for name in shapes:
        if not name.startswith("visual."):
            continue
        parts = name.split(".")
        if parts[1] == "merger":
            names[name] = (1, f"{_MERGER[parts[2]]}.{parts[3]}")
        elif parts[1] == "deepstack_merger_list":
            tap = vision.deepstack_indexes[int(parts[2])]
            base = gguf_names.TENSOR_NAMES[_DEEPSTACK[parts[3]]].format(bid=tap)
            names[name] = (1, f"{base}.{parts[4]}")
        elif name in tables:
            names[name] = (1, tables[name])
    patch_file = gguf_names.TENSOR_NAMES[MODEL_TENSOR.V_ENC_EMBD_PATCH] + ".weight"
    for index, suffix in enumerate(("", ".1")):
        names[f"{PATCH_EMBED}.{index}"] = (1, patch_file + suffix)
        shapes[f"{PATCH_EMBED}.{index}"] = kernel
    return _module_files((Path(model_file), Path(mmproj)), names, shapes)


def _module_files(files: tuple[Path, ...], names: dict, shapes: dict) -> ModuleFiles:
    unmapped = sorted(set(shapes) - set(names))
    if unmapped:
        raise ValueError(f"llama.cpp's names cover no tensor for {unmapped[0]}")
    return ModuleFiles(files, names, shapes, "Qwen3-VL text encoder")


def gguf_weights(
    encoder: Qwen3VLEncoder, model_file: Path, mmproj: Path | None, dtype: mx.Dtype | None
) -> dict[str, mx.array]:
    """The encoder's parameters from llama.cpp's pair of files, the patch kernel's temporal
    slices joined into the flattened Conv3d kernel PatchEmbed applies."""
    weights = gguf_files(encoder, model_file, mmproj).weights(dtype)
    if "visual" not in encoder:
        return weights
    slices = [weights.pop(f"{PATCH_EMBED}.{index}") for index in range(2)]
    kernel = mx.stack(slices, axis=2)  # (out, in, temporal, p, p), as the Conv3d holds it
    weights[PATCH_EMBED] = kernel.reshape(kernel.shape[0], -1)
    return weights


def module_name(name: str) -> str | None:
    """A checkpoint name as the module's parameter name; None for a tensor the encoder does
    not use."""
    for prefix, target in _PREFIXES:
        if name.startswith(prefix):
            name = target + name[len(prefix) :]
            break
    return None if name.startswith(_UNUSED) else name


def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Checkpoint names -> module names; unused tensors dropped; the Conv3d patch kernel flattened."""
    renamed: dict[str, mx.array] = {}
    for name, value in weights.items():
        name = module_name(name)
        if name is None:
            continue
        if name == "visual.patch_embed.proj.weight":
            value = value.reshape(value.shape[0], -1)
        renamed[name] = value
    return renamed
