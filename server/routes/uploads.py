"""Content-addressed uploads: tensors, adapters, adapter files and patch tables
(docs/contract.md §2.7-2.9)."""

from __future__ import annotations

import mmap
from pathlib import Path

import falcon
from gmlx_contract import wire
from gmlx_contract.errors import ContractError

from ..service import ByteLRU, CachedTensor, hash_of, verified
from .common import (
    Resource,
    check_digest,
    container_body,
    json_body,
    raw_json_body,
    send_empty,
    send_json,
)


class CachedUpload(Resource):
    """HEAD/PUT {kind}/{digest} over one of the two caches."""

    def __init__(self, ctx, kind: str) -> None:
        super().__init__(ctx)
        self.kind = kind

    @property
    def cache(self) -> ByteLRU:
        return self.service.tensors if self.kind == "tensors" else self.service.adapters

    def on_head(self, req: falcon.Request, resp: falcon.Response, digest: str) -> None:
        check_digest(digest)
        send_empty(resp, 200 if self.cache.has(digest) else 404)

    def on_put(self, req: falcon.Request, resp: falcon.Response, digest: str) -> None:
        check_digest(digest)
        container = container_body(req)
        if len(container.tensors) != 1:
            raise ContractError(
                400, f"an upload holds exactly one tensor, this one holds {len(container.tensors)}"
            )
        (name,) = container.tensors
        size = container.raw(name).nbytes
        if size > self.cache.limit:
            raise ContractError(
                413,
                f"tensor of {size} bytes is over the {self.kind} limit of {self.cache.limit} "
                f"bytes (see capabilities limits)",
            )
        self.cache.put(digest, verified(digest, container, name))
        send_json(resp, {"hash": digest})


class RegisterAdapters(Resource):
    """POST adapters/register: read a safetensors file under a model folder into the cache."""

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        path = self._allowed_path(json_body(req).get("path"))
        size = path.stat().st_size
        if size > wire.MAX_ADAPTER_FILE:
            raise ContractError(
                413, f"adapter file of {size} bytes is over the limit of {wire.MAX_ADAPTER_FILE}"
            )
        with path.open("rb") as handle, _mapped(handle, size) as body:
            hashes = self._store_all(body)
        send_json(resp, {"tensors": hashes})

    def _store_all(self, body) -> dict[str, str]:
        container = wire.read_container(body)
        return {name: self._store(container, name) for name in container.tensors}

    def _allowed_path(self, text) -> Path:
        if not isinstance(text, str) or not text:
            raise ContractError(400, "path must be a non-empty string")
        # One answer whether or not a file is there: outside the model folders, the route must
        # not tell a client which paths exist.
        refusal = ContractError(
            404, f"no adapter file at {text!r} inside the server's model folders"
        )
        try:
            path = Path(text).expanduser().resolve(strict=True)
        except (OSError, RuntimeError):
            raise refusal from None
        roots = [*self.registry.model_dirs, *self.registry.extra_models]
        inside = any(path.is_relative_to(root.expanduser().resolve()) for root in roots)
        if not inside or not path.is_file():
            raise refusal
        return path

    def _store(self, container: wire.Container, name: str) -> str:
        tensor = CachedTensor(container.tensors[name], container.dtypes[name])
        if tensor.nbytes > self.service.adapters.limit:
            raise ContractError(
                413,
                f"tensor {name!r} of {tensor.nbytes} bytes is over the adapter limit of "
                f"{self.service.adapters.limit} bytes",
            )
        digest = hash_of(tensor)
        # The cache keeps a compact copy, out of the mapped file that closes when the route ends.
        self.service.adapters.put(digest, tensor)
        return digest


class _mapped:
    """A read-only memory map of a file (an empty file maps to b"")."""

    def __init__(self, handle, size: int) -> None:
        self.handle, self.size, self.map, self.view = handle, size, None, None

    def __enter__(self):
        if self.size == 0:
            return b""
        self.map = mmap.mmap(self.handle.fileno(), 0, access=mmap.ACCESS_READ)
        self.view = memoryview(self.map)
        return self.view

    def __exit__(self, *exc) -> None:
        try:
            if self.view is not None:
                self.view.release()
            if self.map is not None:
                self.map.close()
        except BufferError:
            pass  # an array of a failed read still points into it; it closes when collected


class PatchTables(Resource):
    def on_put(self, req: falcon.Request, resp: falcon.Response, digest: str) -> None:
        check_digest(digest)
        doc = raw_json_body(req)
        query_model = req.get_param("model") or None
        table = self.service.put_table(digest, doc, query_model)
        send_json(resp, {"id": table})
