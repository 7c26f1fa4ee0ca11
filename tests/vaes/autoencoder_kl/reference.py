"""The diffusers side of the AutoencoderKL comparisons, in the layouts of our VAEs' API: an
image (1, H, W, 3) in [0, 1], latents (1, C, h, w) in the VAE's own space."""

from __future__ import annotations

import numpy as np


def reference_encode(model, image: np.ndarray) -> np.ndarray:
    """The posterior mean of the image, as the pipelines encode (argmax of the latent
    distribution)."""
    import torch

    with torch.no_grad():
        pixels = torch.from_numpy(image.transpose(0, 3, 1, 2) * 2 - 1)
        return model.encode(pixels).latent_dist.mode().numpy()


def reference_decode(model, latents: np.ndarray) -> np.ndarray:
    """What the pipelines do after sampling: decode, then x / 2 + 0.5 clamped to [0, 1]."""
    import torch

    with torch.no_grad():
        decoded = model.decode(torch.from_numpy(latents)).sample
    return (decoded / 2 + 0.5).clamp(0, 1).numpy().transpose(0, 2, 3, 1)


def flux2_statistics(model):
    """An AutoencoderKLFlux2's batch-norm statistics (mean, std), over its patchified
    channels, as Flux2KleinPipeline normalises with them."""
    import torch

    mean = model.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(model.bn.running_var.view(1, -1, 1, 1) + model.config.batch_norm_eps)
    return mean, std


def flux2_reference_encode(model, image: np.ndarray) -> np.ndarray:
    """An image as Flux2KleinPipeline encodes a reference: the posterior mean, patchified 2x2,
    normalised by the batch-norm statistics (the DiT's model space)."""
    import torch
    from diffusers import Flux2KleinPipeline

    raw = torch.from_numpy(reference_encode(model, image))
    mean, std = flux2_statistics(model)
    with torch.no_grad():
        return ((Flux2KleinPipeline._patchify_latents(raw) - mean) / std).numpy()


def flux2_reference_decode(model, latents: np.ndarray) -> np.ndarray:
    """Model-space latents as Flux2KleinPipeline decodes its result: the statistics undone,
    unpatchified, then reference_decode."""
    import torch
    from diffusers import Flux2KleinPipeline

    mean, std = flux2_statistics(model)
    with torch.no_grad():
        raw = Flux2KleinPipeline._unpatchify_latents(torch.from_numpy(latents) * std + mean)
    return reference_decode(model, raw.numpy())
