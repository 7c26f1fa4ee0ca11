"""Qwen3 (the text encoder Z-Image prompts with) from a llama.cpp GGUF file: its tensors under
llama.cpp's names (`token_embd.weight`, `blk.N.attn_q.weight` ...), for every GGUF type the
server reads, give the hidden states the float encoder gives on the weights
`gguf.quants.dequantize` gives (relative L2 <= 1e-4; the types with no exact MLX form within
their measured distance); the quantized layers stay quantized; a file of the wrong shapes or
another model is refused naming the file and the tensor."""

from __future__ import annotations

import json
import re

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gmlx_server.engine.encoders.qwen3.text import Qwen3TextEncoder
from gmlx_server.engine.ggml_blocks import BlockEmbedding, BlockLinear
from gmlx_server.engine.gguf import READABLE, GGUFError
from gmlx_server.engine.weights import load_weights
from safetensors.numpy import save_file

from tests.compare import rel_l2
from tests.engine.gguf_files import encoded, reference, write_gguf

TOLERANCE = 1e-4
TYPES = list(READABLE)
# Wide enough that every linear input (256, 512) takes a K-quant's 256-blocks.
CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 256,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
}
# llama.cpp's names of Qwen3's tensors, as its converter writes them (written out here, apart
# from the gguf package's tables the server maps with).
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
IDS = np.array([3, 17, 200, 45, 9, 128, 77, 5, 250, 31], np.int32)


def llama_cpp_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name)
    return f"blk.{match[1]}.{LAYER_NAMES[match[2]]}.weight"


def tiny_qwen3(folder, config: dict = CONFIG):
    """A tiny random Qwen3 (matrices of 1/sqrt(fan-in) spread, norm scales near 1), saved to
    `folder` by transformers."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**config)).eval()
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape)
            param.copy_(noise / param.shape[1] ** 0.5 if param.ndim == 2 else 1 + 0.1 * noise)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_qwen3(tmp_path_factory.mktemp("qwen3") / "text_encoder")


def write_encoder_gguf(path, folder, kind: T | None, rng):
    """The folder's weights as a llama.cpp GGUF file: matrices of `kind` (Q8_0 where its blocks
    do not divide the input; None: every type in turn), norms F32; returns what it holds by
    transformers name."""
    import gguf

    tensors, held = {}, {}
    for index, (name, value) in enumerate(sorted(load_weights(folder, mx.float32).items())):
        value = np.array(value)
        tensor_kind = T.F32
        if value.ndim == 2:
            wanted = TYPES[index % len(TYPES)] if kind is None else kind
            block = gguf.GGML_QUANT_SIZES[wanted][0]
            tensor_kind = wanted if value.shape[1] % block == 0 else T.Q8_0
        data = encoded(tensor_kind, value, rng)
        tensors[llama_cpp_name(name)] = (tensor_kind, data)
        held[name] = reference(tensor_kind, data).reshape(value.shape)
    write_gguf(path, tensors, arch="qwen3")
    return held


def reference_folder(folder, target, held):
    target.mkdir()
    (target / "config.json").write_text(json.dumps(CONFIG))
    weights = {name: np.ascontiguousarray(v, np.float32) for name, v in held.items()}
    save_file(weights, str(target / "model.safetensors"))
    return target


def hidden(encoder: Qwen3TextEncoder) -> np.ndarray:
    return np.array(encoder.hidden_states(IDS, (-2,))[0])


@pytest.mark.parametrize("kind", TYPES, ids=lambda kind: kind.name)
def test_hidden_states_equal_the_dequantized_weights_encoder(kind, folder, tmp_path):
    path = tmp_path / "Qwen3-tiny.gguf"
    held = write_encoder_gguf(path, folder, kind, np.random.default_rng(int(kind)))
    encoder = Qwen3TextEncoder.load(folder, gguf=path)
    expected = hidden(Qwen3TextEncoder.load(reference_folder(folder, tmp_path / "ref", held)))
    assert rel_l2(hidden(encoder), expected) <= TOLERANCE
    layers = dict(encoder.model.named_modules())
    quantized = kind not in (T.F32, T.F16, T.BF16)
    assert isinstance(layers["layers.0.mlp.down_proj"], BlockLinear) == quantized
    assert isinstance(layers["embed_tokens"], BlockEmbedding) == quantized
    # weight_bytes counts the held blocks
    assert (encoder.weight_bytes < 0.6 * 4 * sum(v.size for v in held.values())) == quantized


def test_a_file_mixing_every_type_encodes_as_its_dequantized_weights(folder, tmp_path):
    path = tmp_path / "Qwen3-mixed.gguf"
    held = write_encoder_gguf(path, folder, None, np.random.default_rng(13))
    encoder = Qwen3TextEncoder.load(folder, gguf=path)
    expected = hidden(Qwen3TextEncoder.load(reference_folder(folder, tmp_path / "ref", held)))
    assert rel_l2(hidden(encoder), expected) <= TOLERANCE
    kinds = {
        layer.layout.types for _, layer in encoder.model.named_modules() if hasattr(layer, "layout")
    }
    assert len(kinds) >= 8, kinds  # K-quants among them


def test_a_file_of_other_shapes_or_another_model_is_refused_naming_it(folder, tmp_path):
    rng = np.random.default_rng(3)
    wrong = tmp_path / "wrong.gguf"
    write_encoder_gguf(wrong, folder, T.Q8_0, rng)
    other = json.loads((folder / "config.json").read_text())
    narrow = tmp_path / "narrow"
    narrow.mkdir()
    (narrow / "config.json").write_text(json.dumps({**other, "intermediate_size": 256}))
    with pytest.raises(GGUFError, match=r"wrong\.gguf: tensor blk\.0\.ffn_(gate|up)\.weight has"):
        Qwen3TextEncoder.load(narrow, gguf=wrong)
    flux = tmp_path / "flux.gguf"
    write_gguf(flux, {"img_in.weight": (T.F32, np.ones((4, 4), np.float32))}, arch="flux")
    with pytest.raises(GGUFError, match=r"flux\.gguf is not a Qwen3 text encoder \(its arch"):
        Qwen3TextEncoder.load(folder, gguf=flux)


# ---------------------------------------------------------------------------------------------
# Qwen3-VL from llama.cpp's pair of files: the language model, and the vision tower's mmproj

VISION_NAMES = {
    "attn.qkv": "attn_qkv",
    "attn.proj": "attn_out",
    "norm1": "ln1",
    "norm2": "ln2",
    "mlp.linear_fc1": "ffn_up",
    "mlp.linear_fc2": "ffn_down",
}
MERGER_NAMES = {"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}
DEEPSTACK_NAMES = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}


def vl_file_names(name: str, taps: list[int]) -> list[tuple[int, str, int | None]]:
    """(file: 0 model, 1 mmproj; llama.cpp's name; temporal slice or None) of a Qwen3-VL
    checkpoint tensor (Qwen3VLForConditionalGeneration's names, or Qwen3VLModel's without
    `model.`), as llama.cpp's converter writes it."""
    if name.startswith(("language_model.", "visual.")):
        name = "model." + name
    if name.startswith("model.language_model."):
        text = name.replace("model.language_model.", "model.", 1)
        return [(0, llama_cpp_name(text), None)]
    if name == "lm_head.weight":
        return [(0, "output.weight", None)]
    rest, suffix = name.removeprefix("model.visual.").rsplit(".", 1)
    if rest == "patch_embed.proj":
        if suffix == "bias":
            return [(1, "v.patch_embd.bias", None)]
        return [(1, "v.patch_embd.weight", 0), (1, "v.patch_embd.weight.1", 1)]
    if rest == "pos_embed":
        return [(1, "v.position_embd.weight", None)]
    head, _, tail = rest.partition(".")
    if head == "merger":
        return [(1, f"{MERGER_NAMES[tail]}.{suffix}", None)]
    if head == "blocks":
        block, _, layer = tail.partition(".")
        return [(1, f"v.blk.{block}.{VISION_NAMES[layer]}.{suffix}", None)]
    index, _, layer = tail.partition(".")  # deepstack_merger_list: under the block it taps
    return [(1, f"v.deepstack.{taps[int(index)]}.{DEEPSTACK_NAMES[layer]}.{suffix}", None)]


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory):
    """The embedded model, its DeepStack merger moved to tap vision block 1 (so a converter's
    tap index and the merger's list index differ)."""
    import shutil

    from gmlx_server.engine.families.qwen_image21.embedded import ensure_embedded_model

    base = ensure_embedded_model(tmp_path_factory.mktemp("vl_embedded"))
    folder = tmp_path_factory.mktemp("vl") / "model"
    shutil.copytree(base, folder)
    config_path = folder / "text_encoder" / "config.json"
    config = json.loads(config_path.read_text())
    config["vision_config"]["deepstack_visual_indexes"] = [1]
    config_path.write_text(json.dumps(config))
    return folder


def gguf_pair(folder, kind: T, tmp_path):
    """The folder's Qwen3-VL as llama.cpp's pair of GGUF files (its matrices of `kind`, or Q8_0,
    or F32, where their blocks do not divide a row) and a copy of the folder holding what the pair holds,
    as gguf dequantizes it: (model file, mmproj file, that copy)."""
    import shutil

    import gguf

    config = json.loads((folder / "text_encoder" / "config.json").read_text())
    taps = config["vision_config"]["deepstack_visual_indexes"]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    rng = np.random.default_rng(int(kind))
    files, held = [{}, {}], {}
    for name, value in load_weights(folder / "text_encoder", mx.float32).items():
        value = np.array(value)
        slices = []
        for index, file_name, temporal in vl_file_names(name, taps):
            part = value if temporal is None else value[:, :, temporal]
            part_kind = T.F32
            if part.ndim == 2:
                fallback = T.Q8_0 if part.shape[1] % 32 == 0 else T.F32  # Q8_0's blocks: 32
                part_kind = kind if part.shape[1] % block == 0 else fallback
            elif part.ndim == 4:
                part_kind = T.F16
            data = encoded(part_kind, part, rng)
            files[index][file_name] = (part_kind, data)
            slices.append(reference(part_kind, data).reshape(part.shape))
        held[name] = slices[0] if len(slices) == 1 else np.stack(slices, axis=2)
    model_file = write_gguf(tmp_path / "Qwen3-VL-tiny.gguf", files[0], arch="qwen3vl")
    mmproj = write_gguf(tmp_path / "mmproj-Qwen3-VL-tiny.gguf", files[1], arch="clip")
    plain = tmp_path / "plain"
    shutil.copytree(folder, plain)
    weights = {n: np.ascontiguousarray(v, np.float32) for n, v in held.items()}
    save_file(weights, str(next((plain / "text_encoder").glob("*.safetensors"))))
    return model_file, mmproj, plain


@pytest.mark.parametrize("kind", [T.Q8_0, T.Q4_K], ids=lambda kind: kind.name)
def test_qwen3_vl_from_the_gguf_pair_encodes_as_its_dequantized_weights(kind, vl_folder, tmp_path):
    from gmlx_server.engine.families.qwen_image21.prompt import QwenImage21PromptEncoder

    model_file, mmproj, plain = gguf_pair(vl_folder, kind, tmp_path)
    image = np.random.default_rng(1).integers(0, 256, (256, 320, 3), dtype=np.uint8)
    got = QwenImage21PromptEncoder.load(vl_folder, gguf=(model_file, mmproj))
    expected = QwenImage21PromptEncoder.load(plain)
    a, b = got.encode("a red boat", [image]), expected.encode("a red boat", [image])
    assert rel_l2(a.cond, b.cond) <= TOLERANCE
    assert a.image_slots == b.image_slots
    layers = dict(got.encoder.named_modules())
    assert isinstance(layers["visual.blocks.0.attn.qkv"], BlockLinear)
    assert isinstance(layers["language_model.layers.0.mlp.up_proj"], BlockLinear)


def test_krea2s_qwen3_vl_from_the_gguf_pair_encodes_as_its_dequantized_weights(tmp_path):
    """Krea 2's prompt (its tapped layers, stacked) from the embedded Krea 2's encoder as a pair
    in Qwen3VLModel's names."""
    from gmlx_server.engine.families.krea2.embedded import write_embedded_model
    from gmlx_server.engine.families.krea2.prompt import Krea2PromptEncoder

    folder = tmp_path / "krea2"
    write_embedded_model(folder)
    (tmp_path / "pair").mkdir()
    model_file, mmproj, plain = gguf_pair(folder, T.Q8_0, tmp_path / "pair")
    got = Krea2PromptEncoder.load(folder, gguf=(model_file, mmproj))
    expected = Krea2PromptEncoder.load(plain)
    assert rel_l2(got.encode("a red boat"), expected.encode("a red boat")) <= TOLERANCE
    layers = dict(got.encoder.named_modules())
    assert isinstance(layers["language_model.layers.0.mlp.up_proj"], BlockLinear)
