"""A FLUX.3 DiT's weights in BFL's naming (its own checkpoints, the GGUF files converted from
them, LoRA files trained on them), from a diffusers state dict: the inverse of diffusers'
single-file conversion (`convert_flux3_transformer_checkpoint_to_diffusers`), which the tests
run back on it to check it. Written here from diffusers' tables, not from the server's."""

from __future__ import annotations

import numpy as np

WHOLE = {
    "timestep_embedder.linear_1": "time_in.in_layer",
    "timestep_embedder.linear_2": "time_in.out_layer",
    "target_timestep_embedder.linear_1": "ref_time_in.in_layer",
    "target_timestep_embedder.linear_2": "ref_time_in.out_layer",
    "proj_out": "final_layer.image.linear",
    "norm_out.linear": "final_layer.image.adaLN_modulation.1",
}
PREFIXES = {
    "x_embedders.": "emb_in.",
    "context_embedder.": "txt_in.",
    "mode_blocks.": "content_mode_blocks.",
    "single_transformer_blocks.": "single_blocks.",
}
IN_BLOCK = {
    "attn.to_q.weight": "q_proj.weight",
    "attn.to_k.weight": "k_proj.weight",
    "attn.to_v.weight": "v_proj.weight",
    "attn.to_out.0.weight": "attn_out.weight",
    "attn.norm_q.weight": "norm.query_norm.scale",
    "attn.norm_k.weight": "norm.key_norm.scale",
    "ff.linear_in.weight": "mlp_in.weight",
    "ff.linear_out.weight": "mlp_out.weight",
}


def bfl_layer(layer: str) -> str:
    """BFL's name of a diffusers layer (a name less its `.weight`)."""
    return bfl_key(layer + ".weight").removesuffix(".weight").removesuffix(".scale")


def bfl_key(name: str) -> str:
    stem = name.removesuffix(".weight")
    if stem in WHOLE:
        return WHOLE[stem] + ".weight"
    for diffusers, bfl in PREFIXES.items():
        if name.startswith(diffusers):
            name = bfl + name[len(diffusers) :]
            break
    name = name.replace(".linear.weight", ".lin.weight")
    for diffusers, bfl in IN_BLOCK.items():
        if name.endswith("." + diffusers):
            return name[: -len(diffusers)] + bfl
    return name


def bfl_state_dict(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """BFL's tensors of a diffusers state dict, the final modulation's halves swapped (BFL:
    shift, scale)."""
    out = {}
    for name, value in weights.items():
        if name == "norm_out.linear.weight":
            scale, shift = np.split(value, 2)
            value = np.concatenate([shift, scale])
        out[bfl_key(name)] = value
    return out
