"""Run inside a ComfyUI checkout's interpreter (cwd: the checkout): ComfyUI's own Wan 2.1 VAE
(`comfy.ldm.wan.vae.WanVAE`) on a tiny Wan-named VAE file, and the names of its full-size
module (the configuration `comfy.sd.VAE` builds for a Wan 2.1 file), on the meta device.

    python comfy_wan_vae.py VAE.safetensors CONFIG.json LATENTS.npy OUT.npy NAMES.json

OUT.npy gets the decode of LATENTS (1, z, h, w) as (h*8, w*8, 3) in [0, 1]; NAMES.json the
full-size module's tensor names and shapes."""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from safetensors.torch import load_file


def main(vae_file: str, config_file: str, latents_file: str, out_file: str, names_file: str):
    from comfy.cli_args import args

    args.cpu = True  # before comfy.model_management reads it
    from comfy.ldm.wan.vae import WanVAE

    config = json.loads(open(config_file).read())
    model = WanVAE(
        dim=config["base_dim"],
        z_dim=config["z_dim"],
        dim_mult=config["dim_mult"],
        num_res_blocks=config["num_res_blocks"],
        temperal_downsample=config["temperal_downsample"],
    )
    model.load_state_dict(load_file(vae_file), strict=True)
    latents = torch.from_numpy(np.load(latents_file))[:, :, None]  # one frame
    with torch.no_grad():
        image = model.decode(latents)[0, :, 0].permute(1, 2, 0)
    np.save(out_file, ((image.clamp(-1, 1) + 1) / 2).numpy())
    with torch.device("meta"):
        full = WanVAE(dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                      temperal_downsample=[False, True, True])  # fmt: skip
    names = {name: list(value.shape) for name, value in full.state_dict().items()}
    open(names_file, "w").write(json.dumps(names))


if __name__ == "__main__":
    main(*sys.argv[1:6])
