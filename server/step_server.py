"""The step routes served in process for one model, and sampling through them: `StepServer`
runs what `gmlx serve` runs (registry, worker, service, routes, the request-head gate) on an
ephemeral 127.0.0.1 port, and `ViaStepsTransport` drives it with the shared StepClient, one
request per step, as a remote client does (`gmlx image sample --via-steps`, `gmlx image bench
--via-steps`, docs/contract.md §6)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from .engine.sampling import DirectTransport, flow_map_schedule
from .memory import PlannedTransport
from .model_choice import ModelChoice


class StepServer:
    """The server `gmlx serve` runs (registry, worker, service, step routes, http_gate's
    request-head gate) for one model, on an ephemeral 127.0.0.1 port of this process: what
    `gmlx image bench --via-steps` and `gmlx image sample --via-steps` drive."""

    def __init__(self, choice: ModelChoice) -> None:
        from .app import ServerThread, build_context, create_app, make_server
        from .config import ServerConfig

        self.choice = choice
        # the step routes are what this server is for, whatever the configuration says of
        # `gmlx serve`'s (server.image.steps_api)
        image = dataclasses.replace(choice.image, steps_api=True)
        self.config = ServerConfig(
            host="127.0.0.1", port=0, default_model=choice.model_id, image=image
        )
        self.ctx = build_context(self.config, choice.registry, choice.group)
        self.http = ServerThread(make_server(create_app(self.ctx), self.config))
        self.loaded = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http.port}"

    @property
    def service(self):
        return self.ctx.service

    def __enter__(self) -> StepServer:
        self.http.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.loaded is not None:
            self.service.release(self.loaded)
        self.http.stop()
        self.service.close()

    def load(self):
        """Load (and hold) the model on the worker: the loaded instance the routes use."""
        self.loaded = self.service.acquire(self.choice.model_id)
        return self.loaded

    def direct(self, table: Any = None) -> PlannedTransport:
        """The in-process transport on the same loaded model, through the same worker and memory
        plan (under patch table `table`, None for the plain model)."""
        return PlannedTransport(
            self.loaded, self.service.memory, call=self.service.worker.call, table=table
        )


class ViaStepsTransport:
    """Sampling through the step routes (docs/contract.md §6): encode and decode in process, the
    conditionings uploaded by hash (HEAD, then PUT), rows `{"cond": hash, "num_tokens": L}`,
    a run, one step request per step under convention `reference` (naming `patch_table`, a
    table the client defined, or none)."""

    convention = "reference"

    def __init__(
        self, client: Any, direct: DirectTransport, model_id: str, patch_table: str | None = None
    ) -> None:
        self.client = client
        self.direct = direct
        self.model_id = model_id
        self.patch_table = patch_table
        self.run: str | None = None
        self.sample_sigmas: np.ndarray | None = None
        self.transport_ms: list[float] = []  # wall - forward per step request
        self.server_ms: list[float] = []  # X-Gmlx-Server-Ms - forward: the route's own part
        self.uploads: dict[str, np.ndarray] = {}

    def encode(self, text: str, images: Sequence[np.ndarray]):
        return self.direct.encode(text, images)

    def encode_image(self, pixels: np.ndarray) -> np.ndarray:
        return self.direct.encode_image(pixels)

    def row(self, encoding) -> dict:
        cond = np.ascontiguousarray(encoding.cond, dtype=np.float32)
        row: dict[str, Any] = {"cond": self._upload(cond), "num_tokens": int(cond.shape[-2])}
        if encoding.ref_latents:
            refs = [np.ascontiguousarray(r, dtype=np.float32) for r in encoding.ref_latents]
            row["ref_latents"] = [self._upload(r) for r in refs]
            row["image_slots"] = list(encoding.image_slots[: len(refs)])
        return row

    def _upload(self, array: np.ndarray) -> str:
        from gmlx_contract.hashing import tensor_hash

        digest = tensor_hash(array)
        self.uploads[digest] = array
        if not self.client.has_tensor(digest):
            self.client.put_tensor(array)
        return digest

    def begin(self, sigmas: np.ndarray) -> None:
        self.run = self.client.begin_run(self.model_id)
        self.sample_sigmas = flow_map_schedule(self.direct.model, sigmas)

    def step(
        self, x: np.ndarray, timestep: np.ndarray, rows: Sequence[Any], skip: Sequence[int] = ()
    ) -> np.ndarray:
        answer = self.client.step(
            x,
            timestep,
            list(rows),
            model=self.model_id,
            run=self.run,
            convention=self.convention,
            patch_table=self.patch_table,
            skip=list(skip) or None,
            uploads=self.uploads,
            sample_sigmas=self.sample_sigmas,
        )
        forward = answer.forward_ms or 0.0
        self.transport_ms.append(answer.wall_ms - forward)
        self.server_ms.append((answer.server_ms or forward) - forward)
        return answer.out

    def end(self) -> None:
        if self.run is not None:
            self.client.end_run(self.run)
            self.run = None

    def decode(self, latents: np.ndarray) -> np.ndarray:
        return self.direct.decode(latents)
