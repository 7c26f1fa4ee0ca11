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
        refs = flag(fields, "refs", True)
        check_upsampling(fields.get("prompt_upsampling"))
        if images is None:
            images = images_of_json(fields.get("images"))
        if len(images) > MAX_IMAGES:
            raise ContractError(400, f"{len(images)} images is over the limit of {MAX_IMAGES}")

        loaded = self.service.acquire(model_field(fields))
        try:
            result = self.service.encode(loaded, text, images, refs)
        finally:
            self.service.release(loaded)
        send_container(resp, self._answer(result, refs))

    def _answer(self, result, refs: bool) -> list:
        cond = np.ascontiguousarray(result.cond, dtype=np.float32)
        latents = [np.ascontiguousarray(r, dtype=np.float32) for r in result.ref_latents]
        latents = latents if refs else []
        for array in (cond, *latents):
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
        return wire.container_pieces(tensors, fields)


def check_upsampling(value) -> None:
    if value is not None and not isinstance(value, bool):
        raise ContractError(400, "prompt_upsampling must be true, false or null")
    if value is True:
        raise ContractError(
            400, "prompt_upsampling was asked for, but this server has no prompt upsampler"
        )


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
