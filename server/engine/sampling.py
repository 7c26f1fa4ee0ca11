"""The in-process flow-matching sampler.

The sampler owns the noise, the sigma schedule, classifier-free guidance and the update rule; it
calls the model only through a step function `step_fn(x, timestep, rows) -> out`, where `out` is
the step route's answer (sign x dx/dsigma, float32, the shape of `x`). Two step functions exist:
the direct one calls `ImageModel.denoise_step` in process, and the via-steps one sends the same
arrays and rows to `POST step` over HTTP (`gmlx_contract.client.StepClient.step`). Both see the
same batch composition (x duplicated, the cond row then the uncond row) and this module does every
piece of arithmetic between the calls in numpy float32, so the two paths give bit-identical final
latents (docs/contract.md §6, tests/sampling/test_equal_to_direct.py).

Noise is ComfyUI's: `noise.comfy_noise(seed, (1, C, H / stride, W / stride))`, what torch's CPU
`randn` gives after `manual_seed(seed)`, in the DiT's model latent space, so that ComfyUI's stock
samplers and this sampler start from the same latents at the same seed.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from gmlx_contract import wire
from gmlx_contract.hashing import tensor_hash

from . import unipc
from .base import EncodeResult, StepRow
from .noise import comfy_noise

# A step function: latents (B, C, h, w) f32, timestep (B,) f32, one row per batch entry, and
# the DiT blocks every row leaves out (`skip`) -> the model output (B, C, h, w) f32. Rows are
# opaque here: StepRow objects for the direct path, wire row dicts for the via-steps path.
StepFn = Callable[..., np.ndarray]


@dataclass(frozen=True)
class Guidance:
    """The rows of one sampling: the prompt's row and, when guided, the negative prompt's row,
    whose pass leaves out the DiT blocks `neg_skip` (status `sampling.neg_skip`)."""

    cond: Any
    uncond: Any | None = None
    cfg: float = 1.0
    neg_skip: tuple[int, ...] = ()

    @property
    def guided(self) -> bool:
        """True classifier-free guidance runs only with a negative row and a scale other than 1."""
        return self.uncond is not None and self.cfg != 1.0

    def rows(self) -> list[Any]:
        return [self.cond, self.uncond] if self.guided else [self.cond]


MAX_MASK_BLUR = 256.0  # pixels
# The bounds of a request's numbers, for every way one comes (the routes, the command line).
MAX_STEPS = 1000
MAX_SEED = 2**63 - 1
MAX_GUIDANCE = 100
# The longest schedule a strength below 1 may shorten (int(steps / strength) steps).
MAX_SCHEDULE = 10_000


class SettingError(ValueError):
    """An `ImageRequest` setting the model cannot take. `setting` is the field it is about;
    `text` says what is wrong with `{name}` in place of the setting's name, so that each caller
    names it as its user sent it (`naming`: the command line's flag, an HTTP route's field);
    `index`, for a setting that is a list (the reference images), the item it is about."""

    def __init__(self, setting: str, text: str, index: int | None = None) -> None:
        super().__init__(text.format(name=setting))
        self.setting, self.text, self.index = setting, text, index

    def naming(self, name: str) -> str:
        return self.text.format(name=name)


def initial_noise(seed: int, channels: int, latent_height: int, latent_width: int) -> np.ndarray:
    """The starting latents (1, C, h, w), float32, in model space: ComfyUI's noise for the seed
    (its `prepare_noise` on a LATENT of this shape)."""
    return comfy_noise(seed, (1, channels, latent_height, latent_width))


def linear_sigmas(steps: int) -> np.ndarray:
    """steps + 1 sigmas evenly from 1 to 0: the schedule when a model publishes none."""
    return np.linspace(1.0, 0.0, steps + 1, dtype=np.float32)


def shifted_sigmas(steps: int, shift: float) -> np.ndarray:
    """steps + 1 sigmas under a static flow shift (status `sampling.shift` other than 1), as
    diffusers' FlowMatchEulerDiscreteScheduler shifts torch's linspace(1, 1/steps, steps)
    (ZImagePipeline's default): shift s / (1 + (shift - 1) s) in float32, then 0 appended."""
    from gmlx_contract.schedules import torch_linspace

    base = torch_linspace(1.0, 1.0 / steps, steps)
    shifted = shift * base / (1 + (shift - 1) * base)  # float32: numpy's weak Python scalars
    return np.append(shifted, np.float32(0.0)).astype(np.float32)


def resolve_sigmas(
    sampling: dict | None,
    steps: int | None,
    width: int,
    height: int,
    *,
    pixels_per_token: int,
    denoise: float = 1.0,
) -> np.ndarray:
    """The sigma schedule (float32, ending in 0) for a model's status `sampling` object.

    A variant's fixed `sigmas` win (a `steps` that disagrees with their count is refused), else the
    size-dependent `schedule` rule of docs/contract.md §5.3, else a linear schedule under the
    variant's static `shift` (`shifted_sigmas`; plain linear at shift 1). `steps` None means the
    variant's own step count. At `denoise` (an image to image's strength) below 1 the schedule
    is shortened as ComfyUI's schedulers shorten it (§5.3): a rule is evaluated for
    int(steps / denoise) steps and its last `steps` are kept; fixed sigmas keep their last
    int(count x denoise) steps.
    """
    from gmlx_contract import schedules as contract_schedules

    sampling = sampling or {}
    fixed = sampling.get("sigmas")
    if fixed:
        sigmas = np.asarray(fixed, dtype=np.float32)
        count = len(sigmas) - 1
        if steps not in (None, 0, count):
            raise SettingError(
                "steps",
                f"this model samples with its fixed {count}-step schedule; "
                f"leave {{name}} out or set it to {count}",
            )
        return contract_schedules.fixed_tail(sigmas, denoise)
    if steps is not None and steps < 0:
        raise SettingError("steps", "{name} must be at least 1")
    steps = steps or int(sampling.get("steps") or 0)
    if steps < 1:
        raise SettingError("steps", "this model has no step count of its own; give {name}")
    if steps / denoise > MAX_SCHEDULE:
        raise SettingError(
            "strength",
            f"{{name}} {denoise:g} with {steps} steps shortens a schedule of more than"
            f" {MAX_SCHEDULE} steps; raise it or give fewer steps",
        )
    total = contract_schedules.denoise_total(steps, denoise)
    rule = sampling.get("schedule")
    if rule:
        from gmlx_server.engine import schedules

        tokens = (height // pixels_per_token) * (width // pixels_per_token)
        sigmas = np.asarray(schedules.sigmas(rule, total, tokens), dtype=np.float32)
    else:
        shift = float(sampling.get("shift") or 1.0)
        sigmas = linear_sigmas(total) if shift == 1.0 else shifted_sigmas(total, shift)
    return contract_schedules.keep_tail(sigmas, steps)


def step_batch(
    x: np.ndarray, sigma: np.float32, rows: list[Any], timestep_scale: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """The arrays of one step call: x once per row, one timestep per row, sigma / scale in
    float32 (sigma x 1000 where the scale is 0.001, as the pipelines multiply)."""
    batch = np.concatenate([x] * len(rows), axis=0) if len(rows) > 1 else x
    per_sigma = np.float32(1.0 / timestep_scale)
    timestep = np.full(len(rows), np.float32(sigma) * per_sigma, dtype=np.float32)
    return np.ascontiguousarray(batch, dtype=np.float32), timestep


def model_outputs(
    step_fn: StepFn, x: np.ndarray, sigma: np.float32, guidance: Guidance, scale: float
) -> np.ndarray:
    """The rows' outputs at x: one step call for every row, or, when the negative pass skips
    blocks, the negative row's call of its own with `skip` (docs/contract.md §6)."""
    rows = guidance.rows()
    if guidance.guided and guidance.neg_skip:
        cond = step_fn(*step_batch(x, sigma, rows[:1], scale), rows[:1])
        uncond = step_fn(*step_batch(x, sigma, rows[1:], scale), rows[1:], guidance.neg_skip)
        return np.concatenate([cond, uncond], axis=0)
    return step_fn(*step_batch(x, sigma, rows, scale), rows)


def guided_velocity(out: np.ndarray, guidance: Guidance) -> np.ndarray:
    """dx/dsigma (1, C, h, w): the cond row alone, or uncond + cfg * (cond - uncond)."""
    out = np.asarray(out, dtype=np.float32)
    if not guidance.guided:
        return out[:1]
    cond, uncond = out[0:1], out[1:2]
    return uncond + np.float32(guidance.cfg) * (cond - uncond)


def euler_update(
    x: np.ndarray, velocity: np.ndarray, sigma: np.float32, sigma_next: np.float32
) -> np.ndarray:
    """One Euler step of dx/dsigma = velocity from sigma to sigma_next, in float32."""
    dt = np.float32(sigma_next) - np.float32(sigma)
    return (x + dt * velocity).astype(np.float32, copy=False)


class EulerSteps:
    """The Euler update rule of `sample`: the model is called at the current latents and each
    step moves them along the velocity to the next sigma. An update rule keeps its latents in
    `x`, which an inpainting sampler replaces after each step (img2img.blended)."""

    def __init__(self, x: np.ndarray, sigmas: np.ndarray):
        self.x = x
        self.sigmas = sigmas

    def model_input(self, i: int) -> np.ndarray:
        return self.x

    def advance(self, i: int, velocity: np.ndarray) -> np.ndarray:
        self.x = euler_update(self.x, velocity, self.sigmas[i], self.sigmas[i + 1])
        return self.x


# The samplers by the names ComfyUI gives them.
UPDATE_RULES = {"euler": EulerSteps, unipc.NAME: unipc.UniPCSteps}
SAMPLERS = tuple(UPDATE_RULES)


@dataclass(frozen=True)
class Start:
    """Where an image to image starts: the init image's latents (1, C, h, w) in model space,
    and for inpainting the mask on the latent grid (1, 1, h, w), 1 where to paint
    (engine/img2img.py)."""

    latents: np.ndarray
    mask: np.ndarray | None = None


def sample(
    step_fn: StepFn,
    noise: np.ndarray,
    sigmas: np.ndarray,
    guidance: Guidance,
    *,
    sampler: str = "euler",
    timestep_scale: float = 1.0,
    progress: bool = False,
    on_step: Callable[[int, np.ndarray], None] | None = None,
    start: Start | None = None,
    on_denoised: Callable[[int, np.ndarray], None] | None = None,
) -> np.ndarray:
    """Sample from `noise` along `sigmas`; returns the final latents (1, C, h, w) float32.

    The starting latents are noise x sigmas[0] (pure noise at sigma 1), or with a `start` its
    latents noised to sigmas[0]; with its mask the known region is put back after every step.
    Each step makes one model call at sigmas[i] (two where the negative pass skips blocks;
    `sampler` says at which latents, and how they move on), its timestep sigma divided by
    `timestep_scale`; `on_step(i, x)` is called after each step, e.g. to time steps or to stop,
    and `on_denoised(i, x0)` with the step's estimate of the clean latents, x - sigma x velocity
    (what a preview shows).
    """
    from . import img2img

    sigmas = np.asarray(sigmas, dtype=np.float32)
    check_sampler(sampler, sigmas)
    noise = np.asarray(noise, dtype=np.float32)
    if start is None:
        x = (noise * sigmas[0]).astype(np.float32)
    else:
        x = img2img.noised(start.latents, noise, sigmas[0])
    rule = UPDATE_RULES[sampler](x, sigmas)
    for i in _step_indices(len(sigmas) - 1, progress):
        model_input = rule.model_input(i)
        outputs = model_outputs(step_fn, model_input, sigmas[i], guidance, timestep_scale)
        velocity = guided_velocity(outputs, guidance)
        x = rule.advance(i, velocity)
        if start is not None and start.mask is not None:
            x = rule.x = img2img.blended(x, start.latents, noise, sigmas[i + 1], start.mask)
        if on_denoised is not None:
            on_denoised(i, (model_input - sigmas[i] * velocity).astype(np.float32))
        if on_step is not None:
            on_step(i, x)
    return x


def check_sampler(sampler: str, sigmas: np.ndarray) -> None:
    """Refuse an unknown sampler, or a schedule it cannot follow, before any work (ValueError)."""
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; choose one of {', '.join(SAMPLERS)}")
    if sigmas.ndim != 1 or len(sigmas) < 2:
        raise ValueError("a schedule needs at least two sigmas")
    if sampler == unipc.NAME:
        unipc.followed_sigmas(sigmas)


def _step_indices(count: int, progress: bool):
    if not progress:
        return range(count)
    from tqdm import tqdm

    return tqdm(range(count), desc="sampling", unit="step")


# ---------------------------------------------------------------- one image, any transport


@dataclass(frozen=True)
class ImageRequest:
    """What one sampled image asks for. `cfg`/`steps` None: the variant's own settings."""

    prompt: str
    width: int
    height: int
    seed: int = 0
    steps: int | None = None
    cfg: float | None = None
    negative: str | None = None
    # reference images, uint8 (H, W, 3 or 4), of any size: each brought to the sizes the model
    # takes as its pipeline brings it there (engine/reference_images.py)
    images: tuple[np.ndarray, ...] = ()
    sampler: str = "euler"
    # Image to image (engine/img2img.py): the init image, uint8 (H, W, 3 or 4), resized to the
    # request's size; `strength` in (0, 1], how much of it is drawn again (the schedule's
    # tail, as ComfyUI's denoise); for inpainting a mask, uint8 (H, W), 255 where to paint,
    # and the radius in pixels its edge is feathered by.
    init_image: np.ndarray | None = None
    strength: float = 1.0
    mask: np.ndarray | None = None
    mask_blur: float = 0.0


@dataclass
class ImageTimings:
    """Seconds per phase of one image (the bench's per-run record is built from these)."""

    encode_s: float = 0.0
    step_s: list[float] = field(default_factory=list)
    decode_s: float = 0.0
    image_s: float = 0.0


class Transport(Protocol):
    """How a sampling reaches the model: in process (`DirectTransport`) or over the step routes
    (the bench's via-steps transport). Encoding and decoding always run in process."""

    def encode(self, text: str, images: Sequence[np.ndarray]) -> EncodeResult: ...

    def encode_image(self, pixels: np.ndarray) -> np.ndarray: ...

    def row(self, encoding: EncodeResult) -> Any: ...

    def begin(self, sigmas: np.ndarray) -> None: ...

    def step(
        self, x: np.ndarray, timestep: np.ndarray, rows: Sequence[Any], skip: Sequence[int] = ()
    ) -> np.ndarray: ...

    def end(self) -> None: ...

    def decode(self, latents: np.ndarray) -> np.ndarray: ...


def guidance_scale(request: ImageRequest, sampling_row: dict | None) -> float:
    if request.cfg is not None:
        return float(request.cfg)
    return float((sampling_row or {}).get("cfg") or 1.0)


def generate(
    transport: Transport,
    status: dict,
    request: ImageRequest,
    *,
    progress: bool = False,
    on_denoised: Callable[[int, np.ndarray], None] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> tuple[np.ndarray, ImageTimings]:
    """Encode, sample and leave the final latents (1, C, h, w) in model space; with timings.

    With guidance (cfg != 1) the negative prompt (empty when not given) is encoded too and both
    rows go in one step call. With an init image the sampling starts from it (`Start`), and
    for inpainting a family whose status says `conditioning.inpaint_reference` also takes the
    init image as its first reference, as its diffusers inpaint pipeline does. Decoding is the
    caller's (`transport.decode`), so a bench can time it and a test can compare latents;
    `on_denoised` sees each step's estimate of the clean latents (previews), `on_step` each
    step's index once it is done (e.g. to stop: what it raises ends the sampling).
    """
    from .reference_images import fitted_references

    timings = ImageTimings()
    started = time.perf_counter()
    latent = status["latent"]
    sigmas, cfg = check_request(status, request)
    shape = (request.height // int(latent["stride"]), request.width // int(latent["stride"]))

    begin = time.perf_counter()
    start = image_start(transport, status, request, shape)
    first_refs = inpaint_references(status, start)
    images = fitted_references(status, request.images)
    cond = transport.row(with_first_refs(transport.encode(request.prompt, images), first_refs))
    uncond = None
    if cfg != 1.0:
        negative = transport.encode(request.negative or "", images)
        uncond = transport.row(with_first_refs(negative, first_refs))
    timings.encode_s = time.perf_counter() - begin

    noise = initial_noise(request.seed, int(latent["channels"]), *shape)
    last = [time.perf_counter()]

    def timed(i: int, x: np.ndarray) -> None:
        now = time.perf_counter()
        timings.step_s.append(now - last[0])
        last[0] = now
        if on_step is not None:
            on_step(i)

    sampling = status.get("sampling") or {}
    guidance = Guidance(cond, uncond, cfg, tuple(sampling.get("neg_skip") or ()))
    transport.begin(sigmas)
    try:
        latents = sample(
            transport.step,
            noise,
            sigmas,
            guidance,
            sampler=request.sampler,
            timestep_scale=float(sampling.get("timestep_scale") or 1.0),
            progress=progress,
            on_step=timed,
            start=start,
            on_denoised=on_denoised,
        )
    finally:
        transport.end()
    timings.image_s = time.perf_counter() - started
    return latents, timings


def image_start(
    transport: Transport, status: dict, request: ImageRequest, shape: tuple[int, int]
) -> Start | None:
    """The `Start` of an image to image (None for text to image)."""
    from . import img2img

    if request.init_image is None:
        return None
    rgb = img2img.init_rgb(request.init_image, request.width, request.height)
    latents = transport.encode_image(rgb.astype(np.float32) / np.float32(255.0))
    if request.mask is None:
        return Start(latents)
    conditioning = status.get("conditioning") or {}
    resize = conditioning.get("inpaint_mask", img2img.DEFAULT_MASK_RESIZE)
    mask = img2img.pixel_mask(request.mask, request.width, request.height, request.mask_blur)
    return Start(latents, img2img.latent_mask(mask, *shape, resize))


def inpaint_references(status: dict, start: Start | None) -> tuple[np.ndarray, ...]:
    """The reference latents a row takes before its images': for inpainting on a family whose
    status says `conditioning.inpaint_reference`, the init image's, as its diffusers inpaint
    pipeline passes them."""
    inpainting = start is not None and start.mask is not None
    if inpainting and (status.get("conditioning") or {}).get("inpaint_reference"):
        return (start.latents,)
    return ()


def check_request(status: dict, request: ImageRequest) -> tuple[np.ndarray, float]:
    """The request's sigmas and guidance scale on a model of this status (loaded or not: a
    family describes its status from the files), or a SettingError or ValueError saying what it
    cannot take: a size off the model's stride or over the step routes' pixel limits, a step
    count or sampler its schedule does not allow, a reference image its pipeline refuses."""
    from .reference_images import check_references

    stride = int(status["latent"]["stride"]) * int(status["latent"].get("patch", 1))
    check_numbers(request)
    check_pixel_limits(request.width, request.height)
    check_image_size(request.width, request.height, stride)
    check_image_start(request)
    check_references(status, request.images)
    sigmas = resolve_sigmas(
        status.get("sampling"),
        request.steps,
        request.width,
        request.height,
        pixels_per_token=stride,
        denoise=request.strength,
    )
    if len(sigmas) < 2:
        raise SettingError(
            "strength",
            f"{{name}} {request.strength:g} leaves none of the schedule's steps; raise it",
        )
    check_sampler(request.sampler, sigmas)
    return sigmas, guidance_scale(request, status.get("sampling"))


def check_numbers(request: ImageRequest) -> None:
    """The request's seed, step count and guidance scale within their bounds (a NaN is in
    none), each refused naming its setting."""
    if not 0 <= request.seed <= MAX_SEED:
        raise SettingError("seed", f"{{name}} must be an integer from 0 to {MAX_SEED}")
    if request.steps is not None and not 1 <= request.steps <= MAX_STEPS:
        raise SettingError(
            "steps", f"{{name}} must be from 1 to {MAX_STEPS}, or left out (the model's own)"
        )
    if request.cfg is not None and not 0 <= request.cfg <= MAX_GUIDANCE:
        raise SettingError("cfg", f"{{name}} must be a number from 0 to {MAX_GUIDANCE}")


def check_image_start(request: ImageRequest) -> None:
    """An image to image's settings: a strength in (0, 1] (below 1 only with an init image), a
    mask only with an init image, 2-D and of its size (OpenAI's rule for edits: a mask made for
    another picture is refused, not stretched), and a blur radius from 0 to MAX_MASK_BLUR
    pixels."""
    strength = request.strength
    if not (isinstance(strength, (int, float)) and 0.0 < strength <= 1.0):
        raise SettingError("strength", "{name} must be a number above 0 and at most 1")
    if request.init_image is None:
        if strength != 1.0:
            raise SettingError("strength", "{name} needs an init image to start from")
        if request.mask is not None:
            raise SettingError("mask", "a {name} needs an init image to paint into")
        return
    if request.mask is not None and np.ndim(request.mask) != 2:
        raise SettingError("mask", "a {name} must be one grayscale channel")
    mask_shape, image_shape = np.shape(request.mask)[:2], np.shape(request.init_image)[:2]
    if request.mask is not None and mask_shape != image_shape:
        raise SettingError(
            "mask",
            f"the {{name}} is {mask_shape[1]}x{mask_shape[0]} but the init image is"
            f" {image_shape[1]}x{image_shape[0]}: they must be the same size",
        )
    if not 0.0 <= request.mask_blur <= MAX_MASK_BLUR:
        raise SettingError("mask_blur", f"{{name}} must be from 0 to {MAX_MASK_BLUR:g} pixels")


def check_pixel_limits(width: int, height: int) -> None:
    """The limits the step routes answer 413 over (docs/contract.md §1.5), in process too."""
    if max(width, height) > wire.MAX_SIDE:
        setting, side = ("width", width) if width >= height else ("height", height)
        raise SettingError(
            setting, f"{{name}} {side} is over the limit of {wire.MAX_SIDE} pixels a side"
        )
    if wire.over_pixel_limits(width, height):
        raise SettingError(
            "width",
            f"an image of {width}x{height} is over the limit of {wire.MAX_PIXELS} pixels"
            " (2048x2048): lower {name} or the height",
        )


def check_image_size(width: int, height: int, stride: int) -> None:
    """Sides must be positive multiples of the latent stride (the model has no padding)."""
    for setting, side in (("width", width), ("height", height)):
        if side < stride or side % stride:
            raise SettingError(
                setting, f"{{name}} must be a positive multiple of {stride}, not {side}"
            )


# ---------------------------------------------------------------- the direct transport


def with_first_refs(encoding: EncodeResult, first_refs: Sequence[np.ndarray]) -> EncodeResult:
    """The encoding with `first_refs` (model-space latents) before its own references; their
    image slots stay those of its own references."""
    if not first_refs:
        return encoding
    return EncodeResult(
        cond=encoding.cond,
        ref_latents=[*first_refs, *encoding.ref_latents],
        image_slots=list(encoding.image_slots),
    )


def direct_row(encoding: EncodeResult, prefix_cache: bool = True) -> StepRow:
    """The StepRow the step route builds for `{"cond": hash, "num_tokens": L, "ref_latents":
    [...], "image_slots": [...]}` naming these tensors: same arrays, same cache keys."""
    cond = np.asarray(encoding.cond, dtype=np.float32)
    refs = tuple(np.asarray(r, dtype=np.float32) for r in encoding.ref_latents)
    return StepRow(
        cond=np.ascontiguousarray(cond.reshape(cond.shape[-2:])),
        cond_key=f"wire:{tensor_hash(cond)}",
        ref_latents=tuple(np.ascontiguousarray(r.reshape(r.shape[-3:])) for r in refs),
        ref_keys=tuple(tensor_hash(r) for r in refs),
        image_slots=tuple(encoding.image_slots[: len(refs)]),
        prefix_cache=prefix_cache,
    )


def call_inline(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


class DirectTransport:
    """Sampling in process: `denoise_step` of the loaded model, called through `call` (the image
    worker's `call` in a server, plain calls in the CLI), under convention `reference`, a run id
    of its own and patch table `table` (None: the plain model), exactly as the step route calls
    it."""

    convention = "reference"

    def __init__(
        self,
        model: Any,
        call: Callable[..., Any] = call_inline,
        run_id: str | None = None,
        table: Any = None,
    ):
        self.model = model
        self.call = call
        self.run_id = run_id or "direct-" + secrets.token_hex(8)
        self.table = table
        self.sample_sigmas: np.ndarray | None = None

    def encode(self, text: str, images: Sequence[np.ndarray]) -> EncodeResult:
        return self.call(self.model.encode, text, list(images), True)

    def encode_image(self, pixels: np.ndarray) -> np.ndarray:
        return self.call(encode_pixels, self.model, pixels)

    def row(self, encoding: EncodeResult) -> StepRow:
        return direct_row(encoding)

    def begin(self, sigmas: np.ndarray) -> None:
        """A flow-map DiT's steps name the run's schedule (`sample_sigmas`)."""
        self.sample_sigmas = flow_map_schedule(self.model, sigmas)

    def step(
        self, x: np.ndarray, timestep: np.ndarray, rows: Sequence[Any], skip: Sequence[int] = ()
    ) -> np.ndarray:
        return self.call(self.denoise, x, timestep, list(rows), None, tuple(skip)).out

    def denoise(
        self,
        x: np.ndarray,
        timestep: np.ndarray,
        rows: list,
        plans: Any = None,
        skip: tuple[int, ...] = (),
    ):
        """The model's step on these rows as the step route calls it (`plans`: a memory plan's
        plan of the rows, None: the model plans them)."""
        return self.model.denoise_step(
            x,
            timestep,
            rows,
            convention=self.convention,
            run=self.run_id,
            table=self.table,
            plans=plans,
            skip=skip,
            sample_sigmas=self.sample_sigmas,
        )

    def end(self) -> None:
        self.call(self.model.end_run, self.run_id)

    def decode(self, latents: np.ndarray) -> np.ndarray:
        return self.call(decode_latents, self.model, latents)


def flow_map_schedule(model: Any, sigmas: np.ndarray) -> np.ndarray | None:
    """What a step on `model` sends as `sample_sigmas` for a run along `sigmas`: the schedule
    for a flow-map DiT, else nothing (docs/contract.md §2.11)."""
    return np.asarray(sigmas, np.float32) if model.capabilities.flow_map else None


def decode_latents(model: Any, latents: np.ndarray, tiled: bool = False) -> np.ndarray:
    """Final latents (1, C, h, w) in model space -> RGB (H, W, 3) float32 in [0, 1], through
    the model's `vae_space` (the VAE routes take the VAE's own latent space), in tiles where
    the memory plan says so. Runs on the image worker."""
    latents = np.asarray(latents, dtype=np.float32)[0]
    return model.vae_decode(model.vae_space(latents), False, tiled)


def encode_pixels(model: Any, pixels: np.ndarray, tiled: bool = False) -> np.ndarray:
    """RGB (H, W, 3) float32 in [0, 1] -> latents (1, C, h, w) in the DiT's model space, through
    the VAE's encoder (the mean) and the model's `model_space`. Runs on the image worker."""
    latents = model.model_space(model.vae_encode(np.asarray(pixels, np.float32), tiled))
    return np.ascontiguousarray(latents[None], dtype=np.float32)


def to_uint8(image: np.ndarray) -> np.ndarray:
    """[0, 1] float pixels -> uint8, rounding to nearest."""
    return np.clip(np.rint(np.asarray(image, dtype=np.float32) * 255.0), 0, 255).astype(np.uint8)
