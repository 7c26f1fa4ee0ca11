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

# A step function: latents (B, C, h, w) f32, timestep (B,) f32, one row per batch entry -> the
# model output (B, C, h, w) f32. Rows are opaque here: StepRow objects for the direct path, wire
# row dicts for the via-steps path.
StepFn = Callable[[np.ndarray, np.ndarray, Sequence[Any]], np.ndarray]


@dataclass(frozen=True)
class Guidance:
    """The rows of one sampling: the prompt's row and, when guided, the negative prompt's row."""

    cond: Any
    uncond: Any | None = None
    cfg: float = 1.0

    @property
    def guided(self) -> bool:
        """True classifier-free guidance runs only with a negative row and a scale other than 1."""
        return self.uncond is not None and self.cfg != 1.0

    def rows(self) -> list[Any]:
        return [self.cond, self.uncond] if self.guided else [self.cond]


class SettingError(ValueError):
    """An `ImageRequest` setting the model cannot take. `setting` is the field it is about;
    `text` says what is wrong with `{name}` in place of the setting's name, so that each caller
    names it as its user sent it (`naming`: the command line's flag, an HTTP route's field)."""

    def __init__(self, setting: str, text: str) -> None:
        super().__init__(text.format(name=setting))
        self.setting, self.text = setting, text

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
    sampling: dict | None, steps: int | None, width: int, height: int, *, pixels_per_token: int
) -> np.ndarray:
    """The sigma schedule (float32, ending in 0) for a model's status `sampling` object.

    A variant's fixed `sigmas` win (a `steps` that disagrees with their count is refused), else the
    size-dependent `schedule` rule of docs/contract.md §5.3, else a linear schedule under the
    variant's static `shift` (`shifted_sigmas`; plain linear at shift 1). `steps` None means the
    variant's own step count.
    """
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
        return sigmas
    if steps is not None and steps < 0:
        raise SettingError("steps", "{name} must be at least 1")
    steps = steps or int(sampling.get("steps") or 0)
    if steps < 1:
        raise SettingError("steps", "this model has no step count of its own; give {name}")
    rule = sampling.get("schedule")
    if rule:
        from gmlx_server.engine import schedules

        tokens = (height // pixels_per_token) * (width // pixels_per_token)
        return np.asarray(schedules.sigmas(rule, steps, tokens), dtype=np.float32)
    shift = float(sampling.get("shift") or 1.0)
    return linear_sigmas(steps) if shift == 1.0 else shifted_sigmas(steps, shift)


def step_batch(
    x: np.ndarray, sigma: np.float32, guidance: Guidance, timestep_scale: float = 1.0
) -> tuple[np.ndarray, np.ndarray, list[Any]]:
    """The arrays and rows of one step call: x once per row, one timestep per row."""
    rows = guidance.rows()
    batch = np.concatenate([x] * len(rows), axis=0) if len(rows) > 1 else x
    timestep = np.full(len(rows), np.float32(sigma) / np.float32(timestep_scale), dtype=np.float32)
    return np.ascontiguousarray(batch, dtype=np.float32), timestep, rows


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
    step moves them along the velocity to the next sigma."""

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
) -> np.ndarray:
    """Sample from `noise` along `sigmas`; returns the final latents (1, C, h, w) float32.

    The starting latents are noise x sigmas[0] (pure noise at sigma 1). Each step makes one
    model call at sigmas[i] (`sampler` says at which latents, and how they move on);
    `on_step(i, x)` is called after each step, e.g. to time steps or to stop.
    """
    sigmas = np.asarray(sigmas, dtype=np.float32)
    check_sampler(sampler, sigmas)
    x = (np.asarray(noise, dtype=np.float32) * sigmas[0]).astype(np.float32)
    rule = UPDATE_RULES[sampler](x, sigmas)
    for i in _step_indices(len(sigmas) - 1, progress):
        batch, timestep, rows = step_batch(rule.model_input(i), sigmas[i], guidance, timestep_scale)
        x = rule.advance(i, guided_velocity(step_fn(batch, timestep, rows), guidance))
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
    images: tuple[np.ndarray, ...] = ()  # reference images, uint8 (H, W, 3 or 4)
    sampler: str = "euler"


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

    def row(self, encoding: EncodeResult) -> Any: ...

    def begin(self, sigmas: np.ndarray) -> None: ...

    def step(self, x: np.ndarray, timestep: np.ndarray, rows: Sequence[Any]) -> np.ndarray: ...

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
) -> tuple[np.ndarray, ImageTimings]:
    """Encode, sample and leave the final latents (1, C, h, w) in model space; with timings.

    With guidance (cfg != 1) the negative prompt (empty when not given) is encoded too and both
    rows go in one step call. Decoding is the caller's (`transport.decode`), so a bench can time
    it and a test can compare latents.
    """
    timings = ImageTimings()
    started = time.perf_counter()
    latent = status["latent"]
    sigmas, cfg = check_request(status, request)

    begin = time.perf_counter()
    cond = transport.row(transport.encode(request.prompt, request.images))
    uncond = None
    if cfg != 1.0:
        uncond = transport.row(transport.encode(request.negative or "", request.images))
    timings.encode_s = time.perf_counter() - begin

    noise = initial_noise(
        request.seed,
        int(latent["channels"]),
        request.height // int(latent["stride"]),
        request.width // int(latent["stride"]),
    )
    last = [time.perf_counter()]

    def on_step(i: int, x: np.ndarray) -> None:
        now = time.perf_counter()
        timings.step_s.append(now - last[0])
        last[0] = now

    transport.begin(sigmas)
    try:
        latents = sample(
            transport.step,
            noise,
            sigmas,
            Guidance(cond, uncond, cfg),
            sampler=request.sampler,
            progress=progress,
            on_step=on_step,
        )
    finally:
        transport.end()
    timings.image_s = time.perf_counter() - started
    return latents, timings


def check_request(status: dict, request: ImageRequest) -> tuple[np.ndarray, float]:
    """The request's sigmas and guidance scale on a model of this status (loaded or not: a
    family describes its status from the files), or a SettingError or ValueError saying what it
    cannot take: a size off the model's stride or over the step routes' pixel limits, a step
    count or sampler its schedule does not allow."""
    stride = int(status["latent"]["stride"]) * int(status["latent"].get("patch", 1))
    check_pixel_limits(request.width, request.height)
    check_image_size(request.width, request.height, stride)
    sigmas = resolve_sigmas(
        status.get("sampling"),
        request.steps,
        request.width,
        request.height,
        pixels_per_token=stride,
    )
    check_sampler(request.sampler, sigmas)
    return sigmas, guidance_scale(request, status.get("sampling"))


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

    def row(self, encoding: EncodeResult) -> StepRow:
        return direct_row(encoding)

    def begin(self, sigmas: np.ndarray) -> None:
        """A flow-map DiT's steps name the run's schedule (`sample_sigmas`)."""
        self.sample_sigmas = flow_map_schedule(self.model, sigmas)

    def step(self, x: np.ndarray, timestep: np.ndarray, rows: Sequence[Any]) -> np.ndarray:
        return self.call(self.denoise, x, timestep, list(rows)).out

    def denoise(self, x: np.ndarray, timestep: np.ndarray, rows: list, plans: Any = None):
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


def to_uint8(image: np.ndarray) -> np.ndarray:
    """[0, 1] float pixels -> uint8, rounding to nearest."""
    return np.clip(np.rint(np.asarray(image, dtype=np.float32) * 255.0), 0, 255).astype(np.uint8)
