"""The diffusers side of the comparisons, in the layouts of QwenImage21VAE's API."""

from __future__ import annotations

import numpy as np


def reference_encode(model, image: np.ndarray) -> np.ndarray:
    """(1, H, W, C) in [0, 1] -> raw latents (1, z, h, w), as the pipeline encodes (argmax)."""
    import torch
    from diffusers.image_processor import VaeImageProcessor

    pixels = torch.from_numpy(image).permute(0, 3, 1, 2)
    pixels = VaeImageProcessor().normalize(pixels)[:, :, None]  # [0, 1] -> [-1, 1], one frame
    with torch.no_grad():
        return model.encode(pixels).latent_dist.mode()[:, :, 0].numpy()


def reference_decode(model, latents: np.ndarray) -> np.ndarray:
    """Raw latents (1, z, h, w) -> (1, H, W, C) in [0, 1], as the pipeline decodes."""
    import torch
    from diffusers.image_processor import VaeImageProcessor

    with torch.no_grad():
        image = model.decode(torch.from_numpy(latents)[:, :, None], return_dict=False)[0]
        image = VaeImageProcessor().postprocess(image[:, :, 0], output_type="pt")
    return image.permute(0, 2, 3, 1).numpy()
