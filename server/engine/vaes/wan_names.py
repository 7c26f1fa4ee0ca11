"""Wan 2.1's naming of the Qwen-Image VAE's tensors, which ComfyUI's `qwen_image_vae.safetensors`
and Wan's own files use (`encoder.conv1.weight`, `encoder.downsamples.1.resample.1.weight`,
`decoder.middle.0.residual.0.gamma`, `decoder.upsamples.3.resample.1.weight`, `decoder.head.2`),
onto diffusers' `AutoencoderKLQwenImage` names, as diffusers' single-file conversion
(`convert_wan_vae_to_diffusers`) maps them and ComfyUI's `WanVAE` reads them. No MLX.

The encoder's `downsamples` are diffusers' flat `down_blocks` under other leaf names. The
decoder's `upsamples` are one flat list, each up block's residual blocks followed by its
resampler (the last block has none); diffusers nests them as `up_blocks.i.resnets.j` and
`up_blocks.i.upsamplers.0`, so the grouping is read from where the resamplers stand.
"""

from __future__ import annotations

import re

WAN_MARKERS = ("encoder.conv1.weight", "decoder.middle.0.residual.0.gamma")
# A residual block's layers: Wan's sequential indices -> diffusers' names.
RESIDUAL = {"residual.0.": "norm1.", "residual.2.": "conv1.", "residual.3.": "norm2.",
            "residual.6.": "conv2.", "shortcut.": "conv_shortcut."}  # fmt: skip
MIDDLE = {"0": "resnets.0.", "1": "attentions.0.", "2": "resnets.1."}
TOP = {
    "conv1.": "quant_conv.",
    "conv2.": "post_quant_conv.",
    "encoder.conv1.": "encoder.conv_in.",
    "decoder.conv1.": "decoder.conv_in.",
    "encoder.head.0.": "encoder.norm_out.",
    "encoder.head.2.": "encoder.conv_out.",
    "decoder.head.0.": "decoder.norm_out.",
    "decoder.head.2.": "decoder.conv_out.",
}
_MIDDLE = re.compile(r"^(encoder|decoder)\.middle\.(\d)\.")
_DOWN = re.compile(r"^encoder\.downsamples\.(\d+)\.")
_UP = re.compile(r"^decoder\.upsamples\.(\d+)\.")


def is_wan(names) -> bool:
    """Whether a VAE checkpoint's names are Wan's rather than diffusers'."""
    names = set(names)
    return all(marker in names for marker in WAN_MARKERS)


def up_layout(names) -> dict[int, str]:
    """Each decoder `upsamples` index -> its diffusers prefix (`decoder.up_blocks.i.resnets.j.`
    or `decoder.up_blocks.i.upsamplers.0.`), from where the resamplers stand."""
    indices = sorted({int(m.group(1)) for n in names if (m := _UP.match(n))})
    resamplers = {
        int(m.group(1))
        for n in names
        if (m := _UP.match(n)) and n[m.end() :].startswith("resample.")
    }
    layout, block, resnet = {}, 0, 0
    for index in indices:
        if index in resamplers:
            layout[index] = f"decoder.up_blocks.{block}.upsamplers.0."
            block, resnet = block + 1, 0
        else:
            layout[index] = f"decoder.up_blocks.{block}.resnets.{resnet}."
            resnet += 1
    return layout


def diffusers_name(name: str, ups: dict[int, str]) -> str:
    """One Wan name as diffusers' (`ups`: the checkpoint's `up_layout`)."""
    for prefix, target in TOP.items():
        if name.startswith(prefix):
            return target + name[len(prefix) :]
    if m := _MIDDLE.match(name):
        rest = f"{m.group(1)}.mid_block.{MIDDLE[m.group(2)]}" + name[m.end() :]
        return _residual(rest)
    if m := _DOWN.match(name):
        return _residual(f"encoder.down_blocks.{m.group(1)}." + name[m.end() :])
    if m := _UP.match(name):
        return _residual(ups[int(m.group(1))] + name[m.end() :])
    return name


def _residual(name: str) -> str:
    for wan, diffusers in RESIDUAL.items():
        if f".{wan}" in name:
            return name.replace(f".{wan}", f".{diffusers}", 1)
    return name


def diffusers_names(names) -> dict[str, str]:
    """Every name of a checkpoint in diffusers' naming (Wan's renamed, diffusers' as they are)."""
    names = list(names)
    if not is_wan(names):
        return {name: name for name in names}
    ups = up_layout(names)
    return {name: diffusers_name(name, ups) for name in names}


def renamed(weights: dict) -> dict:
    """A VAE checkpoint in diffusers' names (Wan's renamed; diffusers' as it is)."""
    return {new: weights[old] for old, new in diffusers_names(weights).items()}
