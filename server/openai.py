"""The OpenAI image routes: POST /v1/images/generations, /v1/images/edits and
/v1/images/variations, and GET /v1/images/files/{name} for the images answered by URL.

They answer the OpenAI images API's shape, `{"created": <unix time>, "data": [{"b64_json":
"<base64 PNG>"} or {"url": ...}, ...]}`, or with `stream: true` its Server-Sent Events
(`image_generation.partial_image` ... `image_generation.completed`; `image_edit.*` for edits),
and refuse in its error shape, `{"error": {"message", "type", "param", "code"}}`. Images are
sampled with the in-process sampler (`engine/sampling.py`) on the server's loaded model. Every
model call (each encode, each step, each decode) is its own job on the image worker, so the
steps of step clients and of these routes interleave in arrival order instead of one image
holding the worker for its whole duration.

How an edit uses its images:
- with a `mask` (OpenAI's: a PNG with alpha, transparent where to paint; without alpha, white
  where to paint) it inpaints the first image at `strength` (default 1), the others being
  references;
- with a `strength` and no mask it is an image to image from the first image;
- with neither, the images are references, for a model that takes them; a model that takes none
  starts from the first image at DEFAULT_IMAGE_STRENGTH.
A variation is an image to image from its image at `strength` (default DEFAULT_IMAGE_STRENGTH)
under `prompt` (default empty); a model that takes references gets the image as one too.

Fields beyond OpenAI's, all optional: `seed` (int; default random, image i of `n` gets seed + i),
`steps` (int 1-1000; default the model's own), `cfg` or `guidance` (number 0-100, cfg winning;
default the model's own), `negative_prompt` (str), `sampler` ("euler" or "uni_pc_bh2"),
`strength` (number above 0, at most 1), `mask_blur` (pixels, 0-256). A JSON field that is null
is absent; a form field's text is read as the JSON value it stands for (`form_value`). Sizes
are "WxH" with sides multiples of 16, or "auto" (1024x1024 for a generation, the first image's
size for an edit or variation; a lone reference that the model pads to its canvas, FLUX.3
klein's, is sampled at the canvas and answered at its own size, as the model's pipeline does
it); over 2048x2048 pixels or a side over 4096 is refused 413, as on
the step routes. docs/openapi.yaml describes the routes field by field.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import logging
import math
import queue
import re
import secrets
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import falcon
import numpy as np
from gmlx_contract import wire
from gmlx_contract.errors import ContractError

from .engine.base import EngineInputError
from .engine.previews import preview_for
from .engine.reference_images import lone_canvas
from .engine.sampling import (
    MAX_GUIDANCE,
    MAX_MASK_BLUR,
    MAX_SEED,
    MAX_STEPS,
    SAMPLERS,
    ImageRequest,
    SettingError,
    check_request,
    generate,
    to_uint8,
)
from .image_store import StoreFull
from .imagefiles import OUTPUT_FORMATS, decode_image_file, encode_picture, mask_of
from .memory import PlannedTransport
from .routes.common import lone_surrogate

log = logging.getLogger("gmlx.server")

PREFIX = "/v1/"
GENERATIONS_PATH = PREFIX + "images/generations"
EDITS_PATH = PREFIX + "images/edits"
VARIATIONS_PATH = PREFIX + "images/variations"
FILES_PREFIX = PREFIX + "images/files/"
FILES_PATH = FILES_PREFIX + "{name}"
MODELS_PATH = PREFIX + "models"
MAX_IMAGES_PER_REQUEST = 10  # OpenAI's bound on n
MAX_PARTIAL_IMAGES = 3  # OpenAI's bound on partial_images
# Waitress threads an OpenAI image job may not take (ImageJobs), and how long a job refused for
# want of one is told to wait.
KEPT_THREADS = 2
CLIENT_GONE = 499  # the status logged for a job whose client closed its connection
JOB_RETRY_AFTER_S = 2
# The strength of a variation, and of an edit without mask or strength on a model that takes
# no references: enough of the image is drawn again to vary it, and its layout stays.
DEFAULT_IMAGE_STRENGTH = 0.75
MAX_REFERENCES = 10
DEFAULT_SIZE = (1024, 1024)
SIZE_MULTIPLE = 16
RESPONSE_FORMATS = ("b64_json", "url")
SIZE_RE = re.compile(r"([0-9]{1,6})[xX]([0-9]{1,6})")  # whole value; docs/openapi.yaml says so too
# Form fields (multipart bodies) that are numbers or booleans in a JSON body.
FORM_NUMBERS = {
    "n": int,
    "seed": int,
    "steps": int,
    "cfg": float,
    "guidance": float,
    "strength": float,
    "mask_blur": float,
    "partial_images": int,
}
FORM_BOOLEANS = ("stream",)
IMAGE_PARTS = ("image", "image[]", "images", "images[]")
# A sampling setting the model refuses, as a refusal names it: (its words, the request field).
SETTING_FIELDS = {
    "steps": ("steps", "steps"),
    "width": ("the width in size", "size"),
    "height": ("the height in size", "size"),
    "strength": ("strength", "strength"),
    "mask": ("mask", "mask"),
    "mask_blur": ("mask_blur", "mask_blur"),
    "ref": ("image", "image"),
}


class OpenAIError(Exception):
    """A refusal in the OpenAI error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str | None = None,
        retry_after_s: int | None = None,
    ):
        """`kind`: the error's type, where the refusal has its own (the front gate's);
        `retry_after_s`: the Retry-After header's seconds (a refusal for now only)."""
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.given_kind = kind
        self.retry_after_s = retry_after_s

    @property
    def kind(self) -> str:
        if self.given_kind is not None:
            return self.given_kind
        return {
            401: "authentication_error",
            404: "not_found_error",
            413: "invalid_request_error",
            429: "rate_limit_error",
            503: "server_error",
        }.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def body(self) -> bytes:
        error = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return json.dumps({"error": error}).encode("utf-8")


def handle_openai_error(req, resp, exc: OpenAIError, params) -> None:
    resp.status = exc.status
    resp.content_type = "application/json"
    resp.data = exc.body()
    if exc.retry_after_s is not None:
        resp.set_header("Retry-After", str(exc.retry_after_s))


def add_routes(app: falcon.App, ctx: Any) -> None:
    """Add the OpenAI image routes to the server's app (called by `app.create_app`)."""
    app.add_error_handler(OpenAIError, handle_openai_error)
    jobs = ImageJobs(max(1, ctx.config.threads - KEPT_THREADS))
    app.add_route(GENERATIONS_PATH, Generations(ctx, jobs))
    app.add_route(EDITS_PATH, Edits(ctx, jobs))
    app.add_route(VARIATIONS_PATH, Variations(ctx, jobs))
    app.add_route(FILES_PATH, ImageFile(ctx))
    app.add_route(MODELS_PATH, Models(ctx))


# ---------------------------------------------------------------- request fields


def parse_size(value: Any, default: tuple[int, int]) -> tuple[int, int]:
    if value is None or value == "auto":
        width, height = default
    else:
        match = SIZE_RE.fullmatch(value) if isinstance(value, str) else None
        if match is None:
            raise OpenAIError(400, f"size must be 'WIDTHxHEIGHT' or 'auto', not {value!r}", "size")
        width, height = int(match.group(1)), int(match.group(2))
    if (
        width < SIZE_MULTIPLE
        or height < SIZE_MULTIPLE
        or width % SIZE_MULTIPLE
        or height % SIZE_MULTIPLE
    ):
        raise OpenAIError(
            400,
            f"size {width}x{height}: both sides must be positive multiples of {SIZE_MULTIPLE}",
            "size",
        )
    return width, height


def check_size_limit(width: int, height: int) -> None:
    """413 for a size over the step routes' pixel limits (checked after every field's form, so
    a request with a malformed field is answered 400 whatever its size)."""
    if wire.over_pixel_limits(width, height):
        raise OpenAIError(
            413,
            f"size {width}x{height} is over the limit of 2048x2048 pixels or {wire.MAX_SIDE} "
            "pixels a side",
            "size",
        )


def _int(fields: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    value = fields.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise OpenAIError(400, f"{name} must be an integer from {low} to {high}", name)
    return value


def _float(fields: dict, name: str, high: float = MAX_GUIDANCE) -> float | None:
    value = fields.get(name)
    if value is None:
        return None
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not 0 <= value <= high:  # NaN compares False
        raise OpenAIError(400, f"{name} must be a number from 0 to {high:g}", name)
    return float(value)


def _strength(fields: dict) -> float | None:
    value = fields.get("strength")
    if value is None:
        return None
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not 0 < value <= 1:
        raise OpenAIError(400, "strength must be a number above 0 and at most 1", "strength")
    return float(value)


def _bool(fields: dict, name: str) -> bool:
    value = fields.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise OpenAIError(400, f"{name} must be true or false", name)
    return value


def _text(fields: dict, name: str, required: bool = False) -> str | None:
    value = fields.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or (required and not value.strip()):
        raise OpenAIError(400, f"{name} must be a non-empty string", name)
    if (at := lone_surrogate(value)) is not None:
        raise OpenAIError(400, f"{name} holds a lone surrogate at {at}, not a character", name)
    return value


def _choice(fields: dict, name: str, choices: Any, default: str) -> str:
    value = fields.get(name)
    if value is None:
        return default
    if not isinstance(value, str) or value not in choices:
        raise OpenAIError(400, f"{name} must be one of {', '.join(choices)}", name)
    return value


@dataclass(frozen=True)
class Job:
    """What a request asks for: `count` images like `request` (seeds counting up from its seed)
    in `output_format`, of `model` (None: the default model), answered as `response_format`
    or streamed (`stream`, with `partial_images` previews each, as events named `events`);
    `use` says how the images sent are used once the model is known (`for_model`);
    `auto_size`, that the request left the size to the server; `crop`, the box (left, top,
    right, bottom) of each sampled picture that is answered (None: all of it)."""

    request: ImageRequest
    count: int
    output_format: str
    model: str | None
    response_format: str = "b64_json"
    stream: bool = False
    partial_images: int = 0
    events: str = "image_generation"
    use: str = "prompt"  # "prompt", "start", "references" or "variation"
    auto_size: bool = False
    crop: tuple[int, int, int, int] | None = None

    def answered(self, picture: np.ndarray) -> np.ndarray:
        """The part of a sampled picture (H, W, ...) that is answered."""
        if self.crop is None:
            return picture
        left, top, right, bottom = self.crop
        return picture[top:bottom, left:right]

    @property
    def size(self) -> str:
        """The answered pictures' size, "WxH"."""
        if self.crop is None:
            return f"{self.request.width}x{self.request.height}"
        left, top, right, bottom = self.crop
        return f"{right - left}x{bottom - top}"


def parse_job(fields: dict, default_size: tuple[int, int], prompt_required: bool = True) -> Job:
    """The job of a request's fields: JSON values (a form's are converted first, `form_value`;
    null is the same as absent). A size over the limit is refused last."""
    model = model_field(fields)
    response_format = _choice(fields, "response_format", RESPONSE_FORMATS, "b64_json")
    output_format = _choice(fields, "output_format", OUTPUT_FORMATS, "png")
    sampler = _choice(fields, "sampler", SAMPLERS, "euler")
    stream = _bool(fields, "stream")
    if stream and response_format == "url":
        raise OpenAIError(
            400, "streamed images come as b64_json: leave response_format out", "response_format"
        )
    partial_images = _int(fields, "partial_images", 0, 0, MAX_PARTIAL_IMAGES)
    cfg, guidance = _float(fields, "cfg"), _float(fields, "guidance")
    width, height = parse_size(fields.get("size"), default_size)
    seed = _int(fields, "seed", None, 0, MAX_SEED)
    strength = _strength(fields)
    prompt = _text(fields, "prompt", required=prompt_required)
    request = ImageRequest(
        prompt=prompt or "",
        negative=_text(fields, "negative_prompt"),
        width=width,
        height=height,
        seed=secrets.randbelow(2**31) if seed is None else seed,
        steps=_int(fields, "steps", None, 1, MAX_STEPS),
        cfg=guidance if cfg is None else cfg,
        sampler=sampler,
        strength=1.0 if strength is None else strength,
        mask_blur=_float(fields, "mask_blur", MAX_MASK_BLUR) or 0.0,
    )
    count = _int(fields, "n", 1, 1, MAX_IMAGES_PER_REQUEST)
    auto_size = fields.get("size") in (None, "auto")
    job = Job(
        request,
        count,
        output_format,
        model,
        response_format,
        stream,
        partial_images,
        auto_size=auto_size,
    )
    check_size_limit(width, height)
    return job


def for_model(job: Job, status: dict, model_id: str) -> Job:
    """The job on a model of this status: an edit's images as references where the model
    takes them, else as the image it starts from (module docstring); a lone reference that
    the model keeps whole, at size "auto", sampled at its canvas (`at_reference_canvas`)."""
    takes_references = bool(status.get("edit_capable"))
    request = job.request
    if job.use == "references" and not takes_references:
        first, *others = request.images
        request = replace(
            request, init_image=first, images=tuple(others), strength=DEFAULT_IMAGE_STRENGTH
        )
    elif job.use == "variation" and takes_references:
        request = replace(request, images=(request.init_image,))
    if request.images and not takes_references:
        raise OpenAIError(
            400,
            f"model {model_id} takes no reference images: send one image to start from",
            "image",
        )
    job = replace(job, request=request)
    if job.auto_size and job.use == "references":
        return at_reference_canvas(job, status)
    return job


def at_reference_canvas(job: Job, status: dict) -> Job:
    """An edit of one reference at size "auto" on a family that pads a lone reference to its
    canvas (FLUX.3 klein) as its pipeline does it: sampled at the canvas, each picture cropped
    back to the reference (reference_images.lone_canvas)."""
    canvas = lone_canvas(status, job.request.images)
    if canvas is None:
        return job
    (height, width), box = canvas
    return replace(job, request=replace(job.request, width=width, height=height), crop=box)


def model_field(fields: dict) -> str | None:
    """The model asked for: None, "" (both: the default model) or a model id."""
    model = fields.get("model")
    if model is not None and not isinstance(model, str):
        raise OpenAIError(400, "model must be a string (a model id)", "model")
    return model or None


# ---------------------------------------------------------------- the work


class ImageJobs:
    """The OpenAI image jobs sampling at once. Each holds one of Waitress' threads for as long as
    it samples, so at most `limit` run (the server's threads less KEPT_THREADS, kept for the
    step routes and health checks); one more is refused 429 with a Retry-After, which the
    `openai` client waits out and sends again."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._slots = threading.BoundedSemaphore(limit)

    def take(self) -> None:
        if not self._slots.acquire(blocking=False):
            raise OpenAIError(
                429,
                f"the server is sampling {self.limit} images at once, its most: send this again"
                " shortly",
                code="rate_limit_exceeded",
                retry_after_s=JOB_RETRY_AFTER_S,
            )

    def give(self) -> None:
        self._slots.release()


class ImageRoute:
    def __init__(self, ctx: Any, jobs: ImageJobs) -> None:
        self.ctx = ctx
        self.jobs = jobs

    @property
    def service(self):
        return self.ctx.service

    def answer(self, req: falcon.Request, resp: falcon.Response, job: Job) -> None:
        """Sample the job's images and answer them (JSON, or events with `stream`), as one of
        the jobs sampling at once (`ImageJobs`: refused 429 when they are all taken). Every
        refusal the requests can meet is made before the first image is sampled; a client
        that closes its connection stops the sampling at its next step."""
        self.jobs.take()
        streamed = False
        try:
            streamed = self._answer(req, resp, job)
        finally:
            if not streamed:  # a stream gives its job back once its sampling ends
                self.jobs.give()

    def _answer(self, req: falcon.Request, resp: falcon.Response, job: Job) -> bool:
        """`answer`'s work; True where a stream took the job over."""
        try:
            loaded = self.service.acquire(job.model)
        except ContractError as exc:
            raise OpenAIError(exc.status, exc.message, "model") from None
        try:
            with refusals():
                status = self.service.worker.call(loaded.model.status)
                job = for_model(job, status, loaded.model_id)
                request = job.request
                requests = [replace(request, seed=request.seed + i) for i in range(job.count)]
                self.transport(loaded).check_image(status, request)  # the seeds change nothing
            stop = stop_when_gone(req.env.get("waitress.client_disconnected"))
            if job.stream:
                resp.status = 200
                resp.content_type = "text/event-stream"
                resp.set_header("Cache-Control", "no-cache")
                resp.stream = EventStream(self, loaded, status, job, requests, stop)
                return True
            with refusals():
                files = [
                    self.one_image(loaded, status, each, job, on_step=stop) for each in requests
                ]
        except ClientGone:  # nobody reads an answer now: the work left is dropped
            self.service.release(loaded)
            log.info("the client of an image job closed its connection: the job stopped")
            # nobody reads it: nginx's 499 ("client closed request") in the log and the
            # metrics, so a client that leaves is not counted as a refusal
            raise OpenAIError(CLIENT_GONE, "the client closed its connection") from None
        except BaseException:
            self.service.release(loaded)
            raise
        self.service.release(loaded)
        data = [self.answer_item(req, data, job) for data in files]
        resp.status = 200
        resp.content_type = "application/json"
        resp.data = json.dumps(
            {
                "created": int(time.time()),
                "data": data,
                "output_format": job.output_format,
                "size": job.size,
            }
        ).encode("utf-8")
        return False

    def answer_item(self, req: falcon.Request, data: bytes, job: Job) -> dict:
        """One image of the answer: base64, or a URL of the image store's."""
        if job.response_format == "b64_json":
            return {"b64_json": base64.b64encode(data).decode("ascii")}
        try:
            name = self.service.image_store().put(data, job.output_format)
        except StoreFull as exc:  # a 4xx: OpenAI's clients send a 5xx again, to the same end
            raise OpenAIError(
                400,
                f"{exc}: ask for response_format b64_json, or for a smaller image",
                param="response_format",
            ) from None
        return {"url": req.prefix + FILES_PREFIX + name}

    def transport(self, loaded: Any) -> PlannedTransport:
        return PlannedTransport(
            loaded, self.service.memory, call=self.service.worker.call, table=loaded.default_table
        )

    def one_image(
        self,
        loaded: Any,
        status: dict,
        request: ImageRequest,
        job: Job,
        on_denoised=None,
        on_step=None,
    ) -> bytes:
        """One image's file in the job's format (`generate`'s `on_denoised`: the previews;
        `on_step`: the check that the client is still there), counted in the metrics."""
        started = time.perf_counter()
        transport = self.transport(loaded)
        try:
            latents, timings = generate(
                transport, status, request, on_denoised=on_denoised, on_step=on_step
            )
        except ClientGone:
            self.ctx.metrics.image(loaded.entry.family, None)
            raise
        pixels = transport.decode(latents)
        seconds = time.perf_counter() - started
        self.ctx.metrics.image(loaded.entry.family, seconds)
        log.info(
            "image %dx%d, %d steps, seed %d, model %s in %.2f s",
            request.width,
            request.height,
            len(timings.step_s),
            request.seed,
            loaded.model_id,
            seconds,
        )
        return encode_picture(to_uint8(job.answered(pixels)), job.output_format)


def openai_refusal(exc: ContractError | ValueError) -> OpenAIError:
    """A refusal of the sampler's or the engine's in the OpenAI error shape."""
    if isinstance(exc, ContractError):
        return OpenAIError(exc.status, exc.message)
    if isinstance(exc, SettingError):
        name, field = SETTING_FIELDS.get(exc.setting, (exc.setting, exc.setting))
        return OpenAIError(400, exc.naming(name), field)
    # engine input errors and sampler refusals are the client's
    return OpenAIError(400, str(exc) or type(exc).__name__)


@contextmanager
def refusals():
    """The sampler's and the engine's refusals raised in the OpenAI error shape."""
    try:
        yield
    except (ContractError, ValueError) as exc:
        raise openai_refusal(exc) from None


# ---------------------------------------------------------------- streaming


def partial_steps(steps: int, partial_images: int) -> list[int]:
    """The steps after which a preview is sent: `partial_images` of them spread evenly, never
    the last (the final image follows it)."""
    chosen = {(k + 1) * steps // (partial_images + 1) - 1 for k in range(partial_images)}
    return sorted(step for step in chosen if 0 <= step < steps - 1)


class ClientGone(Exception):
    """The client of an answer went away: its sampling stops at the next step."""


def stop_when_gone(gone) -> Any:
    """`generate`'s `on_step` that ends a sampling whose client has closed its connection
    (`gone`: Waitress' `waitress.client_disconnected`; None: no way to tell, never stops)."""
    if gone is None:
        return None

    def check(step: int) -> None:
        if gone():
            raise ClientGone

    return check


class EventStream:
    """The body of a streamed answer: for each image its previews, then the image, as
    Server-Sent Events in OpenAI's shape. A thread of its own samples the images and queues
    the events as they are made; the body hands them on. When the client goes away (Waitress
    closes the body, or, before any event is written, `stop` finds it gone: the check
    `stop_when_gone` makes, as for an answer not streamed) the sampling stops at its next
    step. The model is released when the sampling has ended, however it ended."""

    def __init__(
        self, route: ImageRoute, loaded: Any, status: dict, job: Job, requests, stop=None
    ) -> None:
        self.route, self.loaded, self.status, self.job = route, loaded, status, job
        self.requests = requests
        self.stop = stop
        self.events: queue.Queue = queue.Queue()
        self.closed = threading.Event()
        # counted as a request in flight until Waitress closes it, its last event sent
        self.traffic = route.ctx.traffic
        self.traffic.enter()
        self._counted = threading.Lock()
        self.sampler = threading.Thread(target=self._produce, name="gmlx-openai-stream")
        self.sampler.daemon = True
        self.sampler.start()

    def __iter__(self):
        while True:
            event = self.events.get()
            if event is None:
                return
            yield event

    def close(self) -> None:
        """Waitress' close, once the answer is sent or its client is gone."""
        self.closed.set()
        if self._counted.acquire(blocking=False):
            self.traffic.leave()

    def _produce(self) -> None:
        try:
            for request in self.requests:
                self._one(request)
        except ClientGone:
            log.info("the client of a streamed image job closed its connection: the job stopped")
        except Exception as exc:  # noqa: BLE001 - the client is told, in OpenAI's shape
            self.events.put(self._event("error", json.loads(self._refusal(exc).body())))
        finally:
            self.route.service.release(self.loaded)
            self.route.jobs.give()
            self.events.put(None)

    @staticmethod
    def _refusal(exc: Exception) -> OpenAIError:
        if isinstance(exc, OpenAIError):
            return exc
        if isinstance(exc, (ContractError, ValueError)):
            return openai_refusal(exc)
        log.exception("a streamed image failed")
        return OpenAIError(500, f"the image failed: {type(exc).__name__}")

    def _one(self, request: ImageRequest) -> None:
        job, route = self.job, self.route
        sigmas, _ = check_request(self.status, request)
        wanted = partial_steps(len(sigmas) - 1, job.partial_images)
        transport = route.transport(self.loaded)

        def on_denoised(step: int, denoised: np.ndarray) -> None:
            if self.closed.is_set():
                raise ClientGone
            if step in wanted:
                fitted = preview_for(self.loaded.model, transport.encode_image)
                picture = fitted.picture(denoised, request.width, request.height)
                data = encode_picture(job.answered(picture), job.output_format)
                index = wanted.index(step)
                self.events.put(self._image_event("partial_image", data, index))

        image = route.one_image(self.loaded, self.status, request, job, on_denoised, self.stop)
        self.events.put(self._image_event("completed", image))

    def _image_event(self, kind: str, data: bytes, index=None) -> bytes:
        body = {
            "type": f"{self.job.events}.{kind}",
            "b64_json": base64.b64encode(data).decode("ascii"),
            "created_at": int(time.time()),
            "size": self.job.size,
            "quality": "auto",
            "background": "opaque",
            "output_format": self.job.output_format,
        }
        if index is not None:
            body["partial_image_index"] = index
        else:
            body["usage"] = NO_USAGE
        return self._event(body["type"], body)

    @staticmethod
    def _event(name: str, body: dict) -> bytes:
        return f"event: {name}\ndata: {json.dumps(body)}\n\n".encode()


# OpenAI's token usage, which a diffusion model has none of.
NO_USAGE = {
    "input_tokens": 0,
    "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
    "output_tokens": 0,
    "total_tokens": 0,
}


# ---------------------------------------------------------------- the routes


class Generations(ImageRoute):
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        self.answer(req, resp, parse_job(json_fields(req), DEFAULT_SIZE))


class Edits(ImageRoute):
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        most = f"at most {MAX_REFERENCES} images"
        fields, images, mask = image_fields(req, MAX_REFERENCES, most)
        if not images:
            raise OpenAIError(400, "an edit needs at least one image", "image")
        job = parse_job(fields, edit_size(images[0]))
        job = replace(job, events="image_edit")
        if mask is not None:
            first, *others = images
            request = replace(job.request, init_image=first, images=tuple(others), mask=mask)
            self.answer(req, resp, replace(job, request=request, use="start"))
        elif fields.get("strength") is not None:
            first, *others = images
            request = replace(job.request, init_image=first, images=tuple(others))
            self.answer(req, resp, replace(job, request=request, use="start"))
        else:
            request = replace(job.request, images=tuple(images))
            self.answer(req, resp, replace(job, request=request, use="references"))


class Variations(ImageRoute):
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        fields, images, mask = image_fields(req, 1, "a variation takes exactly one image")
        if not images:
            raise OpenAIError(400, "a variation takes exactly one image", "image")
        if mask is not None:
            raise OpenAIError(400, "a variation takes no mask; use an edit", "mask")
        if _bool(fields, "stream"):
            raise OpenAIError(400, "variations are not streamed", "stream")
        job = parse_job(fields, edit_size(images[0]), prompt_required=False)
        if fields.get("strength") is None:
            job = replace(job, request=replace(job.request, strength=DEFAULT_IMAGE_STRENGTH))
        request = replace(job.request, init_image=images[0])
        self.answer(req, resp, replace(job, request=request, use="variation"))


class Models:
    """GET /v1/models: the image models an OpenAI client may name, in OpenAI's list shape (its
    `created` the folder's modification time, 0 for one not yet on disk; `family` an
    extension). A folder of no family the server serves is left out, as the routes refuse it."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        entries = self.ctx.registry.entries()
        data = [_model_object(e) for e in entries if e.family is not None]
        resp.content_type = "application/json"
        resp.data = json.dumps({"object": "list", "data": data}).encode("utf-8")


def _model_object(entry: Any) -> dict:
    try:
        created = int(entry.path.stat().st_mtime)
    except OSError:
        created = 0
    return {
        "id": entry.model_id,
        "object": "model",
        "created": created,
        "owned_by": "gmlx",
        "family": entry.family,
    }


class ImageFile:
    """GET /v1/images/files/{name}: an image the routes answered by URL, while it is kept. The
    name is the capability (128 random bits), so no API key is asked (app.FrontGate)."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx

    def on_get(self, req: falcon.Request, resp: falcon.Response, name: str) -> None:
        store = self.ctx.service.image_store(create=False)
        found = None if store is None else store.get(name)
        if found is None:
            raise OpenAIError(404, f"no image {name[:80]!r} is kept here (it may have expired)")
        resp.data, resp.content_type = found
        resp.set_header("Cache-Control", "private, max-age=60")


def edit_size(image: np.ndarray) -> tuple[int, int]:
    """The 'auto' size of an edit: the first image's, scaled down (its aspect kept) to within
    the pixel limits where it is over them, then down to multiples of 16 (the default size
    where a side would be under 16)."""
    height, width = image.shape[:2]
    scale = min(
        1.0, math.sqrt(wire.MAX_PIXELS / (width * height)), wire.MAX_SIDE / max(width, height)
    )
    width, height = int(width * scale), int(height * scale)
    width, height = width - width % SIZE_MULTIPLE, height - height % SIZE_MULTIPLE
    if width < SIZE_MULTIPLE or height < SIZE_MULTIPLE:
        return DEFAULT_SIZE
    return width, height


# ---------------------------------------------------------------- bodies


def json_fields(req: falcon.Request) -> dict:
    """The JSON object of the body (the front gate has parsed it already)."""
    if getattr(req.context, "json_parsed", False):
        doc = req.context.json
    else:
        body = bytes(getattr(req.context, "body", b""))  # a tensor body arrives as a view
        try:
            doc = wire.load_json(body) if body and body.strip() else {}
        except ValueError:
            raise OpenAIError(400, "the body must be a JSON object") from None
    if not isinstance(doc, dict):
        raise OpenAIError(400, "the body must be a JSON object")
    return doc


def json_images(fields: dict, most: int, refusal: str) -> list[np.ndarray]:
    """References of a JSON edit: `images` or else `image`, one or a list, each a base64 string,
    a base64 data URI, or an object with `image_url` (data URI) or `b64_json`. Remote URLs are
    refused; so are more than `most` (`refusal`), before any is decoded."""
    field = "images" if "images" in fields else "image"
    values = fields.get(field)
    if values is None:
        return []
    if not isinstance(values, list):
        values = [values]
    if len(values) > most:
        raise OpenAIError(400, refusal, field)
    return [_decode(field, i, _base64_of(field, i, value)) for i, value in enumerate(values)]


def _base64_of(field: str, index: int, value: Any) -> str:
    if isinstance(value, dict):
        value = value.get("b64_json") or value.get("image_url")
        if isinstance(value, dict):
            value = value.get("url")
    if not isinstance(value, str):
        raise OpenAIError(400, f"{field}[{index}] must be base64 text or a data URI", field)
    if value.startswith("data:"):
        head, _, data = value.partition(",")
        if not head.endswith(";base64"):
            raise OpenAIError(400, f"{field}[{index}]: only base64 data URIs are read", field)
        return data
    if value.startswith(("http://", "https://")):
        raise OpenAIError(400, f"{field}[{index}]: remote URLs are not fetched; send base64", field)
    return value


def _decode(field: str, index: int, text: str) -> np.ndarray:
    try:
        data = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise OpenAIError(
            400, f"{field}[{index}] is not standard base64 (nor a base64 data URI)", field
        ) from None
    return _decode_file(field, index, data)


def _decode_file(field: str, index: int, data: bytes) -> np.ndarray:
    try:
        return decode_image_file(data)
    except EngineInputError as exc:
        raise OpenAIError(400, f"{field}[{index}]: {exc}", field) from None


def image_fields(
    req: falcon.Request, most: int, refusal: str
) -> tuple[dict, list[np.ndarray], np.ndarray | None]:
    """The fields, images and mask (uint8 (H, W), 255 where to paint; None: none) of an edit
    or a variation, multipart or JSON; more than `most` images are refused (`refusal`) before
    any is decoded (a small file may hold a large image)."""
    if (req.content_type or "").split(";", 1)[0].strip() == "multipart/form-data":
        fields, files, mask_file = multipart_fields(req)
        if len(files) > most:
            raise OpenAIError(400, refusal, "image")
        images = [_decode_file("image", i, data) for i, data in enumerate(files)]
        mask = None if mask_file is None else _decode_file("mask", 0, mask_file)
    else:
        fields = json_fields(req)
        images = json_images(fields, most, refusal)
        mask = fields.get("mask")
        if mask is not None:
            mask = _decode("mask", 0, _base64_of("mask", 0, mask))
    return fields, images, None if mask is None else mask_of(mask)


def multipart_fields(req: falcon.Request) -> tuple[dict, list[bytes], bytes | None]:
    """Fields, image files (`image`, `image[]`, `images` or `images[]` parts, not decoded) and
    the mask file of a multipart body."""
    body = getattr(req.context, "body", None)
    if body is None:
        body = req.bounded_stream.read()
    handler = req.options.media_handlers["multipart/form-data"]
    fields: dict[str, Any] = {}
    images: list[bytes] = []
    mask = None
    try:
        for part in handler.deserialize(io.BytesIO(body), req.content_type, len(body)):
            name = part.name or ""
            if name in IMAGE_PARTS:
                images.append(part.stream.read())
            elif name == "mask":
                mask = part.stream.read()
            else:
                fields[name] = form_value(name, part.text)
    except falcon.HTTPError as exc:  # malformed multipart (Falcon's MediaMalformedError etc.)
        raise OpenAIError(400, f"the multipart body could not be read: {exc.title}") from None
    return fields, images, mask


def form_value(name: str, text: str) -> Any:
    """A form field as the JSON value it stands for: numbers parsed, "" absent (None)."""
    if text == "":
        return None
    if name in FORM_BOOLEANS:
        value = {"true": True, "false": False}.get(text.strip().lower())
        if value is None:
            raise OpenAIError(400, f"{name} must be true or false, not {text[:40]!r}", name)
        return value
    kind = FORM_NUMBERS.get(name)
    if kind is None:
        return text
    try:
        return kind(text.strip())
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise OpenAIError(400, f"{name} must be {what}, not {text[:40]!r}", name) from None
