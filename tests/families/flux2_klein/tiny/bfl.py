"""A FLUX.2 klein DiT's weights in BFL's naming (its own checkpoints, ComfyUI's `Flux2`, the
GGUF files converted from them), from a diffusers state dict: the inverse of diffusers'
single-file conversion (`convert_flux2_transformer_checkpoint_to_diffusers`), which the tests
run back on it to check it. Written here from BFL's names, not from the server's tables."""

from __future__ import annotations

import re

import numpy as np

TOP = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
    "single_stream_modulation.linear": "single_stream_modulation.lin",
    "proj_out": "final_layer.linear",
}
FINAL_MOD = ("norm_out.linear.weight", "final_layer.adaLN_modulation.1.weight")
DOUBLE = {
    "attn.norm_q.weight": "img_attn.norm.query_norm.scale",
    "attn.norm_k.weight": "img_attn.norm.key_norm.scale",
    "attn.norm_added_q.weight": "txt_attn.norm.query_norm.scale",
    "attn.norm_added_k.weight": "txt_attn.norm.key_norm.scale",
    "attn.to_out.0.weight": "img_attn.proj.weight",
    "attn.to_add_out.weight": "txt_attn.proj.weight",
    "ff.linear_in.weight": "img_mlp.0.weight",
    "ff.linear_out.weight": "img_mlp.2.weight",
    "ff_context.linear_in.weight": "txt_mlp.0.weight",
    "ff_context.linear_out.weight": "txt_mlp.2.weight",
}
QKV = {
    "img_attn.qkv.weight": ("attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight"),
    "txt_attn.qkv.weight": (
        "attn.add_q_proj.weight",
        "attn.add_k_proj.weight",
        "attn.add_v_proj.weight",
    ),
}
SINGLE = {
    "attn.to_qkv_mlp_proj.weight": "linear1.weight",
    "attn.to_out.weight": "linear2.weight",
    "attn.norm_q.weight": "norm.query_norm.scale",
    "attn.norm_k.weight": "norm.key_norm.scale",
}


def bfl_state_dict(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """BFL's tensors of a diffusers state dict: each stream's q, k and v as one `qkv`, the
    norm scales as `.scale`, the final modulation's halves swapped (BFL: shift, scale)."""
    out = {}
    for name, value in weights.items():
        double = re.match(r"transformer_blocks\.(\d+)\.(.+)$", name)
        single = re.match(r"single_transformer_blocks\.(\d+)\.(.+)$", name)
        if double:
            index, rest = double.groups()
            if rest in DOUBLE:
                out[f"double_blocks.{index}.{DOUBLE[rest]}"] = value
        elif single:
            index, rest = single.groups()
            out[f"single_blocks.{index}.{SINGLE[rest]}"] = value
        elif name == FINAL_MOD[0]:
            scale, shift = np.split(value, 2)
            out[FINAL_MOD[1]] = np.concatenate([shift, scale])
        else:
            base, suffix = name.rsplit(".", 1)
            out[f"{TOP[base]}.{suffix}"] = value
    blocks = {
        m.group(1) for m in map(re.compile(r"transformer_blocks\.(\d+)\.").match, weights) if m
    }
    for index in sorted(blocks, key=int):
        for fused, parts in QKV.items():
            stem = f"transformer_blocks.{index}."
            out[f"double_blocks.{index}.{fused}"] = np.concatenate(
                [weights[stem + part] for part in parts]
            )
    return out
