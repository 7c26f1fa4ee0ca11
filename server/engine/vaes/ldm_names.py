"""The original (ldm) naming of an `AutoencoderKL`'s tensors, which BFL's and ComfyUI's single
VAE files use (`ae.safetensors`, `flux2-vae.safetensors`: `encoder.down.0.block.0.conv1.weight`,
`decoder.up.3.upsample.conv.weight`, `encoder.mid.attn_1.q.weight`), onto diffusers' names, as
diffusers' single-file conversion (`convert_ldm_vae_checkpoint`) and ComfyUI's table
(`comfy/diffusers_convert.py`, the other way) map them. ldm's up blocks count from the
deepest; its attention projections are 1x1 convolutions, diffusers' linears. No MLX.
"""

from __future__ import annotations

import re

# A tensor only the ldm naming has (diffusers' is `decoder.up_blocks.0...`).
LDM_MARKERS = ("decoder.conv_in.weight",)
DIFFUSERS_MARKER = "decoder.up_blocks."
ATTENTION = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}
_RESNET = re.compile(r"^(encoder|decoder)\.mid\.block_(\d)\.")
_ATTENTION = re.compile(r"^(encoder|decoder)\.mid\.attn_1\.(norm|q|k|v|proj_out)\.")
_DOWN = re.compile(r"^encoder\.down\.(\d+)\.(block\.(\d+)|downsample)\.")
_UP = re.compile(r"^decoder\.up\.(\d+)\.(block\.(\d+)|upsample)\.")


def is_ldm(names) -> bool:
    """Whether a VAE checkpoint's names are ldm's rather than diffusers'."""
    names = list(names)
    return any(n in names for n in LDM_MARKERS) and not any(
        n.startswith(DIFFUSERS_MARKER) for n in names
    )


def up_blocks(names) -> int:
    """How many up blocks an ldm checkpoint holds."""
    found = {int(m.group(1)) for n in names if (m := _UP.match(n))}
    return max(found) + 1 if found else 0


def diffusers_name(name: str, blocks: int) -> str:
    """One ldm name as diffusers' (`blocks`: the checkpoint's up blocks, `up_blocks`)."""
    if m := _RESNET.match(name):
        return f"{m.group(1)}.mid_block.resnets.{int(m.group(2)) - 1}." + name[m.end() :]
    if m := _ATTENTION.match(name):
        return f"{m.group(1)}.mid_block.attentions.0.{ATTENTION[m.group(2)]}." + name[m.end() :]
    if m := _DOWN.match(name):
        inner = f"resnets.{m.group(3)}" if m.group(3) is not None else "downsamplers.0"
        name = f"encoder.down_blocks.{m.group(1)}.{inner}." + name[m.end() :]
    elif m := _UP.match(name):
        index = blocks - 1 - int(m.group(1))
        inner = f"resnets.{m.group(3)}" if m.group(3) is not None else "upsamplers.0"
        name = f"decoder.up_blocks.{index}.{inner}." + name[m.end() :]
    name = name.replace(".nin_shortcut.", ".conv_shortcut.")
    return re.sub(r"^(encoder|decoder)\.norm_out\.", r"\1.conv_norm_out.", name)


def is_attention_projection(name: str) -> bool:
    """Whether a diffusers name is a mid-block attention projection (a linear, where ldm's is
    a 1x1 convolution)."""
    return ".mid_block.attentions.0." in name and name.endswith(
        ("to_q.weight", "to_k.weight", "to_v.weight", "to_out.0.weight")
    )


def renamed(weights: dict) -> dict:
    """A VAE checkpoint (name -> array with `.shape` and `.reshape`) in diffusers' names and
    layouts: ldm's renamed, its 1x1 attention kernels made matrices; diffusers' as it is."""
    if not is_ldm(weights):
        return weights
    blocks = up_blocks(weights)
    out = {}
    for name, value in weights.items():
        target = diffusers_name(name, blocks)
        if is_attention_projection(target) and len(value.shape) == 4:
            value = value.reshape(value.shape[0], value.shape[1])
        out[target] = value
    return out
