"""Run inside a ComfyUI checkout's interpreter (cwd: the checkout): ComfyUI's own Z-Image DiT
(`comfy.ldm.lumina.model.NextDiT` with the Z-Image settings of its model detection) on a tiny
diffusers transformer folder, its weights renamed by ComfyUI's `z_image_to_diffusers` map.

    python comfy_forward.py TRANSFORMER_DIR INPUTS.npz OUT.npy

INPUTS.npz holds `x` (B, C, H, W), `sigma` (B,) and `cap` (B, L, D); OUT.npy gets what
ComfyUI's model call returns for them (timestep = sigma)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file


def comfy_state_dict(files: dict, config: dict) -> dict:
    import comfy.utils

    key_map = comfy.utils.z_image_to_diffusers(
        {
            "n_layers": config["n_layers"],
            "dim": config["dim"],
            "n_refiner_layers": config["n_refiner_layers"],
        }
    )
    out = {}
    for name, value in files.items():
        target = key_map.get(name)
        if target is None:
            raise KeyError(f"ComfyUI's map has no {name}")
        if isinstance(target, tuple):  # a slice of a fused weight: (key, (dim, offset, size))
            key, (dim, offset, size) = target
            fused = out.setdefault(key, {})
            fused[offset] = value
        else:
            out[target] = value
    for key, parts in list(out.items()):
        if isinstance(parts, dict):
            out[key] = torch.cat([parts[offset] for offset in sorted(parts)], dim=0)
    return out


def main(transformer_dir: str, inputs_path: str, out_path: str) -> None:
    from comfy.cli_args import args

    args.cpu = True  # before comfy.model_management reads it
    import comfy.ops
    from comfy.ldm.lumina.model import NextDiT

    config = json.loads((Path(transformer_dir) / "config.json").read_text())
    files = load_file(str(Path(transformer_dir) / "diffusion_pytorch_model.safetensors"))
    model = NextDiT(
        patch_size=2,
        in_channels=config["in_channels"],
        dim=config["dim"],
        n_layers=config["n_layers"],
        n_refiner_layers=config["n_refiner_layers"],
        n_heads=config["n_heads"],
        n_kv_heads=config["n_kv_heads"],
        multiple_of=1,  # the tiny width is no multiple of ComfyUI's 256
        ffn_dim_multiplier=8.0 / 3.0,
        norm_eps=config["norm_eps"],
        qk_norm=True,
        cap_feat_dim=config["cap_feat_dim"],
        axes_dims=config["axes_dims"],
        axes_lens=config["axes_lens"],
        rope_theta=config["rope_theta"],
        z_image_modulation=True,
        time_scale=1000.0,
        pad_tokens_multiple=32,
        operations=comfy.ops.disable_weight_init,
        dtype=torch.float32,
    )
    missing, unexpected = model.load_state_dict(comfy_state_dict(files, config), strict=False)
    if missing or unexpected:
        raise KeyError(f"missing {missing}, unexpected {unexpected}")
    inputs = np.load(inputs_path)
    cap = torch.from_numpy(inputs["cap"])
    with torch.no_grad():
        out = model.eval()(
            torch.from_numpy(inputs["x"]),
            torch.from_numpy(inputs["sigma"]),
            cap,
            num_tokens=cap.shape[1],
        )
    np.save(out_path, out.numpy())


if __name__ == "__main__":
    main(*sys.argv[1:4])
