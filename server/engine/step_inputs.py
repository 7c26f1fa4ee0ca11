"""The checks every family makes of a step's inputs, numpy only: x's shape against its rows,
each row's conditioning against the DiT's caption width, its reference latents against the
DiT's channels, and the per-row timestep.

A family calls them from its `step` with its own facts (channels, width); each failure
is an EngineInputError (answered 400) naming what was wrong.
"""

from __future__ import annotations

import numpy as np

from .base import EngineInputError, StepRow


def checked_latents(x: np.ndarray, rows: list[StepRow], channels: int) -> np.ndarray:
    """x as float32 (B, channels, h, w), one batch entry per row."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 4 or x.shape[0] != len(rows) or x.shape[1] != channels:
        raise EngineInputError(
            f"x must be (rows, {channels}, h, w) with one row per batch entry,"
            f" got {x.shape} for {len(rows)} rows"
        )
    return x


def checked_nonempty_latents(x: np.ndarray, rows: list[StepRow], channels: int) -> np.ndarray:
    """`checked_latents` for a DiT that takes latent cells as they are (patch 1): no side 0."""
    x = checked_latents(x, rows, channels)
    if 0 in x.shape:
        raise EngineInputError(f"latents {x.shape[2]}x{x.shape[3]} must not be empty")
    return x


def checked_convention(convention: str, conventions: tuple[str, ...], name: str) -> str:
    """A step convention the family (`name`) answers."""
    if convention not in conventions:
        raise EngineInputError(
            f"unknown convention {convention!r} for {name}; use one of {list(conventions)}"
        )
    return convention


def checked_patch_latents(
    x: np.ndarray, rows: list[StepRow], channels: int, stride: int, patch: int, title: str
) -> np.ndarray:
    """`checked_latents` for a DiT that cuts latents into patch x patch pieces: sides that are
    no multiple of the patch are refused in pixels, naming the node that rounds them."""
    x = checked_latents(x, rows, channels)
    _, _, h, w = x.shape
    if h == 0 or w == 0 or h % patch or w % patch:
        raise EngineInputError(
            f"latents {h}x{w} ({w * stride}x{h * stride} pixels): {title} takes images whose"
            f" sides are multiples of {stride * patch} pixels (latent sides multiples of its"
            f" patch {patch}); in ComfyUI, gmlx Empty Latent rounds a size down to them"
        )
    return x


def checked_cond(row: StepRow, index: int, width: int) -> np.ndarray:
    """A row's conditioning as float32 (L, width), L >= 1 (a leading batch axis of 1 dropped)."""
    cond = np.asarray(row.cond, dtype=np.float32)
    if cond.ndim == 3 and cond.shape[0] == 1:
        cond = cond[0]
    if cond.ndim != 2 or cond.shape[1] != width or cond.shape[0] < 1:
        other = (
            f"; one {cond.shape[1]} wide is another model's text encoder's: encode the prompt"
            " with this model's (in ComfyUI, a gmlx CLIP loader of the same model)"
            if cond.ndim == 2 and cond.shape[0] >= 1
            else ""
        )
        raise EngineInputError(
            f"rows[{index}]: conditioning must be (1, L, {width}) or (L, {width}) with L >= 1,"
            f" got {tuple(np.shape(row.cond))}{other}"
        )
    return cond


def checked_text_cond(row: StepRow, index: int, width: int, title: str) -> np.ndarray:
    """`checked_cond` for a family that takes no reference latents: a row carrying some is
    refused, naming the family."""
    if row.ref_latents:
        raise EngineInputError(f"rows[{index}]: {title} takes no reference latents")
    return checked_cond(row, index, width)


def checked_ref_latents(row: StepRow, index: int, channels: int) -> list[np.ndarray]:
    """A row's reference latents as float32 (channels, h, w) each (a leading batch axis of 1
    dropped): model-space latents, as vae/encode gives them."""
    refs = []
    for k, latent in enumerate(row.ref_latents):
        latent = np.asarray(latent, np.float32)
        if latent.ndim == 4 and latent.shape[0] == 1:
            latent = latent[0]
        if latent.ndim != 3 or latent.shape[0] != channels or 0 in latent.shape:
            raise EngineInputError(
                f"rows[{index}].ref_latents[{k}] must be ({channels}, h, w) model-space"
                f" latents (vae/encode's), got {tuple(np.shape(row.ref_latents[k]))}"
            )
        refs.append(latent)
    return refs


def ref_tokens(row: StepRow) -> int:
    """The tokens of a row's references (one per latent cell)."""
    return sum(int(np.prod(np.shape(r)[-2:])) for r in row.ref_latents)


def cond_rows(row: StepRow, default: int = 0) -> int:
    """The rows of a row's conditioning (`default` when it has no row axis: the quick plan's
    guess before the check refuses it)."""
    shape = np.shape(row.cond)
    return int(shape[-2]) if len(shape) >= 2 else default


def row_sigmas(timestep: np.ndarray, batch: int) -> np.ndarray:
    """The per-row sigma (float32) of a timestep read as sigma: one value for every row, or
    one per row."""
    values = np.asarray(timestep, dtype=np.float64).reshape(-1)
    if values.size == 1:
        values = np.repeat(values, batch)
    if values.size != batch:
        raise EngineInputError(f"timestep has {values.size} values for {batch} rows")
    return values.astype(np.float32)
