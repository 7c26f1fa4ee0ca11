"""The OpenAI image routes: POST /v1/images/generations and POST /v1/images/edits.

They answer the OpenAI images API's shape, `{"created": <unix time>, "data": [{"b64_json":
"<base64 PNG>"}, ...]}`, and refuse in its error shape, `{"error": {"message", "type", "param",
"code"}}`. Images are sampled with the in-process sampler (`engine/sampling.py`) on the server's
loaded model. Every model call (each encode, each step, each decode) is its own job on the image
worker, so the steps of step clients and of these routes interleave in arrival order instead of
one image holding the worker for its whole duration.

Fields beyond OpenAI's, all optional: `seed` (int; default random, image i of `n` gets seed + i),
`steps` (int 1-1000; default the model's own), `cfg` or `guidance` (number 0-100, cfg winning;
default the model's own), `negative_prompt` (str), `sampler` ("euler" or "uni_pc_bh2"). A JSON
field that is null is absent; a form field's text is read as the JSON value it stands for
(`form_value`). Only `response_format: "b64_json"` is served: `"url"` is refused 400 (this server
keeps no files). Sizes are "WxH" with sides multiples of 16, or "auto" (1024x1024 for a
generation, the first reference's size for an edit); over 2048x2048 pixels or a side over 4096
is refused 413, as on the step routes. docs/openapi.yaml describes both routes field by field.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import logging
import re
import secrets
import time
from dataclasses import dataclass, replace
from typing import Any

import falcon
import numpy as np
from gmlx_contract import wire
from gmlx_contract.errors import ContractError

from .engine.base import EngineInputError
from .engine.sampling import (
    SAMPLERS,
    ImageRequest,
    SettingError,
    generate,
    to_uint8,
)
from .imagefiles import decode_image_file
from .memory import PlannedTransport

log = logging.getLogger("gmlx.server")

PREFIX = "/v1/"
GENERATIONS_PATH = PREFIX + "images/generations"
EDITS_PATH = PREFIX + "images/edits"
MAX_IMAGES_PER_REQUEST = 10  # OpenAI's bound on n
MAX_REFERENCES = 10
DEFAULT_SIZE = (1024, 1024)
SIZE_MULTIPLE = 16
MAX_STEPS = 1000
MAX_SEED = 2**63 - 1
MAX_GUIDANCE = 100
OUTPUT_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}
RESPONSE_FORMATS = ("b64_json", "url")
SIZE_RE = re.compile(r"([0-9]{1,6})[xX]([0-9]{1,6})")  # whole value; docs/openapi.yaml says so too
# Form fields (multipart edits) that are numbers in a JSON body.
FORM_NUMBERS = {"n": int, "seed": int, "steps": int, "cfg": float, "guidance": float}
# A sampling setting the model refuses, as a refusal names it: (its words, the request field).
SETTING_FIELDS = {
    "steps": ("steps", "steps"),
    "width": ("the width in size", "size"),
    "height": ("the height in size", "size"),
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
    ):
        """`kind`: the error's type, where the refusal has its own (the front gate's)."""
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.given_kind = kind

    @property
    def kind(self) -> str:
        if self.given_kind is not None:
            return self.given_kind
        return {
            401: "authentication_error",
            404: "not_found_error",
            413: "invalid_request_error",
            503: "server_error",
        }.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def body(self) -> bytes:
        error = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return json.dumps({"error": error}).encode("utf-8")


def handle_openai_error(req, resp, exc: OpenAIError, params) -> None:
    resp.status = exc.status
    resp.content_type = "application/json"
    resp.data = exc.body()


def add_routes(app: falcon.App, ctx: Any) -> None:
    """Add the OpenAI image routes to the server's app (called by `app.create_app`)."""
    app.add_error_handler(OpenAIError, handle_openai_error)
    app.add_route(GENERATIONS_PATH, Generations(ctx))
    app.add_route(EDITS_PATH, Edits(ctx))


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


def _float(fields: dict, name: str) -> float | None:
    value = fields.get(name)
    if value is None:
        return None
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not 0 <= value <= MAX_GUIDANCE:  # NaN compares False
        raise OpenAIError(400, f"{name} must be a number from 0 to {MAX_GUIDANCE}", name)
    return float(value)


def _text(fields: dict, name: str, required: bool = False) -> str | None:
    value = fields.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or (required and not value.strip()):
        raise OpenAIError(400, f"{name} must be a non-empty string", name)
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
    in `output_format`, of `model` (None: the default model)."""

    request: ImageRequest
    count: int
    output_format: str
    model: str | None


def parse_job(fields: dict, default_size: tuple[int, int]) -> Job:
    """The job of a request's fields: JSON values (a form's are converted first, `form_value`;
    null is the same as absent). A size over the limit is refused last."""
    model = model_field(fields)
    if fields.get("response_format") == "url":
        raise OpenAIError(
            400,
            "response_format 'url' is not served: this server keeps no image files; use 'b64_json'",
            "response_format",
        )
    _choice(fields, "response_format", RESPONSE_FORMATS, "b64_json")
    output_format = _choice(fields, "output_format", OUTPUT_FORMATS, "png")
    sampler = _choice(fields, "sampler", SAMPLERS, "euler")
    cfg, guidance = _float(fields, "cfg"), _float(fields, "guidance")
    width, height = parse_size(fields.get("size"), default_size)
    seed = _int(fields, "seed", None, 0, MAX_SEED)
    request = ImageRequest(
        prompt=_text(fields, "prompt", required=True),
        negative=_text(fields, "negative_prompt"),
        width=width,
        height=height,
        seed=secrets.randbelow(2**31) if seed is None else seed,
        steps=_int(fields, "steps", None, 1, MAX_STEPS),
        cfg=guidance if cfg is None else cfg,
        sampler=sampler,
    )
    job = Job(request, _int(fields, "n", 1, 1, MAX_IMAGES_PER_REQUEST), output_format, model)
    check_size_limit(width, height)
    return job


def model_field(fields: dict) -> str | None:
    """The model asked for: None, "" (both: the default model) or a model id."""
    model = fields.get("model")
    if model is not None and not isinstance(model, str):
        raise OpenAIError(400, "model must be a string (a model id)", "model")
    return model or None


# ---------------------------------------------------------------- the work


class ImageRoute:
    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx

    @property
    def service(self):
        return self.ctx.service

    def answer(self, resp: falcon.Response, job: Job) -> None:
        try:
            loaded = self.service.acquire(job.model)
        except ContractError as exc:
            raise OpenAIError(exc.status, exc.message, "model") from None
        request = job.request
        try:
            images = [
                self.one_image(loaded, replace(request, seed=request.seed + i), job.output_format)
                for i in range(job.count)
            ]
        except ContractError as exc:
            raise OpenAIError(exc.status, exc.message) from None
        except SettingError as exc:
            name, field = SETTING_FIELDS.get(exc.setting, (exc.setting, exc.setting))
            raise OpenAIError(400, exc.naming(name), field) from None
        except ValueError as exc:  # engine input errors and sampler refusals are the client's
            raise OpenAIError(400, str(exc) or type(exc).__name__) from None
        finally:
            self.service.release(loaded)
        resp.status = 200
        resp.content_type = "application/json"
        resp.data = json.dumps(
            {"created": int(time.time()), "data": [{"b64_json": image} for image in images]}
        ).encode("utf-8")

    def one_image(self, loaded: Any, request: ImageRequest, output_format: str) -> str:
        service = self.service
        transport = PlannedTransport(
            loaded, service.memory, call=service.worker.call, table=loaded.default_table
        )
        status = service.worker.call(loaded.model.status)
        transport.check_image(status, request)
        latents, timings = generate(transport, status, request)
        pixels = transport.decode(latents)
        log.info(
            "image %dx%d, %d steps, seed %d in %.2f s",
            request.width,
            request.height,
            len(timings.step_s),
            request.seed,
            timings.image_s,
        )
        return encode_image(pixels, output_format)


def encode_image(pixels: np.ndarray, output_format: str) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(to_uint8(pixels)).save(buffer, format=OUTPUT_FORMATS[output_format])
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class Generations(ImageRoute):
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        self.answer(resp, parse_job(json_fields(req), DEFAULT_SIZE))


class Edits(ImageRoute):
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        if (req.content_type or "").split(";", 1)[0].strip() == "multipart/form-data":
            fields, images = multipart_fields(req)
        else:
            fields = json_fields(req)
            images = json_images(fields)
        if not images:
            raise OpenAIError(400, "an edit needs at least one reference image", "image")
        if len(images) > MAX_REFERENCES:
            raise OpenAIError(400, f"at most {MAX_REFERENCES} reference images", "image")
        if fields.get("mask") is not None:
            raise OpenAIError(400, "masks are not supported; send the image(s) only", "mask")
        job = parse_job(fields, edit_size(images[0]))
        self.answer(resp, replace(job, request=replace(job.request, images=tuple(images))))


def edit_size(image: np.ndarray) -> tuple[int, int]:
    """The 'auto' size of an edit: the first reference's, down to multiples of 16 and within
    the pixel limits (else the default size)."""
    height, width = image.shape[:2]
    width, height = width - width % SIZE_MULTIPLE, height - height % SIZE_MULTIPLE
    if (
        width < SIZE_MULTIPLE
        or height < SIZE_MULTIPLE
        or width * height > wire.MAX_PIXELS
        or max(width, height) > wire.MAX_SIDE
    ):
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


def json_images(fields: dict) -> list[np.ndarray]:
    """References of a JSON edit: `images` or else `image`, one or a list, each a base64 string,
    a base64 data URI, or an object with `image_url` (data URI) or `b64_json`. Remote URLs are
    refused."""
    field = "images" if "images" in fields else "image"
    values = fields.get(field)
    if values is None:
        return []
    if not isinstance(values, list):
        values = [values]
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


def multipart_fields(req: falcon.Request) -> tuple[dict, list[np.ndarray]]:
    """Fields and reference images of a multipart edit (`image`, `image[]` or `images[]`)."""
    body = getattr(req.context, "body", None)
    if body is None:
        body = req.bounded_stream.read()
    handler = req.options.media_handlers["multipart/form-data"]
    fields: dict[str, Any] = {}
    images: list[np.ndarray] = []
    try:
        for part in handler.deserialize(io.BytesIO(body), req.content_type, len(body)):
            name = part.name or ""
            if name in ("image", "image[]", "images", "images[]"):
                data = part.stream.read()
                images.append(_decode_file("image", len(images), data))
            elif name == "mask":
                fields["mask"] = True
            else:
                fields[name] = form_value(name, part.text)
    except falcon.HTTPError as exc:  # malformed multipart (Falcon's MediaMalformedError etc.)
        raise OpenAIError(400, f"the multipart body could not be read: {exc.title}") from None
    return fields, images


def form_value(name: str, text: str) -> Any:
    """A form field as the JSON value it stands for: numbers parsed, "" absent (None)."""
    if text == "":
        return None
    kind = FORM_NUMBERS.get(name)
    if kind is None:
        return text
    try:
        return kind(text.strip())
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise OpenAIError(400, f"{name} must be {what}, not {text[:40]!r}", name) from None
