"""The seam between the HTTP side and a model family.

Routes and the steps service talk to a loaded image model only through `ImageModel`.
Arrays cross this seam as numpy float32 arrays; a family converts to MLX inside.
Every method of a loaded model is called on the single image worker thread.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol

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


@dataclass(frozen=True)
class StepCall:
    """How a step runs, beyond its inputs: the keywords of `ImageModel.denoise_step`, as one
    object a family's `FamilyModel.step` receives."""

    convention: str = "comfy"
    run: str | None = None
    table: object | None = None
    plans: Any = None
    ref_cache: bool = False
    skip: tuple[int, ...] = ()
    sample_sigmas: np.ndarray | None = None


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


@dataclass(frozen=True, kw_only=True)
class ReferenceSizes:
    """The reference images a family's pipeline takes as they are (it would resize one of
    another size, which the encode route does not): sides that are multiples of the VAE's
    stride, at least `min_side`, at most `max_side` and within an aspect ratio of `max_aspect`
    where they are set, and at least `min_area` and at most `max_area` pixels (`lone_max_area`
    where set, for a reference that is the only one of its request). With `side_multiple`,
    any sides are taken: the family's encoder resizes an image at its own area to sides in
    multiples of it (Qwen-Image 2.1, docs/contract.md §2.6).

    How the pipeline brings an image of another size to these (engine/reference_images.py,
    for the server's own sampler): "crop" (downscaled to the area, center-cropped to the
    stride); for a lone reference `lone_fit` "pad" (downscaled to the area, padded by
    reflection to the stride); with `side_multiple`, resized to `max_area` at its aspect."""

    min_side: int
    max_side: int | None = None
    max_aspect: int | None = None
    min_area: int = 0
    max_area: int
    lone_max_area: int | None = None
    lone_fit: str = "crop"
    side_multiple: int | None = None

    def status(self) -> dict:
        """Status `conditioning.reference_sizes` (docs/contract.md §2.3, an extension)."""
        return dataclasses.asdict(self)

    def area(self, count: int) -> int:
        """The most pixels of each of `count` references."""
        return (
            self.lone_max_area if self.lone_max_area is not None and count == 1 else self.max_area
        )

    def fits(self, height: int, width: int, count: int, stride: int) -> bool:
        """Whether an image of `height` x `width`, one of `count`, is taken as it is."""
        short, long = sorted((height, width))
        return not (
            (self.side_multiple is None and (height % stride or width % stride))
            or short < self.min_side
            or (self.max_side is not None and long > self.max_side)
            or (self.max_aspect is not None and long > self.max_aspect * short)
            or not self.min_area <= height * width <= self.area(count)
        )

    def check(
        self, index: int, height: int, width: int, count: int, stride: int, title: str
    ) -> None:
        """Refuse image `index` of `count` where it does not fit (an EngineInputError naming
        the sizes the pipeline takes)."""
        if self.fits(height, width, count, stride):
            return
        if self.side_multiple is not None:
            raise EngineInputError(
                f"image {index} is {width}x{height}: {title} references must have from"
                f" {self.min_area} to {self.max_area} pixels (each is resized at its own area"
                f" to sides in multiples of {self.side_multiple})"
            )
        if self.max_side is None:
            sides = f"multiples of {stride}, at least {self.min_side}"
        else:
            sides = f"multiples of {stride} from {self.min_side} to {self.max_side}"
        if self.max_aspect is not None:
            sides += f", within an aspect ratio of {self.max_aspect}"
        which = ""
        if self.lone_max_area is not None:
            which = "one reference: " if count == 1 else "each of several: "
        raise EngineInputError(
            f"image {index} is {width}x{height}: {title} references must have sides that are"
            f" {sides} and at most {self.area(count)} pixels ({which}the pipeline's sizes,"
            " which it would resize to), or be sent as latents from vae/encode"
        )


@dataclass(frozen=True)
class Capabilities:
    """What a model can do beyond its status, read once at load (registry.LoadedModel) and
    checked by the step route before any work (docs/contract.md §2.11)."""

    max_refs: int = 10  # reference images a row may carry
    # the reference images' sizes its pipeline takes as they are (None: any); encode checks
    reference_sizes: ReferenceSizes | None = None
    conventions: tuple[str, ...] = ("comfy", "reference")  # step conventions (§5.2)
    ref_cache: bool = False  # the DiT can extract reference K/V (§3.4); `ref_cache_bytes` plans it
    # the conventions under which the DiT steps a row in parts, its state kept in the run
    # (§3.3): `ref_cache` is refused under them (§3.4)
    in_parts: tuple[str, ...] = ()
    skip_blocks: int = 0  # how many DiT blocks `skip` may name (0: the DiT skips none)
    flow_map: bool = False  # the step needs `sample_sigmas`

    def ref_cache_refusal(self, convention: str, who: str) -> str | None:
        """Why `who` refuses a `ref_cache` step under `convention` (§3.4), or None."""
        if not self.ref_cache:
            return f"{who} cannot cache reference K/V; send ref_cache false"
        if convention in self.in_parts:
            return (
                f"{who} steps in parts under the {convention} convention, its references' K/V"
                " kept as each row's state; send ref_cache false"
            )
        return None


@dataclass(frozen=True)
class Facts:
    """What the routes and the memory planner read of a loaded model, typed, and what its
    status publishes of them (docs/contract.md §2.3: `latent.channels`, `latent.stride`,
    `latent.patch`, `vae.stride`, `vae.channels_out`, `edit_capable`, `memory.resident_bytes`;
    a family writes those members from these values, engine/family.py). The step's route checks
    x and the rows against them (its step 11) before any plan, a dry run's too."""

    latent_channels: int  # the step's x channels (model space), and each reference's
    latent_stride: int  # pixels per latent cell
    vae_stride: int  # pixels per cell of the VAE routes' latents
    vae_channels_out: int  # the image channels a decode gives (3, or 4 with alpha)
    edit_capable: bool  # a row may carry reference images
    cond_width: int  # a row's conditioning width, D (what the text encoder gives the DiT)
    latent_patch: int = 1  # the DiT's patch: x's sides are multiples of it
    resident_bytes: int = 0  # the memory plan's footprint of the model loaded (0: its weights)


class MemoryPlanning(Protocol):
    """What the memory planner (server/memory.py) asks a loaded model: pure estimates from
    shapes and config, and the states it may shed. `plans` is the model's own plan of a step's
    rows (`plan_step`), made once by the planner and handed back to the estimates and to
    `denoise_step`; a model without per-row planning returns None from `plan_step`."""

    weight_bytes: int  # the weights held now, counted from the arrays
    # The text encoder's residency (engine/family.py): its weights' bytes as loaded, whether
    # they are held now, and whether `release_encoder` would free them.
    encoder_bytes: int
    encoder_resident: bool
    encoder_releasable: bool

    def release_encoder(self) -> int:
        """Drop the text encoder's weights until the next encode loads them again; the bytes
        freed (0 when nothing could be released)."""

    def held_bytes(self) -> int:
        """What the model holds beyond its weights (prefix states, patched weight trees)."""

    def plan_step(self, x_shape: tuple, rows: list[StepRow], table: object | None = None) -> Any:
        """The rows' plan for a step of x_shape, or None."""

    def step_peak_bytes(
        self,
        x_shape: tuple,
        rows: list[StepRow] | None,
        table: object | None = None,
        plans: Any = None,
    ) -> int:
        """A step's peak beyond weights and held states; rows None: the target pass alone."""

    def step_keys(
        self, x_shape: tuple, rows: list[StepRow], table: object | None = None, plans: Any = None
    ) -> set:
        """The held states a step uses (never shed to make room for that step)."""

    def vae_peak_bytes(self, height: int, width: int, decode: bool, tiled: bool = False) -> int:
        """One VAE pass's peak at height x width pixels, whole or (`tiled`) in tiles."""

    def vae_tileable(self, height: int, width: int, decode: bool) -> bool:
        """Whether that pass can run in tiles (which are not the whole pass): the memory plan's
        fallback where the whole pass does not fit."""

    def shed_states(self, need_bytes: int, keep: set) -> int:
        """Shed held states (never those in `keep`) until need_bytes are freed; the bytes freed."""

    def ref_cache_bytes(self, rows: list[StepRow], table: object | None, run: str) -> int:
        """The reference K/V a `ref_cache` step adds to `run` (asked only of a model whose
        capabilities have `ref_cache`)."""


class ImageModel(MemoryPlanning, Protocol):
    """A loaded image model of one family (DiT, text encoder and VAE). The registry refuses a
    model that lacks any member (`seam_gaps`)."""

    model_id: str
    family: str
    variant: str
    capabilities: Capabilities
    facts: Facts

    def status(self) -> dict:
        """The family part of GET models/{model}/status: comfy, latent, vae, edit_capable,
        sampling, compute_dtype and memory (dit_bytes, encoder_bytes, vae_bytes), its `facts`
        among them."""

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
        plans: Any = None,
        ref_cache: bool = False,
        skip: tuple[int, ...] = (),
        sample_sigmas: np.ndarray | None = None,
    ) -> StepResult:
        """The model output for x (B, C, h, w) at timestep (B,) under one row per batch entry.
        `plans`: this step's `plan_step`; `ref_cache`, `skip` and `sample_sigmas` come only
        as far as `capabilities` allow (the route refuses them otherwise)."""

    def check_patch_table(self, table: object) -> None:
        """Refuse (EngineInputError) a LoRA patch table whose keys, bands or shapes do not fit
        the DiT; called when the table is put."""

    def end_run(self, run: str) -> None:
        """Shed the prefix states that the run kept."""

    def state_keys(self) -> list:
        """The keys of the prefix states held now (server/distributed.py: what rank 0 holds,
        sent with each step)."""

    def keep_states(self, keys) -> None:
        """Drop every held state but those of `keys` (another rank mirroring rank 0's)."""

    def vae_space(self, latents: np.ndarray) -> np.ndarray:
        """Latents (C, h, w) in the DiT's model space -> the VAE routes' space (the identity
        where status `vae.space` is "model")."""

    def model_space(self, latents: np.ndarray) -> np.ndarray:
        """Latents (C, h, w) in the VAE routes' space -> the DiT's model space (`vae_space`'s
        inverse; what an image to image starts from)."""

    def vae_decode(self, latents: np.ndarray, alpha: bool, tiled: bool = False) -> np.ndarray:
        """One image: latents (C, h, w) in the VAE's own space -> (H, W, 3 or 4) in [0, 1],
        in tiles where the memory plan says so."""

    def vae_encode(self, image: np.ndarray, tiled: bool = False) -> np.ndarray:
        """One image: (H, W, C) in [0, 1] -> latents (C, h, w) in the VAE's own space, in
        tiles where the memory plan says so."""

    def close(self) -> None:
        """Drop the weights."""


def seam_gaps(model: object) -> list[str]:
    """The members of the `ImageModel` seam that `model` lacks (methods not callable count)."""
    gaps = []
    for protocol in (ImageModel, MemoryPlanning):
        for name in (*protocol.__annotations__, *_methods(protocol)):
            value = getattr(model, name, _MISSING)
            if value is _MISSING or (name in _methods(protocol) and not callable(value)):
                gaps.append(name)
    return sorted(set(gaps))


def _methods(protocol: type) -> list[str]:
    return [name for name, value in vars(protocol).items() if callable(value) and name[0] != "_"]


_MISSING = object()
