"""The seam between the HTTP side and a model family.

Routes and the steps service talk to a loaded image model only through `ImageModel`.
Arrays cross this seam as numpy float32 arrays; a family converts to MLX inside.
Every method of a loaded model is called on the single image worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


class EngineInputError(ValueError):
    """Input the model cannot take (bad shapes, slots, sizes): answered 400 with its text."""


class MemoryPlanError(EngineInputError):
    """The work does not fit beside the models loaded: answered 400 with a hint of what fits."""


def kept_image_slots(slots, num_refs: int, text_rows: int) -> tuple[int, ...]:
    """The wire rule of image slots (docs/contract.md §2.11), for the route and the engines alike: one
    slot per reference at most (extra slots are dropped), each within 0..text_rows (the text
    row its reference goes before), ascending. Returns the kept slots; references without one
    go after the text (the family's reading)."""
    kept = [int(s) for s in list(slots)[:num_refs]]
    if any(not 0 <= s <= text_rows for s in kept):
        raise EngineInputError(f"image_slots {kept} must lie within 0..{text_rows} (the text rows)")
    if kept != sorted(kept):
        raise EngineInputError(f"image_slots {kept} must be ascending")
    return tuple(kept)


@dataclass(frozen=True)
class StepRow:
    """One row of a step: the conditioning of one batch entry of `x`.

    `cond` is already cut to `num_tokens` (text rows only, the wire form); `cond_key` names it for
    the prefix-state cache (`wire:<hash>` or `wire:<hash>:<n>`). Reference latents are in the DiT's
    model latent space, each (C, h, w); `ref_keys` are their hashes. `image_slots` is the wire form:
    for each reference, the text row before which its slot rows go.
    """

    cond: np.ndarray
    cond_key: str
    ref_latents: tuple[np.ndarray, ...] = ()
    ref_keys: tuple[str, ...] = ()
    image_slots: tuple[int, ...] = ()
    prefix_cache: bool = True


@dataclass
class StepResult:
    out: np.ndarray  # float32, the shape of x: sign x dx/dsigma
    prefix_cache: str  # "hit", "miss", "off" or "none" (docs/contract.md §3.3)
    forward_ms: float  # model evaluation alone, after mx.eval


@dataclass
class EncodeResult:
    cond: np.ndarray  # (1, L, D) float32, text rows only
    ref_latents: list[np.ndarray] = field(default_factory=list)  # each (1, C, h, w), model space
    image_slots: list[int] = field(default_factory=list)


class ImageModel(Protocol):
    """A loaded image model of one family (DiT, text encoder and VAE)."""

    model_id: str
    family: str
    variant: str

    def status(self) -> dict:
        """The family part of GET models/{model}/status: comfy, latent, vae, edit_capable,
        sampling, compute_dtype and memory (dit_bytes, encoder_bytes, vae_bytes)."""

    def manifest(self) -> dict:
        """GET models/{model}/manifest without `model`: family, naming, arch, count, tensors, inline."""

    def encode(self, text: str, images: list[np.ndarray], refs: bool) -> EncodeResult:
        """Encode a prompt; images are uint8 (H, W, 3 or 4) arrays as the client sent them."""

    def denoise_step(
        self,
        x: np.ndarray,
        timestep: np.ndarray,
        rows: list[StepRow],
        *,
        convention: str = "comfy",
        run: str | None = None,
        table: object | None = None,
    ) -> StepResult:
        """The model output for x (B, C, h, w) at timestep (B,) under one row per batch entry."""

    def end_run(self, run: str) -> None:
        """Shed the prefix states that the run kept."""

    def vae_decode(self, latents: np.ndarray, alpha: bool) -> np.ndarray:
        """One image: latents (C, h, w) in the VAE's own space -> (H, W, 3 or 4) in [0, 1]."""

    def vae_encode(self, image: np.ndarray) -> np.ndarray:
        """One image: (H, W, C) in [0, 1] -> latents (C, h, w) in the VAE's own space."""

    def close(self) -> None:
        """Drop the weights."""
