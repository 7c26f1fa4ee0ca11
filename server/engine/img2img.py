"""Image to image and inpainting: the arithmetic the sampler adds when it starts from an image.

The method is that of diffusers' img2img and inpaint pipelines (ZImageImg2ImgPipeline,
ZImageInpaintPipeline, Flux2KleinInpaintPipeline), which ComfyUI's denoise < 1 and noise masks
share:
- the init image, resized to the request's size (Lanczos, as diffusers' image processor does),
  is VAE-encoded (the distribution's mean) into the DiT's model space;
- the sampler starts at the schedule's first sigma s0 from `noised(latents, noise, s0)`,
  s0 x noise + (1 - s0) x latents (the flow scheduler's `scale_noise`);
- with a mask, after every step the known region is put back, re-noised to the sigma the step
  reached: `blended` (at the last step, sigma 0: the image itself).

Masks are grayscale, 255 where to paint. They are resized to the image (Lanczos), binarized at
one half as the pipelines' mask processors do, optionally feathered (`mask_blur`: a Gaussian
of that radius in pixels, so the blend is soft across the edge), then brought to the latent
grid by the family's rule (`status.conditioning.inpaint_mask`: "nearest" as Z-Image's pipeline
does, "bilinear" as FLUX.2 klein's and ComfyUI's do), with torch's interpolation arithmetic.
Numpy and Pillow only.
"""

from __future__ import annotations

import numpy as np

MASK_RESIZES = ("nearest", "bilinear")
DEFAULT_MASK_RESIZE = "bilinear"


def init_rgb(image: np.ndarray, width: int, height: int) -> np.ndarray:
    """An init image (uint8 (H, W, 3 or 4)) as the VAE encodes it: RGB, resized to width x
    height where it is another size; uint8 (height, width, 3)."""
    from PIL import Image

    picture = Image.fromarray(np.ascontiguousarray(image[..., :3], dtype=np.uint8), "RGB")
    if picture.size != (width, height):
        picture = picture.resize((width, height), Image.Resampling.LANCZOS)
    return np.asarray(picture, dtype=np.uint8)


def pixel_mask(mask: np.ndarray, width: int, height: int, blur: float = 0.0) -> np.ndarray:
    """A mask (uint8 (H, W), 255 where to paint) at width x height, binarized at one half and
    feathered by a Gaussian of radius `blur` pixels: float32 (height, width) in [0, 1]."""
    from PIL import Image, ImageFilter

    picture = Image.fromarray(np.ascontiguousarray(mask, dtype=np.uint8), "L")
    if picture.size != (width, height):
        picture = picture.resize((width, height), Image.Resampling.LANCZOS)
    binary = np.asarray(picture, dtype=np.float32) / np.float32(255.0) >= 0.5
    if blur <= 0:
        return binary.astype(np.float32)
    feathered = Image.fromarray(binary.astype(np.uint8) * 255, "L")
    feathered = feathered.filter(ImageFilter.GaussianBlur(blur))
    return np.asarray(feathered, dtype=np.float32) / np.float32(255.0)


def latent_mask(mask: np.ndarray, rows: int, cols: int, resize: str) -> np.ndarray:
    """A pixel mask (H, W) on the latent grid, (1, 1, rows, cols) float32, by torch's
    `interpolate` in `resize` mode ("nearest", or "bilinear" without corner alignment)."""
    mask = np.asarray(mask, dtype=np.float32)
    if resize == "nearest":
        grid = mask[np.ix_(_nearest(mask.shape[0], rows), _nearest(mask.shape[1], cols))]
    elif resize == "bilinear":
        grid = _bilinear_axis(_bilinear_axis(mask, rows, 0), cols, 1)
    else:
        raise ValueError(f"unknown mask resize {resize!r}; one of {', '.join(MASK_RESIZES)}")
    return np.ascontiguousarray(grid[None, None], dtype=np.float32)


def _nearest(size: int, out: int) -> np.ndarray:
    scale = np.float32(size / out)
    return np.minimum(np.floor(np.arange(out, dtype=np.float32) * scale).astype(int), size - 1)


def _bilinear_axis(values: np.ndarray, out: int, axis: int) -> np.ndarray:
    size = values.shape[axis]
    scale = np.float32(size / out)
    source = (np.arange(out, dtype=np.float32) + np.float32(0.5)) * scale - np.float32(0.5)
    source = np.maximum(source, np.float32(0.0))
    low = np.minimum(np.floor(source).astype(int), size - 1)
    high = np.minimum(low + 1, size - 1)
    weight = (source - low).astype(np.float32)
    shape = [1, 1]
    shape[axis] = out
    weight = weight.reshape(shape)
    first, second = np.take(values, low, axis=axis), np.take(values, high, axis=axis)
    return (first * (np.float32(1.0) - weight) + second * weight).astype(np.float32)


def noised(latents: np.ndarray, noise: np.ndarray, sigma: np.float32) -> np.ndarray:
    """Clean latents brought to `sigma` along the flow: sigma x noise + (1 - sigma) x latents."""
    sigma = np.float32(sigma)
    return (sigma * noise + (np.float32(1.0) - sigma) * latents).astype(np.float32)


def blended(
    x: np.ndarray, latents: np.ndarray, noise: np.ndarray, sigma: np.float32, mask: np.ndarray
) -> np.ndarray:
    """The latents after a step at `sigma`: the sampled ones where the mask paints, the init
    image re-noised to `sigma` elsewhere (mask 1: sampled, 0: kept)."""
    known = noised(latents, noise, sigma)
    return ((np.float32(1.0) - mask) * known + mask * x).astype(np.float32)
