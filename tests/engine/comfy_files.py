"""A model's components written as the single files ComfyUI's model folders hold, for the
tests of models served from component files (engine/components.py): the VAE in the ldm names
of BFL's and ComfyUI's files (checked against diffusers' single-file conversion in
tests/engine/test_components.py), Qwen's tokenizer as ComfyUI ships its copy (vocab.json,
merges.txt, tokenizer_config.json), and a llama.cpp GGUF text encoder carrying its tokenizer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from tests.encoders.qwen3.test_gguf import llama_cpp_name
from tests.engine.gguf_files import write_gguf

ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def ldm_name(name: str, blocks: int) -> str:
    """A diffusers AutoencoderKL name as ldm's (`blocks`: its up blocks)."""
    if m := re.match(r"^(encoder|decoder)\.mid_block\.resnets\.(\d)\.", name):
        return f"{m[1]}.mid.block_{int(m[2]) + 1}." + name[m.end() :]
    if m := re.match(
        r"^(encoder|decoder)\.mid_block\.attentions\.0\.(group_norm|to_q|to_k|to_v|to_out\.0)\.",
        name,
    ):
        return f"{m[1]}.mid.attn_1.{ATTENTION[m[2]]}." + name[m.end() :]
    if m := re.match(r"^encoder\.down_blocks\.(\d+)\.(resnets\.(\d+)|downsamplers\.0)\.", name):
        inner = f"block.{m[3]}" if m[3] is not None else "downsample"
        name = f"encoder.down.{m[1]}.{inner}." + name[m.end() :]
    elif m := re.match(r"^decoder\.up_blocks\.(\d+)\.(resnets\.(\d+)|upsamplers\.0)\.", name):
        inner = f"block.{m[3]}" if m[3] is not None else "upsample"
        name = f"decoder.up.{blocks - 1 - int(m[1])}.{inner}." + name[m.end() :]
    name = name.replace(".conv_shortcut.", ".nin_shortcut.")
    return re.sub(r"^(encoder|decoder)\.conv_norm_out\.", r"\1.norm_out.", name)


def ldm_vae(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A diffusers AutoencoderKL state dict in ldm's names and layouts (attention kernels 1x1)."""
    blocks = len({n.split(".")[2] for n in weights if n.startswith("decoder.up_blocks.")})
    out = {}
    for name, value in weights.items():
        target = ldm_name(name, blocks)
        if ".mid.attn_1." in target and target.endswith(
            ("q.weight", "k.weight", "v.weight", "proj_out.weight")
        ):
            value = value.reshape(*value.shape, 1, 1)
        out[target] = value
    return out


def tokenizer_parts(tokenizer_json: Path) -> tuple[dict, list[str], list[dict]]:
    """tokenizer.json's vocabulary, merges ("a b") and added tokens."""
    doc = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
    merges = [m if isinstance(m, str) else " ".join(m) for m in doc["model"]["merges"]]
    return doc["model"]["vocab"], merges, doc["added_tokens"]


def write_comfy_tokenizer(tokenizer_json: Path, folder: Path) -> Path:
    """ComfyUI's qwen25_tokenizer layout of a Qwen tokenizer.json."""
    vocab, merges, added = tokenizer_parts(tokenizer_json)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    decoder = {
        str(t["id"]): {"content": t["content"], "special": t["special"], "normalized": False}
        for t in added
    }
    (folder / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))
    return folder


def write_gguf_text_encoder(
    path: Path, weights: dict[str, np.ndarray], tokenizer_json: Path | None, arch: str = "qwen3"
) -> Path:
    """Qwen3's weights (transformers names) as a float32 llama.cpp GGUF file of `arch`
    ("qwen3vl": Qwen3-VL's language model, its names under `model.`), with the tokenizer's
    metadata as llama.cpp's converter writes it (tokens in id order, control and user-defined
    types for the added ones, merges) when `tokenizer_json` is given."""
    tensors = {
        llama_cpp_name(n): (T.F32, np.ascontiguousarray(v, np.float32)) for n, v in weights.items()
    }
    if tokenizer_json is None:
        return write_gguf(path, tensors, arch=arch)
    return write_gguf(
        path, tensors, arch=arch, metadata=lambda w: add_tokenizer(w, tokenizer_json, "qwen2")
    )


def add_tokenizer(writer: gguf.GGUFWriter, tokenizer_json: Path, pre: str) -> None:
    """A Qwen tokenizer.json as llama.cpp's converter writes it into a GGUF file's metadata:
    the BPE model with its pre-tokenizer `pre`, the tokens in id order (control and
    user-defined types for the added ones) and the merges."""
    vocab, merges, added = tokenizer_parts(tokenizer_json)
    tokens = {i: t for t, i in vocab.items()}
    kinds = dict.fromkeys(tokens, int(gguf.TokenType.NORMAL))
    for token in added:
        tokens[token["id"]] = token["content"]
        kinds[token["id"]] = int(
            gguf.TokenType.CONTROL if token["special"] else gguf.TokenType.USER_DEFINED
        )
    order = sorted(tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list([tokens[i] for i in order])
    writer.add_token_types([kinds[i] for i in order])
    writer.add_token_merges(merges)


# diffusers' AutoencoderKLQwenImage names -> Wan 2.1's (ComfyUI's qwen_image_vae.safetensors),
# written from ComfyUI's WanVAE module tree: checked against diffusers' own converter
# (tests/vaes/qwen_image/test_wan_names.py), so the product's map is checked against both.
WAN_RESIDUAL = {"norm1.": "residual.0.", "conv1.": "residual.2.", "norm2.": "residual.3.",
                "conv2.": "residual.6.", "conv_shortcut.": "shortcut."}  # fmt: skip
WAN_TOP = {
    "quant_conv.": "conv1.",
    "post_quant_conv.": "conv2.",
    "encoder.conv_in.": "encoder.conv1.",
    "decoder.conv_in.": "decoder.conv1.",
    "encoder.norm_out.": "encoder.head.0.",
    "encoder.conv_out.": "encoder.head.2.",
    "decoder.norm_out.": "decoder.head.0.",
    "decoder.conv_out.": "decoder.head.2.",
}


UP_PART = re.compile(r"decoder\.up_blocks\.(\d+)\.(?:resnets\.(\d+)|upsamplers\.0)\.")


def wan_vae(weights: dict) -> dict:
    """A diffusers AutoencoderKLQwenImage state dict in Wan 2.1's names."""
    parts = set()  # (up block, resnet index; upsampler: after its resnets)
    for name in weights:
        if m := UP_PART.match(name):
            parts.add((int(m.group(1)), int(m.group(2)) if m.group(2) else UPSAMPLER))
    flat = {part: index for index, part in enumerate(sorted(parts))}  # Wan's one flat list
    return {wan_name(name, flat): value for name, value in weights.items()}


UPSAMPLER = 1_000


def wan_name(name: str, flat: dict) -> str:
    for diffusers, wan in WAN_TOP.items():
        if name.startswith(diffusers):
            return wan + name[len(diffusers) :]
    if m := re.match(r"(encoder|decoder)\.mid_block\.(resnets\.(\d)|attentions\.0)\.", name):
        index = {"0": 0, "1": 2}[m.group(3)] if m.group(3) is not None else 1
        return _wan_residual(f"{m.group(1)}.middle.{index}." + name[m.end() :])
    if m := re.match(r"encoder\.down_blocks\.(\d+)\.", name):
        return _wan_residual(f"encoder.downsamples.{m.group(1)}." + name[m.end() :])
    if m := UP_PART.match(name):
        key = (int(m.group(1)), int(m.group(2)) if m.group(2) else UPSAMPLER)
        return _wan_residual(f"decoder.upsamples.{flat[key]}." + name[m.end() :])
    return name


def _wan_residual(name: str) -> str:
    for diffusers, wan in WAN_RESIDUAL.items():
        if f".{diffusers}" in name and ".resample." not in name:
            return name.replace(f".{diffusers}", f".{wan}", 1)
    return name


def float32_weights(component: Path) -> dict[str, np.ndarray]:
    """A component folder's weights as float32 arrays, by name (what a test writes again as a
    single file)."""
    import mlx.core as mx
    from gmlx_server.engine.weights import load_weights

    return {n: np.array(v) for n, v in load_weights(component, mx.float32).items()}
