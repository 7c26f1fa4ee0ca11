"""A real Waitress server on an ephemeral loopback port, over the test family."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest
import requests
from gmlx_contract import wire
from gmlx_contract.hashing import tensor_hash
from gmlx_server.app import ServerThread, build_context, create_app, make_server
from gmlx_server.config import ImageConfig, ServerConfig
from gmlx_server.engine.registry import ModelRegistry
from gmlx_server.routes.common import PREFIX, ServerContext

from . import linear_family

VERSION = {"X-Gmlx-Steps-Contract": "1.0"}
CONTAINER = {"Content-Type": wire.CONTAINER_TYPE}


@dataclass
class LiveServer:
    base: str  # http://127.0.0.1:port
    ctx: ServerContext
    thread: ServerThread
    session: requests.Session = field(default_factory=requests.Session)

    @property
    def url(self) -> str:
        return self.base + PREFIX

    def call(self, method: str, path: str, *, versioned: bool = True, **kw) -> requests.Response:
        headers = {**(VERSION if versioned else {}), **kw.pop("headers", {})}
        return self.session.request(
            method, self.url + "/" + path, headers=headers, timeout=30, **kw
        )

    def post_json(self, path: str, doc=None, **kw) -> requests.Response:
        return self.call("POST", path, json={} if doc is None else doc, **kw)

    def post_container(self, path: str, tensors: dict, fields: dict | None = None, **kw):
        body = wire.write_container(tensors, fields)
        headers = {**CONTAINER, **kw.pop("headers", {})}
        return self.call("POST", path, data=body, headers=headers, **kw)

    def put_tensor(self, array: np.ndarray, kind: str = "tensors") -> str:
        digest = tensor_hash(array)
        body = wire.write_container({"t": array})
        r = self.call("PUT", f"{kind}/{digest}", data=body, headers=CONTAINER)
        assert r.status_code == 200, r.text
        return digest

    def model(self, model_id: str = "alpha") -> linear_family.LinearModel:
        loaded = self.ctx.registry.loaded(model_id)
        assert loaded is not None, f"{model_id} is not loaded"
        return loaded.model

    def close(self) -> None:
        self.session.close()
        self.thread.stop()
        self.ctx.service.close()


def answer_tensors(response: requests.Response) -> dict[str, np.ndarray]:
    """The tensors of a route's container answer, which must be a 200."""
    assert response.status_code == 200, response.text
    return wire.read_container(response.content).tensors


def out_of(response: requests.Response) -> np.ndarray:
    """The output of a step's answer, which must be a 200."""
    return answer_tensors(response)["out"]


def model_root(tmp: Path) -> Path:
    root = tmp / "models"
    linear_family.make_model_folder(root, "alpha")
    linear_family.make_model_folder(root, "beta", variant="turbo")
    linear_family.make_model_folder(root, "broken", broken=True)
    (root / "stranger").mkdir()
    (root / "stranger" / "model_index.json").write_text('{"_class_name": "SomethingElse"}')
    (root / "not-a-model").mkdir()
    return root


def start_server(
    tmp: Path, *, config: ServerConfig | None = None, default_model: str | None = "alpha", **image
) -> LiveServer:
    """A server over a folder of test-family models (see `model_root`)."""
    root = model_root(tmp)
    config = config or ServerConfig(host="127.0.0.1", port=0)
    config = replace(config, port=0, model_dirs=[root], image=replace(ImageConfig(), **image))
    registry = ModelRegistry(
        [root], default_model, families={linear_family.FAMILY: linear_family.LINEAR}
    )
    return serve(config, registry)


def serve(config: ServerConfig, registry: ModelRegistry) -> LiveServer:
    """Serve the app for `registry` on an ephemeral port of config.host."""
    ctx = build_context(config, registry)
    server = make_server(create_app(ctx), config, port=0)
    thread = ServerThread(server).start()
    host = config.host if ":" not in config.host else f"[{config.host}]"
    return LiveServer(f"http://{host}:{thread.port}", ctx, thread)


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[LiveServer]:
    server = start_server(tmp_path_factory.mktemp("live"))
    yield server
    server.close()


@pytest.fixture
def fresh(tmp_path) -> Iterator[LiveServer]:
    """A server of its own, for tests that change run or model state heavily."""
    server = start_server(tmp_path)
    yield server
    server.close()


@pytest.fixture
def server_factory(tmp_path):
    started: list[LiveServer] = []

    def factory(**kw) -> LiveServer:
        server = start_server(tmp_path / f"s{len(started)}", **kw)
        started.append(server)
        return server

    yield factory
    for server in started:
        server.close()


def config_file(tmp_path: Path, text: str) -> Path:
    """tmp_path/config.toml holding `text`."""
    path = tmp_path / "config.toml"
    path.write_text(text, encoding="utf-8")
    return path


def linear_registry(folder: Path, settings) -> ModelRegistry:
    """A registry of `folder`, a model of the test family, loading every model at `settings`
    (a LoadSettings)."""
    return ModelRegistry(
        extra_models=[folder],
        families={linear_family.FAMILY: linear_family.LINEAR},
        settings=lambda model_id: settings,
    )


def refused_load(folder: Path, settings) -> str:
    """Why a linear_registry at `settings` refuses to load `folder`: a 400, before anything is
    resident."""
    from gmlx_contract.errors import ContractError

    registry = linear_registry(folder, settings)
    with pytest.raises(ContractError) as refused:
        registry.acquire(folder.name)
    assert refused.value.status == 400
    assert registry.resident_ids() == []
    return refused.value.message


def listed_models(config: Path) -> list[str]:
    """The model ids `gmlx list --json --config CONFIG` names."""
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "gmlx_server", "list", "--json", "--config", str(config)],
        capture_output=True,
        text=True,
        check=True,
    )
    return [m["model"] for m in json.loads(done.stdout)["models"]]
