"""POST vae/decode and vae/encode (docs/contract.md §2.12-2.13). One image per worker job, so steps of
other clients interleave with a long batch."""

from __future__ import annotations

import falcon
import numpy as np
from gmlx_contract import wire
from gmlx_contract.errors import ContractError

from ..service import tensor_of
from .common import (
    Resource,
    check_pixels,
    container_body,
    flag,
    model_field,
    send_container,
)

TILED_HEADER = "X-Gmlx-Vae-Tiled"


def _batch(container: wire.Container, name: str, layout: str) -> np.ndarray:
    """The named 4-D batch as float32: absent or not 4-D 400, over 16 images 413."""
    if name not in container.tensors:
        raise ContractError(400, f"send the tensor {name!r} of shape {layout}")
    tensor = tensor_of(container, name)
    shape = tensor.shape
    if shape and shape[0] > wire.MAX_VAE_IMAGES:
        raise ContractError(
            413, f"{shape[0]} images is over the limit of {wire.MAX_VAE_IMAGES} per VAE pass"
        )
    if len(shape) != 4:
        raise ContractError(400, f"{name} must be 4-D {layout}, not {list(shape)}")
    if shape[0] == 0:
        raise ContractError(400, f"{name} holds no images")
    if 0 in shape[1:]:
        raise ContractError(400, f"{name} must not be empty; got the shape {list(shape)}")
    return tensor.float32()


class VaeDecode(Resource):
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        container = container_body(req)
        latents = _batch(container, "latents", "(B, C, h, w)")
        alpha = flag(container.fields, "alpha", False)
        loaded = self.service.acquire(model_field(container.fields))
        try:
            stride = loaded.facts.vae_stride
            _, _, h, w = latents.shape
            check_pixels(w * stride, h * stride, "the decoded image")
            tiled = self.service.worker.call(
                self.service.memory.check_vae, loaded, h * stride, w * stride, True
            )
            # alpha is checked after the plan (docs/contract.md §2.12)
            if alpha and loaded.facts.vae_channels_out != 4:
                raise ContractError(400, f"{loaded.entry.family}'s VAE has no alpha channel")
            images = [
                self.service.on_model(loaded, lambda m, z=z: m.vae_decode(z, alpha, tiled))
                for z in latents
            ]
        finally:
            self.service.release(loaded)
        said_tiled(resp, tiled)
        send_container(resp, wire.container_pieces({"image": _stack(images)}))


class VaeEncode(Resource):
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        container = container_body(req)
        images = _batch(container, "image", "(B, H, W, C)")
        _, height, width, _ = images.shape
        check_pixels(width, height, "the image")
        loaded = self.service.acquire(model_field(container.fields))
        try:
            check = self.service.memory.check_vae
            tiled = self.service.worker.call(check, loaded, height, width, False)
            latents = [
                self.service.on_model(loaded, lambda m, im=im: m.vae_encode(im, tiled))
                for im in images
            ]
        finally:
            self.service.release(loaded)
        said_tiled(resp, tiled)
        send_container(resp, wire.container_pieces({"latents": _stack(latents)}))


def said_tiled(resp: falcon.Response, tiled: bool) -> None:
    """Extension of docs/contract.md §2.12-2.13: whether the pass ran in tiles (the memory
    plan's fallback where the whole pass does not fit; tiles are not the whole pass)."""
    resp.set_header(TILED_HEADER, "true" if tiled else "false")


def _stack(arrays: list[np.ndarray]) -> np.ndarray:
    return np.stack([np.asarray(a, dtype=np.float32) for a in arrays])
