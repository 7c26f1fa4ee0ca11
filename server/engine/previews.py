"""Step previews: a cheap picture of a sampling's latents, without the VAE's decoder.

A preview maps each latent pixel's channels to a colour by one affine map (C + 1 -> 3), as
ComfyUI's "latent2rgb" previews do. The map is not a table copied per family: it is fitted,
once per loaded model, to the model's own VAE by least squares. A probe picture of smooth
random colours is encoded to model-space latents, and the map is the one that best gives the
probe's colours, averaged over each latent pixel, from those latents. A new family therefore
previews with no work of its own.

Cost: the fit is one VAE encode of a 256 x 256 probe (1/16 of a 1024² image's pixels) the
first time a model previews; each preview after that is one (h x w, C + 1) x (C + 1, 3) product
at the latent grid and a bilinear upscale, no network at all (docs/benchmarks.md has the
figures). The picture is soft (one colour per latent pixel, 8 or 16 pixels wide), which is what
a preview is for. mlx-taef's tiny autoencoders were the other choice: they need weights of
their own per VAE, which no model folder carries and this server does not download.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import numpy as np

PROBE_SIDE = 256
PROBE_CELLS = 8  # the probe's random colours: an 8 x 8 grid, smoothly interpolated
PROBE_SEED = 20240601

_FITTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def probe_image() -> np.ndarray:
    """The fitting probe: smooth random colours, uint8 (PROBE_SIDE, PROBE_SIDE, 3)."""
    from PIL import Image

    rng = np.random.default_rng(PROBE_SEED)
    cells = rng.integers(0, 256, (PROBE_CELLS, PROBE_CELLS, 3), dtype=np.uint8)
    picture = Image.fromarray(cells, "RGB").resize(
        (PROBE_SIDE, PROBE_SIDE), Image.Resampling.BICUBIC
    )
    return np.asarray(picture, dtype=np.uint8)


def cell_colours(image: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """The mean colour of each latent pixel's cell: (rows, cols, 3) float32 in [0, 1]."""
    height, width = image.shape[:2]
    cells = image.reshape(rows, height // rows, cols, width // cols, -1).astype(np.float32)
    return cells.mean(axis=(1, 3))[..., :3] / np.float32(255.0)


class LatentPreview:
    """An affine map from model-space latents (C channels) to RGB: `weights` (C + 1, 3)."""

    def __init__(self, weights: np.ndarray) -> None:
        self.weights = np.asarray(weights, dtype=np.float32)

    @classmethod
    def fit(cls, encode_image: Callable[[np.ndarray], np.ndarray]) -> LatentPreview:
        """The map that best gives the probe's cell colours from its latents; `encode_image`
        takes RGB (H, W, 3) in [0, 1] and answers (1, C, h, w) model-space latents."""
        probe = probe_image()
        latents = np.asarray(encode_image(probe.astype(np.float32) / np.float32(255.0)))[0]
        channels, rows, cols = latents.shape
        inputs = _affine_inputs(latents)
        targets = cell_colours(probe, rows, cols).reshape(-1, 3)
        weights, *_ = np.linalg.lstsq(inputs.astype(np.float64), targets, rcond=None)
        return cls(weights)

    def colours(self, latents: np.ndarray) -> np.ndarray:
        """(1, C, h, w) or (C, h, w) latents -> (h, w, 3) float32 in [0, 1]."""
        latents = np.asarray(latents, dtype=np.float32).reshape(np.shape(latents)[-3:])
        _, rows, cols = latents.shape
        rgb = _affine_inputs(latents) @ self.weights
        return np.clip(rgb, 0.0, 1.0).reshape(rows, cols, 3).astype(np.float32)

    def picture(self, latents: np.ndarray, width: int, height: int) -> np.ndarray:
        """The preview at width x height: uint8 (height, width, 3)."""
        from PIL import Image

        colours = np.rint(self.colours(latents) * 255.0).astype(np.uint8)
        small = Image.fromarray(colours, "RGB")
        return np.asarray(small.resize((width, height), Image.Resampling.BILINEAR))


def _affine_inputs(latents: np.ndarray) -> np.ndarray:
    """(C, h, w) -> (h x w, C + 1): each latent pixel's channels and a 1."""
    channels = latents.shape[0]
    flat = latents.reshape(channels, -1).T
    return np.concatenate([flat, np.ones((flat.shape[0], 1), np.float32)], axis=1)


def preview_for(model: object, encode_image: Callable[[np.ndarray], np.ndarray]) -> LatentPreview:
    """The loaded model's preview map, fitted the first time it is asked for (and kept while
    the model lives)."""
    fitted = _FITTED.get(model)
    if fitted is None:
        fitted = _FITTED[model] = LatentPreview.fit(encode_image)
    return fitted
