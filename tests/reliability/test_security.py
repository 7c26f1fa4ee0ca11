"""Access: loopback only by default (checked from a real second address on this machine, a
network namespace), the API key on every route, and adapters/register confined to the model
folders (traversal, symlink escapes, special files)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from gmlx_contract import wire
from gmlx_server.config import ServerConfig
from gmlx_server.routes.common import PREFIX

from ..server.test_remote_peer import client_for, namespace  # noqa: F401 - fixture

OPENAPI = Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml"
SAMPLE_PARAMS = {
    "{model}": "alpha",
    "{digest}": "0" * 64,
    "{run}": "0123456789abcdef",
    "{name}": "0" * 32 + ".png",
}
# The paths no key guards, and what they answer without one: liveness, and the OpenAI routes'
# images by URL, whose random names are their key (none is kept under the sample name).
KEYLESS = {"/health": 200, "/v1/images/files/" + "0" * 32 + ".png": 404}


def every_route() -> list[tuple[str, str]]:
    """(method, path) of every operation in docs/openapi.yaml, path parameters filled in."""
    doc = yaml.safe_load(OPENAPI.read_text())
    routes = []
    for template, item in doc["paths"].items():
        path = template
        for name, value in SAMPLE_PARAMS.items():
            path = path.replace(name, value)
        routes += [(method.upper(), path) for method in item if method != "parameters"]
    return sorted(routes)


ROUTES = every_route()
KEYED_ROUTES = [(m, p) for m, p in ROUTES if p not in KEYLESS]  # the API key guards these
STEP_ROUTES = [(m, p) for m, p in ROUTES if p.startswith(PREFIX + "/")]  # loopback unless told

PROBE = """
import json, sys, requests
base, key, routes = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
out = {}
session = requests.Session()
for method, path in routes:
    for label, headers in (("key", {"Authorization": "Bearer " + key}), ("nokey", {})):
        headers["X-Gmlx-Steps-Contract"] = "1.0"
        r = session.request(method, base + path, headers=headers, timeout=20)
        json_body = r.headers.get("Content-Type", "").startswith("application/json")
        body = r.json() if r.content and json_body else None
        out[f"{label} {method} {path}"] = [r.status_code, body]
print(json.dumps(out))
"""


def probe_routes(ns: str, base: str, key: str, routes) -> dict:
    result = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", PROBE, base, key, json.dumps(routes)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_description_has_every_route():
    # the 19 operations of docs/contract.md §2, /health (GET and HEAD), /metrics, the four
    # OpenAI image routes and their list of models
    assert len(ROUTES) == 27 and len(STEP_ROUTES) == 19


def test_a_default_server_cannot_be_reached_from_another_address(namespace, server_factory):  # noqa: F811
    name, host_ip, _ = namespace
    server = server_factory()  # the default bind: 127.0.0.1
    port = int(server.base.rsplit(":", 1)[1])
    code = (
        "import socket,sys\n"
        "try:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)\n"
        "except OSError as e:\n print(type(e).__name__)\nelse:\n print('connected')\n"
    )
    result = subprocess.run(
        ["ip", "netns", "exec", name, sys.executable, "-c", code, host_ip, str(port)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.stdout.strip() == "ConnectionRefusedError", result


def test_every_route_refuses_a_real_remote_peer_without_steps_remote(namespace, server_factory):  # noqa: F811
    name, host_ip, ns_ip = namespace
    server = server_factory(config=ServerConfig(host=host_ip, api_key="k"))
    got = probe_routes(name, server.base, "k", ROUTES)
    for method, path in ROUTES:
        keyed, bare = got[f"key {method} {path}"], got[f"nokey {method} {path}"]
        if path in KEYLESS:
            assert keyed[0] == bare[0] == KEYLESS[path]
            continue
        assert bare[0] == 401, (method, path, bare)
        if (method, path) not in STEP_ROUTES:  # /metrics, the OpenAI routes: the key is enough
            assert keyed[0] not in (401, 403) and keyed[0] < 500, (method, path, keyed)
            continue
        assert keyed[0] == 403, (method, path, keyed)
        if method != "HEAD":
            assert ns_ip in keyed[1]["error"] and "steps_remote" in keyed[1]["error"]


def test_every_route_serves_a_real_remote_peer_with_the_key_only(namespace, server_factory):  # noqa: F811
    name, host_ip, _ = namespace
    config = ServerConfig(host=host_ip, api_key="k")
    server = server_factory(config=config, steps_remote=True)
    got = probe_routes(name, server.base, "k", ROUTES)
    for method, path in KEYED_ROUTES:
        keyed, bare = got[f"key {method} {path}"], got[f"nokey {method} {path}"]
        assert keyed[0] not in (401, 403) and keyed[0] < 500, (method, path, keyed)
        assert bare[0] == 401, (method, path, bare)
        if method != "HEAD":
            assert bare[1]["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("method, path", KEYED_ROUTES)
def test_the_key_guards_every_route_on_loopback_too(server_factory, method, path):
    server = server_factory(config=ServerConfig(api_key="sesame"))
    url = server.base + path
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "sesam"}):
        r = server.session.request(method, url, headers={**headers, "X-Gmlx-Steps-Contract": "1.0"})
        assert r.status_code == 401, (headers, r.status_code)
    for headers in ({"Authorization": "Bearer sesame"}, {"X-API-Key": "sesame"}):
        r = server.session.request(method, url, headers={**headers, "X-Gmlx-Steps-Contract": "1.0"})
        assert r.status_code not in (401, 403) and r.status_code < 500, (headers, r.status_code)


def test_fake_remote_peers_on_every_route(live):
    """The same gates through Falcon's test client, where any peer address can be claimed."""
    closed = client_for(live, host="0.0.0.0", api_key="k")
    remote = client_for(live, steps_remote=True, host="0.0.0.0", api_key="k")
    auth = {"Authorization": "Bearer k", "X-Gmlx-Steps-Contract": "1.0"}
    for method, path in KEYED_ROUTES:
        step_route = (method, path) in STEP_ROUTES
        for peer in ("192.0.2.7", "::ffff:10.0.0.1", "fe80::1%eth0", ""):
            r = closed.simulate_request(method, path, headers=auth, remote_addr=peer or None)
            if not peer:
                r = closed.simulate_request(method, path, headers=auth, extras={"REMOTE_ADDR": ""})
            if step_route:
                assert r.status_code == 403, (method, path, peer)
            else:  # the OpenAI routes serve any peer with the key
                assert r.status_code not in (401, 403) and r.status_code < 500, (method, path)
        r = remote.simulate_request(method, path, headers=auth, remote_addr="192.0.2.7")
        assert r.status_code not in (401, 403) and r.status_code < 500, (method, path)


# ---------------------------------------------------------------- adapters/register


def adapter_file(path: Path) -> Path:
    path.write_bytes(wire.write_container({"lora_A": np.ones((2, 3), np.float32)}))
    return path


@pytest.fixture
def folders(fresh, tmp_path):
    """A model folder with an adapter file, an outside file and the links that try to escape."""
    root = fresh.ctx.registry.model_dirs[0]
    inside = adapter_file(root / "alpha" / "style.safetensors")
    outside = adapter_file(tmp_path / "secret.safetensors")
    (root / "alpha" / "escape.safetensors").symlink_to(outside)
    (root / "alpha" / "up").symlink_to(tmp_path, target_is_directory=True)
    (root / "alpha" / "same.safetensors").symlink_to(inside)
    os.mkfifo(root / "alpha" / "pipe.safetensors")
    return fresh, root, inside, outside


def register(server, path):
    return server.post_json("adapters/register", {"path": path})


def test_a_file_inside_a_model_folder_registers(folders):
    server, root, inside, _ = folders
    r = register(server, str(inside))
    assert r.status_code == 200 and set(r.json()["tensors"]) == {"lora_A"}
    r = register(server, str(root / "alpha" / "same.safetensors"))  # a link that stays inside
    assert r.status_code == 200


def test_escapes_from_the_model_folders_are_refused(folders, tmp_path):
    server, root, _, outside = folders
    attempts = [
        str(outside),
        str(root / "alpha" / ".." / ".." / outside.name),
        str(root / "alpha" / "escape.safetensors"),
        str(root / "alpha" / "up" / outside.name),
        f"{root}/../{outside.name}",
        os.path.relpath(outside),
        "~/../../" + str(outside).lstrip("/"),
        "/etc/passwd",
        "/proc/self/environ",
        "/dev/zero",
        str(root / "alpha"),  # a folder
        str(root / "alpha" / "pipe.safetensors"),  # a FIFO: never opened (would block)
        str(root / "alpha" / "missing.safetensors"),
    ]
    for path in attempts:
        r = register(server, path)
        assert r.status_code == 404, (path, r.status_code, r.text)
        assert str(outside.read_bytes()[:8]) not in r.text
    for bad in ["", None, 5, ["x"], "a\x00b"]:
        r = register(server, bad)
        assert r.status_code == 400, (bad, r.status_code, r.text)
    assert len(server.ctx.service.adapters) == 0


def test_a_link_swapped_after_the_check_cannot_escape(folders):
    """The route opens the resolved path, so a link pointing elsewhere later reads the file the
    check saw (or fails), never the outside one."""
    server, root, inside, outside = folders
    link = root / "alpha" / "swap.safetensors"
    link.symlink_to(inside)
    r = register(server, str(link))
    assert r.status_code == 200
    link.unlink()
    link.symlink_to(outside)
    r = register(server, str(link))
    assert r.status_code == 404
