"""MOSS-Image's Qwen3.5 text encoder from llama.cpp's `qwen35` GGUF file (a model entry's
`text_encoder`), on the tiny folders of two shapes (one with value heads grouped over fewer key
heads, whose order the converter changes). The file is written here as llama.cpp's converter
writes it (its Qwen3.5 and Qwen3-Next classes, conversion/qwen.py): the gguf package's names,
A_log as -exp(A_log), dt_bias as the dt_proj bias, the convolution squeezed, the zero-centred
norms as 1 + w, the value heads reordered from grouped to tiled; the large matrices Q8_0. Its
encoding is the encoding of the folder holding what the file holds (gguf's dequantized
weights), within float rounding."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gmlx_server.engine.families.moss_image.family import MOSS_IMAGE
from safetensors.numpy import load_file, save_file

from tests.compare import rel_l2
from tests.engine.gguf_files import encoded, reference, write_gguf
from tests.families.moss_image.tiny import SHAPES, build_tiny_folder

PROMPT = "a neon sign that reads OPEN LATE"
ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
                "k_norm.weight")  # fmt: skip


def tiled(value: np.ndarray, axis: int, key_heads: int, groups: int, head: int) -> np.ndarray:
    """The converter's `_reorder_v_heads`: value heads grouped by key head -> tiled."""
    shape = list(value.shape)
    split = shape[:axis] + [key_heads, groups, head] + shape[axis + 1 :]
    return np.swapaxes(value.reshape(split), axis, axis + 1).reshape(shape)


def converted(name: str, value: np.ndarray, text: dict) -> tuple[str, np.ndarray]:
    """One transformers tensor as llama.cpp's converter writes it: (its name before the gguf
    tables map it, its data)."""
    key_heads, value_heads = text["linear_num_key_heads"], text["linear_num_value_heads"]
    key_dim, value_dim = text["linear_key_head_dim"], text["linear_value_head_dim"]
    groups = value_heads // key_heads
    if "linear_attn." in name and groups > 1:
        keys = 2 * key_heads * key_dim
        if ".in_proj_qkv." in name:
            value = np.concatenate(
                [value[:keys], tiled(value[keys:], 0, key_heads, groups, value_dim)]
            )
        elif ".in_proj_z." in name:
            value = tiled(value, 0, key_heads, groups, value_dim)
        elif ".in_proj_b." in name or ".in_proj_a." in name:
            value = tiled(value, 0, key_heads, groups, 1)
        elif name.endswith((".A_log", ".dt_bias")):
            value = tiled(value[:, None], 0, key_heads, groups, 1)[:, 0]
        elif ".conv1d." in name:
            value = np.concatenate(
                [value[:keys], tiled(value[keys:], 0, key_heads, groups, value_dim)]
            )
        elif ".out_proj." in name:
            value = tiled(value, 1, key_heads, groups, value_dim)
    if name.endswith(".A_log"):
        value = -np.exp(value)
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif ".conv1d." in name:
        value = value[:, 0, :]
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        value = value + 1
    return name.replace("model.language_model.", "model."), value


def write_qwen35_gguf(folder, path, metadata: bool = False) -> dict[str, np.ndarray]:
    """The folder's Qwen3.5 as llama.cpp's GGUF file at `path` (with `metadata`, the sizes and
    the tokenizer as the converter writes them); returns the transformers weights the file
    holds (the Q8_0 matrices as gguf dequantizes them)."""
    import json

    text = json.loads((folder / "text_encoder" / "config.json").read_text())["text_config"]
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, text["num_hidden_layers"])
    weights = load_file(str(folder / "text_encoder" / "model.safetensors"))
    tensors, held = {}, {}
    rng = np.random.default_rng(0)
    for name, value in sorted(weights.items()):
        source, data = converted(name, value.astype(np.float32), text)
        file_name = table.get_name(source, try_suffixes=(".weight", ".bias"))
        kind = (
            T.Q8_0 if data.ndim == 2 and data.shape[1] % 32 == 0 and "conv1d" not in name else T.F32
        )
        tensors[file_name] = (kind, encoded(kind, data, rng))
        if kind == T.Q8_0:  # a matrix changed by rows or columns only: undo it on the held one
            held[name] = reference(kind, tensors[file_name][1]).reshape(data.shape)
            held[name] = unconverted(name, held[name], text)
        else:
            held[name] = value
    tokenizer_json = folder / "tokenizer" / "tokenizer.json"
    keys = (lambda writer: add_metadata(writer, text, tokenizer_json)) if metadata else None
    write_gguf(path, tensors, arch="qwen35", metadata=keys)
    return held


def add_metadata(writer, text: dict, tokenizer_json) -> None:
    """What llama.cpp's converter writes of a Qwen3.5 checkpoint's config (its text model's
    base sizes, then the Qwen3-Next class's DeltaNet sizes and rotated dims) and tokenizer."""
    from tests.engine.comfy_files import add_tokenizer

    head_dim = text["head_dim"]
    writer.add_block_count(text["num_hidden_layers"])
    writer.add_embedding_length(text["hidden_size"])
    writer.add_feed_forward_length(text["intermediate_size"])
    writer.add_head_count(text["num_attention_heads"])
    writer.add_head_count_kv(text["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(text["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(text["rms_norm_eps"])
    writer.add_ssm_conv_kernel(text["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(text["linear_key_head_dim"])
    writer.add_ssm_group_count(text["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(text["linear_num_value_heads"])
    writer.add_ssm_inner_size(text["linear_value_head_dim"] * text["linear_num_value_heads"])
    writer.add_full_attention_interval(text["full_attention_interval"])
    rotated = int(head_dim * text["rope_parameters"]["partial_rotary_factor"])
    writer.add_rope_dimension_count(rotated)
    add_tokenizer(writer, tokenizer_json, "qwen35")


def unconverted(name: str, value: np.ndarray, text: dict) -> np.ndarray:
    """A converted matrix back in transformers' value-head order (the inverse permutation)."""
    key_heads, value_heads = text["linear_num_key_heads"], text["linear_num_value_heads"]
    groups = value_heads // key_heads
    if "linear_attn." not in name or groups == 1:
        return value
    key_dim, value_dim = text["linear_key_head_dim"], text["linear_value_head_dim"]
    keys = 2 * key_heads * key_dim
    if ".in_proj_qkv." in name:
        return np.concatenate([value[:keys], tiled(value[keys:], 0, groups, key_heads, value_dim)])
    if ".in_proj_z." in name:
        return tiled(value, 0, groups, key_heads, value_dim)
    if ".in_proj_b." in name or ".in_proj_a." in name:
        return tiled(value, 0, groups, key_heads, 1)
    if ".out_proj." in name:
        return tiled(value, 1, groups, key_heads, value_dim)
    return value


@pytest.fixture(scope="module", params=sorted(SHAPES))
def folders(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"moss_gguf_{request.param}")
    folder = build_tiny_folder(root / "moss-tiny", request.param)
    path = root / "Qwen3.5-tiny-Q8_0.gguf"
    held = write_qwen35_gguf(folder, path)
    same = root / "moss-held"
    shutil.copytree(folder, same)
    save_file(held, str(same / "text_encoder" / "model.safetensors"), metadata={"format": "pt"})
    return folder, path, same


def test_a_qwen35_gguf_encodes_as_the_weights_it_holds(folders):
    folder, path, same = folders
    from_file = MOSS_IMAGE.load(folder, "moss", text_encoder=path)
    expected = MOSS_IMAGE.load(same, "held").encode(PROMPT, [], False).cond
    got = from_file.encode(PROMPT, [], False).cond
    assert rel_l2(got, expected) <= 1e-4
    plain = MOSS_IMAGE.load(folder, "plain").encode(PROMPT, [], False).cond
    assert rel_l2(got, plain) > 1e-5  # Q8_0 moved it a little: the file's weights are read
    status = from_file.status()
    assert status["quantization"]["encoder"]["format"] == "gguf"
