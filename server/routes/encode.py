"""POST encode: a prompt and its reference images as a conditioning (docs/contract.md §2.6)."""

from __future__ import annotations

import base64
import binascii

import falcon
import numpy as np
from gmlx_contract import wire
from gmlx_contract.errors import ContractError

from ..engine.base import EngineInputError
from ..imagefiles import decode_image_file
from ..service import CachedTensor
from .common import (
    Resource,
    container_body,
    flag,
    is_container_request,
    json_body,
    lone_surrogate,
    model_field,
    send_container,
)

MAX_IMAGES = 10


class Encode(Resource):
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        if is_container_request(req):
            container = container_body(req)
            fields = container.fields
            images = images_of_container(container)
        else:
            fields = json_body(req)
            images = None
        text = fields.get("text")
        if not isinstance(text, str):
            raise ContractError(400, "encode needs text: the prompt, a string")
        if (at := lone_surrogate(text)) is not None:
            raise ContractError(400, f"text holds a lone surrogate at {at}, not a character")
        refs = flag(fields, "refs", True)
        asked = upsampling_asked(fields.get("prompt_upsampling"))
        if images is None:
            images = images_of_json(fields.get("images"))
        if len(images) > MAX_IMAGES:
            raise ContractError(400, f"{len(images)} images is over the limit of {MAX_IMAGES}")

        loaded = self.service.acquire(model_field(fields))
        try:
            revised = self.service.upsampled_prompt(loaded, text, images, asked)
            result = self.service.encode(loaded, revised or text, images, refs)
            typed = None if revised is None else self.service.encode(loaded, text, [], refs)
        finally:
            self.service.release(loaded)
        send_container(resp, self._answer(result, refs, revised, typed))

    def _answer(self, result, refs: bool, revised: str | None = None, typed=None) -> list:
        """The container: `cond` and the references' latents; where the prompt was rewritten,
        `revised_prompt` and the conditioning of the prompt as typed (`cond_typed`)."""
        cond = np.ascontiguousarray(result.cond, dtype=np.float32)
        latents = [np.ascontiguousarray(r, dtype=np.float32) for r in result.ref_latents]
        latents = latents if refs else []
        extra = [] if typed is None else [np.ascontiguousarray(typed.cond, dtype=np.float32)]
        for array in (cond, *latents, *extra):
            if array.nbytes > self.service.tensors.limit:
                raise ContractError(
                    413,
                    f"an encoded tensor of {array.nbytes} bytes is over the tensor cache limit of "
                    f"{self.service.tensors.limit} bytes (server.image.tensor_cache_mb)",
                )
        cond_hash = self.service.store_tensor(CachedTensor(cond, "F32"))
        ref_hashes = [self.service.store_tensor(CachedTensor(r, "F32")) for r in latents]
        tensors = {"cond": cond, **{f"ref_{i}": r for i, r in enumerate(latents)}}
        fields = {
            "cond": cond_hash,
            "ref_latents": ref_hashes,
            "image_slots": [int(s) for s in result.image_slots],
            "num_tokens": int(cond.shape[1]) if cond.ndim == 3 else int(cond.shape[0]),
        }
        if typed is not None:
            tensors["cond_typed"] = extra[0]
            fields["cond_typed"] = self.service.store_tensor(CachedTensor(extra[0], "F32"))
            fields["revised_prompt"] = revised
        return wire.container_pieces(tensors, fields)


def upsampling_asked(value) -> bool | None:
    """The request's prompt_upsampling: true forces, false forbids, null leaves it to the
    model entry (service.upsampled_prompt)."""
    if value is not None and not isinstance(value, bool):
        raise ContractError(400, "prompt_upsampling must be true, false or null")
    return value


def images_of_container(container: wire.Container) -> list[np.ndarray]:
    """The image tensors, ordered by (name length, name): image_2 before image_10."""
    images = []
    for name in sorted(container.tensors, key=lambda n: (len(n), n)):
        array = container.tensors[name]
        if container.dtypes[name] != "U8" or array.ndim != 3 or array.shape[2] not in (3, 4):
            raise ContractError(
                400,
                f"image tensor {name!r} must be U8 of shape (H, W, 3) or (H, W, 4), not "
                f"{container.dtypes[name]} {list(array.shape)}",
            )
        images.append(array)
    return images


def images_of_json(values) -> list[np.ndarray]:
    if values is None:
        return []
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ContractError(400, "images must be a list of base64 strings")
    if len(values) > MAX_IMAGES:
        raise ContractError(400, f"{len(values)} images is over the limit of {MAX_IMAGES}")
    return [decode_image(i, v) for i, v in enumerate(values)]


def decode_image(index: int, text: str) -> np.ndarray:
    """Strict standard base64 of a PNG, JPEG, WebP or GIF file -> uint8 (H, W, 3 or 4).

    Undecodable images are answered 400 here (the contract's reference server answers some of
    them 500, docs/contract.md §2.6 quirk; no client relies on that)."""
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ContractError(
            400, f"images[{index}] is not plain standard base64 (no data: prefix)"
        ) from None
    try:
        return decode_image_file(data)
    except EngineInputError as exc:
        raise ContractError(400, f"images[{index}]: {exc}") from None
