"""Reference images of any size brought to the sizes a family's pipeline takes, as the pipeline
brings them, for the server's own sampler (the OpenAI edit routes, `gmlx image sample --ref`).

The encode route takes references only at those sizes and refuses others (a client such as
the ComfyUI pack sizes its images itself). A sampling that starts from a user's picture does
what the family's diffusers pipeline does with it, by the bounds in status
`conditioning.reference_sizes` (base.ReferenceSizes):
- "crop" (`Flux2KleinPipeline`; FLUX.3 klein's modular blocks for several references): an
  image under `min_side` a side or beyond `max_aspect` is refused, as FLUX.2's pipeline
  refuses it; one over the area is downscaled to it (Lanczos, its sides truncated), then
  center-cropped to multiples of the stride.
- "pad" (FLUX.3 klein's lone reference, kept whole): downscaled until its canvas, its sides
  rounded up to the stride within `min_side`..`max_side`, fits `lone_max_area` (the scale
  backed off by 0.5% while it does not), then padded to the canvas by reflection, centered.
  With no size given the pipeline generates at the canvas and crops its output back to the
  picture (`lone_canvas`: the OpenAI edit's size "auto").
- with `side_multiple` (Qwen-Image 2.1, whose encoder takes any sides at an area from
  `min_area` to `max_area`): a picture outside that is resized to `QwenImage21Pipeline`'s
  size for it, `max_area` pixels at its aspect with sides in multiples of `side_multiple`.

An image that the bounds take as it is stays as it is. Numpy and Pillow only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .base import ReferenceSizes
from .sampling import SettingError

BACK_OFF = 0.995  # the pad fit's scale step while the canvas is over the area


@dataclass(frozen=True)
class Fit:
    """Where an image goes: resized to `resized` (height, width), then cropped or padded
    (`pad`) to `final`, centered."""

    resized: tuple[int, int]
    final: tuple[int, int]
    pad: bool

    def box(self) -> tuple[int, int, int, int]:
        """(left, top, right, bottom), centered: where the resized picture sits in its canvas
        (`pad`), or the part of it that a crop keeps."""
        inner, outer = (self.resized, self.final) if self.pad else (self.final, self.resized)
        top, left = ((o - i) // 2 for o, i in zip(outer, inner, strict=True))
        return left, top, left + inner[1], top + inner[0]


def reference_sizes(status: dict) -> ReferenceSizes | None:
    """The bounds a model's status publishes (None: it takes references of any size)."""
    row = (status.get("conditioning") or {}).get("reference_sizes")
    return None if row is None else ReferenceSizes(**row)


def check_references(status: dict, images: Sequence[np.ndarray]) -> None:
    """Refuse, before any work, references on a model that takes none (status `edit_capable`
    false), or one that its fit leaves outside the bounds (a SettingError of `ref`, naming the
    image and the bounds)."""
    if images and not status.get("edit_capable", True):
        raise SettingError("ref", "the model takes no reference images")
    sizes = reference_sizes(status)
    if sizes is not None:
        for index, image in enumerate(images):
            plan(sizes, index, *np.shape(image)[:2], len(images), _stride(status))


def fitted_references(status: dict, images: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
    """The reference images (uint8 (H, W, 3 or 4)) at the sizes the model takes, each as its
    pipeline brings it there."""
    sizes = reference_sizes(status)
    if sizes is None:
        return tuple(images)
    count, stride = len(images), _stride(status)
    return tuple(
        fitted(image, plan(sizes, index, *image.shape[:2], count, stride), stride)
        for index, image in enumerate(images)
    )


def lone_canvas(
    status: dict, images: Sequence[np.ndarray]
) -> tuple[tuple[int, int], tuple[int, int, int, int]] | None:
    """For a lone reference that the family keeps whole (`lone_fit` "pad": FLUX.3 klein's
    modular blocks), the canvas (height, width) it is padded to, which the pipeline generates
    at when no size is given, and the box (left, top, right, bottom) the picture holds in it,
    which the pipeline then crops its output back to (`reference_crop`). None for several
    references or another fit."""
    sizes = reference_sizes(status)
    if sizes is None or sizes.lone_fit != "pad" or len(images) != 1:
        return None
    fit = plan(sizes, 0, *np.shape(images[0])[:2], 1, _stride(status))
    return fit.final, fit.box()  # a picture taken as it is fills its canvas


def plan(
    sizes: ReferenceSizes, index: int, height: int, width: int, count: int, stride: int
) -> Fit:
    """Where image `index` of `count`, `height` x `width`, goes; a SettingError where the
    pipeline refuses it or its fit is still outside the bounds."""
    if sizes.fits(height, width, count, stride):
        return Fit((height, width), (height, width), False)
    if sizes.side_multiple is not None:
        fit = _area_plan(sizes.area(count), height, width, sizes.side_multiple)
    elif count == 1 and sizes.lone_fit == "pad":
        fit = _pad_plan(sizes, height, width, stride)
    else:
        _check_taken(sizes, index, height, width)
        fit = _crop_plan(sizes.area(count), height, width, stride)
    if not sizes.fits(*fit.final, count, stride):
        _refuse(sizes, index, height, width)
    return fit


def fitted(image: np.ndarray, fit: Fit, stride: int) -> np.ndarray:
    """The image resized and cropped or padded as `fit` says."""
    from PIL import Image

    if fit.final == image.shape[:2]:
        return image
    picture = Image.fromarray(np.ascontiguousarray(image, dtype=np.uint8))
    if fit.resized != image.shape[:2]:
        picture = picture.resize(fit.resized[::-1], Image.Resampling.LANCZOS)
    left, top, right, bottom = fit.box()
    if not fit.pad:
        return np.asarray(picture.crop((left, top, right, bottom)))
    (height, width), (final_height, final_width) = fit.resized, fit.final
    # reflection leaves out the edge pixel; an image of one token or less is mirrored instead
    mode = "reflect" if min(height, width) > stride else "symmetric"
    padding = ((top, final_height - bottom), (left, final_width - right), (0, 0))
    return np.pad(np.asarray(picture.convert("RGB")), padding, mode=mode)


def _crop_plan(area: int, height: int, width: int, stride: int) -> Fit:
    if height * width > area:
        scale = math.sqrt(area / (height * width))
        height, width = int(height * scale), int(width * scale)
    return Fit((height, width), (height - height % stride, width - width % stride), False)


def _area_plan(area: int, height: int, width: int, multiple: int) -> Fit:
    """The pipeline's size of a picture (`QwenImage21Pipeline`'s `calculate_dimensions`):
    `area` pixels at its aspect, sides rounded to `multiple`; floored where the rounding
    lands over the area, which the encoder would refuse."""
    ratio = width / height
    exact_width = math.sqrt(area * ratio)
    exact_height = exact_width / ratio
    sides = (round(exact_height / multiple) * multiple, round(exact_width / multiple) * multiple)
    if sides[0] * sides[1] > area:
        sides = (int(exact_height // multiple) * multiple, int(exact_width // multiple) * multiple)
    return Fit(sides, sides, False)


def _pad_plan(sizes: ReferenceSizes, height: int, width: int, stride: int) -> Fit:
    area = sizes.area(1)
    scale = min(1.0, math.sqrt(area / (height * width)), sizes.max_side / max(height, width))
    while True:
        resized = tuple(max(1, round(side * scale)) for side in (height, width))
        canvas = _canvas(sizes, *resized, stride)
        if canvas[0] * canvas[1] <= area:
            return Fit(resized, canvas, True)
        scale *= BACK_OFF


def _canvas(sizes: ReferenceSizes, height: int, width: int, stride: int) -> tuple[int, int]:
    """An image's sides rounded up to the stride, within min_side..max_side."""
    return tuple(
        min(sizes.max_side, max(sizes.min_side, -(-side // stride) * stride))
        for side in (height, width)
    )


def _check_taken(sizes: ReferenceSizes, index: int, height: int, width: int) -> None:
    """The pipeline's own refusal: a side under min_side, or an aspect beyond max_aspect."""
    short, long = sorted((height, width))
    if short < sizes.min_side or (sizes.max_aspect is not None and long > sizes.max_aspect * short):
        _refuse(sizes, index, height, width)


def _refuse(sizes: ReferenceSizes, index: int, height: int, width: int) -> None:
    said = f"reference image {index} is {width}x{height}: the model takes references"
    if sizes.side_multiple is not None:
        taken = (
            f"of {sizes.min_area} to {sizes.max_area} pixels with sides of at least"
            f" {sizes.side_multiple}, which this one's aspect does not allow"
        )
    else:
        sides = f"at least {sizes.min_side}"
        if sizes.max_side is not None:
            sides += f" and at most {sizes.max_side}"
        aspect = (
            "" if sizes.max_aspect is None else f", within an aspect ratio of {sizes.max_aspect}"
        )
        taken = f"of {sides} pixels a side{aspect}"
    raise SettingError("ref", f"{said} {taken}", index=index)


def _stride(status: dict) -> int:
    return int(status["vae"]["stride"])
