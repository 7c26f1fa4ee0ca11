"""Health, capabilities and the model routes (docs/contract.md §2.1-2.5)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import falcon
from gmlx_contract import version, wire
from gmlx_contract.errors import ContractError

from .. import __version__
from ..engine.registry import ModelEntry
from ..metrics import RETRY_AFTER_S, readiness
from .common import Resource, json_body, model_field, send_json

# The features of docs/contract.md §5.4 in their published order; each family's spec lists its
# own, and the capabilities are those of the families this server can load.
FEATURE_ORDER = (
    "prefix_cache",
    "noise_mask",
    "rgba_vae",
    "tiled_vae",
    "ref_cache",
    "skip_blocks",
    "flow_map",  # an extension: a family whose distilled checkpoint needs `sample_sigmas`
)
CONVENTIONS = ["comfy", "reference"]


class Health(Resource):
    versioned = False

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        """Liveness; with `ready=1`, readiness: 503 with Retry-After while the server cannot
        take work now (a model loading, the rank group not ok), naming why."""
        if not ready_asked(req.get_param("ready")):
            send_json(resp, {"status": "ok", "gmlx_version": __version__})
            return
        if self.ctx.traffic.stopping.is_set():
            reason = "the server is stopping"
        else:
            reason = readiness(self.service, self.ctx.group)
        if reason is None:
            send_json(resp, {"status": "ok", "ready": True, "gmlx_version": __version__})
            return
        resp.set_header("Retry-After", str(RETRY_AFTER_S))
        body = {"status": "not_ready", "ready": False, "reason": reason}
        send_json(resp, {**body, "gmlx_version": __version__}, 503)

    # a load balancer's check may ask with HEAD: the same status, no body (Waitress sends none)
    on_head = on_get


def ready_asked(value: str | None) -> bool:
    """The `ready` query parameter: 1 or true asks for readiness, 0, false or none does not
    (true and false in any case, as docs/openapi.yaml says)."""
    if value is None or value.lower() in ("0", "false"):
        return False
    if value.lower() in ("1", "true"):
        return True
    raise ContractError(400, f"ready must be 1, true, 0 or false, not {value!r}")


class Capabilities(Resource):
    versioned = False

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        send_json(resp, self.document())

    def document(self) -> dict:
        families = self.registry.available_families()
        return {
            "contract": _version_object(version.CONTRACT_VERSION),
            "min_client": _version_object(version.MIN_CLIENT),
            "gmlx_version": __version__,
            "wire": {"container": "safetensors", "dtypes": list(wire.CAPABILITY_DTYPES)},
            "families": families,
            "conventions": CONVENTIONS,
            "patch_kinds": ["lora"],
            "features": self._features(families),
            "limits": {
                "max_tensor_bytes": self.service.tensors.limit,
                "max_adapter_bytes": self.service.adapters.limit,
                "max_rows": wire.MAX_ROWS,
                "max_runs": wire.MAX_RUNS,
            },
            **self._distributed(),
        }

    def _distributed(self) -> dict:
        """An extension of docs/contract.md §2.1: the rank group's size, mode and state."""
        group = self.ctx.group
        return {} if group is None else {"distributed": group.describe()}

    def _features(self, families: list[str]) -> list[str]:
        found: set[str] = set()
        for name in families:
            found.update(self.registry.families[name].features)
        return [f for f in FEATURE_ORDER if f in found]


def _version_object(v: tuple[int, int]) -> dict:
    return {"major": v[0], "minor": v[1]}


class Models(Resource):
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resident = set(self.registry.resident_ids())
        models = [_listing(entry, entry.model_id in resident) for entry in self.registry.entries()]
        send_json(resp, {"models": models, "default_model": self.registry.default_id()})


def _listing(entry: ModelEntry, resident: bool) -> dict:
    if entry.family is None:
        return {"model": entry.model_id, "family": None}
    return {
        "model": entry.model_id,
        "family": entry.family,
        "variant": entry.variant,
        "resident": resident,
    }


def resolve_or_404(registry, model_id: Any) -> ModelEntry:
    """status, manifest, load and unload answer every resolution failure 404 (docs/contract.md §2)."""
    try:
        return registry.resolve(model_id)
    except ContractError as exc:
        raise ContractError(404, exc.message) from None


def from_files(entry: ModelEntry, read: Callable[[], dict]) -> dict:
    """What a family reads from a folder it has not loaded; a folder that lacks a config key or
    a file it needs is a misconfigured entry, answered 400 naming the missing piece
    (docs/contract.md §2.3), not a server failure."""
    try:
        return read()
    except KeyError as exc:
        missing = exc.args[0] if exc.args else exc
        raise ContractError(
            400,
            f"model {entry.model_id!r} at {entry.path} is misconfigured: its config lacks "
            f"the key {missing!r}",
        ) from None
    except FileNotFoundError as exc:
        missing = f"{exc.filename} is missing" if exc.filename else str(exc)
        raise ContractError(
            400, f"model {entry.model_id!r} at {entry.path} is misconfigured: {missing}"
        ) from None


class ModelStatus(Resource):
    def on_get(self, req: falcon.Request, resp: falcon.Response, model: str) -> None:
        entry = resolve_or_404(self.registry, model)
        loaded = self.registry.loaded(entry.model_id)
        body = None
        if loaded is None:
            body = from_files(
                entry, lambda: self.service.worker.call(self.registry.describe, entry.model_id)
            )
        if body is None:
            # No way to describe it unloaded: load it (it then stays resident).
            loaded = self.service.acquire(entry.model_id)
            try:
                body = self.service.on_model(loaded, lambda m: m.status())
            finally:
                self.service.release(loaded)
        head = {
            "model": entry.model_id,
            "family": entry.family,
            "variant": entry.variant,
            "resident": self.registry.loaded(entry.model_id) is not None,
        }
        if "encoder" in body.get("residency", {}):  # the server's setting (server/memory.py)
            body["residency"]["encoder"]["policy"] = self.service.memory.encoder_residency
        send_json(resp, {**body, **head})


class ModelManifest(Resource):
    def on_get(self, req: falcon.Request, resp: falcon.Response, model: str) -> None:
        entry = resolve_or_404(self.registry, model)
        body = None
        if self.registry.loaded(entry.model_id) is None:
            body = from_files(
                entry, lambda: self.service.worker.call(self.registry.manifest, entry)
            )
        if body is None:  # no way to read it unloaded: load it (it then stays resident)
            loaded = self.service.acquire(entry.model_id)
            try:
                body = self.service.on_model(loaded, lambda m: m.manifest())
            finally:
                self.service.release(loaded)
        send_json(resp, {"model": entry.model_id, **body})


class LoadModel(Resource):
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        entry = resolve_or_404(self.registry, model_field(json_body(req)))
        loaded = self.service.acquire(entry.model_id)
        self.service.release(loaded)
        send_json(resp, {"model": entry.model_id, "resident": True})


class UnloadModel(Resource):
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        model = model_field(json_body(req))
        if isinstance(model, str) and self.registry.loaded(model) is not None:
            model_id = model  # resident, even where its folder has gone since: it can go too
        else:
            model_id = resolve_or_404(self.registry, model).model_id
        unloaded = self.service.worker.call(self.registry.unload, model_id)
        self.service.fit_cache_bounds()  # room returned: the caches' bounds go back up
        send_json(resp, {"model": model_id, "unloaded": bool(unloaded)})
