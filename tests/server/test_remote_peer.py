"""Peers that are not loopback (docs/contract.md §4).

For real: a network namespace joined to this one by a veth pair gives a second address on this
machine; a server bound to the host side is called from inside the namespace. That needs root
and `ip netns`; where they are missing the test says so and skips. The gates are also checked
with a fake peer address through Falcon's test client, which needs neither.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from falcon import testing
from gmlx_server.app import create_app
from gmlx_server.config import ServerConfig

PROBE = """
import json, sys, requests
base, key = sys.argv[1], sys.argv[2]
auth = {"Authorization": "Bearer " + key}
out = {}
for name, path, headers in [
    ("health", "/health", {}),
    ("caps_key", "/internal/image-steps/v1/capabilities", auth),
    ("caps_nokey", "/internal/image-steps/v1/capabilities", {}),
]:
    r = requests.get(base + path, headers=headers, timeout=10)
    out[name] = [r.status_code, r.json()]
print(json.dumps(out))
"""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@pytest.fixture(scope="module")
def namespace():
    """(namespace name, host-side address, namespace-side address), or a skip with the reason."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a network namespace; the fake-peer tests cover the gates")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's `ip` to make a network namespace")
    tag = os.getpid() % 10000
    name, host_if, ns_if = f"gmlx{tag}", f"gh{tag}", f"gn{tag}"
    subnet = f"10.213.{tag % 250}"
    host_ip, ns_ip = f"{subnet}.1", f"{subnet}.2"
    try:
        _ip("netns", "add", name)
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", name)
        _ip("addr", "add", f"{host_ip}/24", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("netns", "exec", name, "ip", "addr", "add", f"{ns_ip}/24", "dev", ns_if)
        _ip("netns", "exec", name, "ip", "link", "set", ns_if, "up")
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, OSError) as exc:
        _ip("link", "del", host_if, check=False)
        _ip("netns", "del", name, check=False)
        detail = getattr(exc, "stderr", "") or exc
        pytest.skip(f"cannot make a network namespace here ({detail}); fake-peer tests only")
    yield name, host_ip, ns_ip
    _ip("link", "del", host_if, check=False)
    _ip("netns", "del", name, check=False)


def probe_from(namespace_name: str, base: str, key: str) -> dict:
    result = subprocess.run(
        ["ip", "netns", "exec", namespace_name, sys.executable, "-c", PROBE, base, key],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_a_real_remote_peer_is_refused_without_steps_remote(namespace, server_factory):
    name, host_ip, ns_ip = namespace
    server = server_factory(config=ServerConfig(host=host_ip, api_key="k"))
    got = probe_from(name, server.base, "k")
    assert got["health"][0] == 200
    status, body = got["caps_key"]
    assert status == 403 and isinstance(body["error"], str)
    assert ns_ip in body["error"] and "steps_remote" in body["error"]
    status, body = got["caps_nokey"]
    assert status == 401 and body["error"]["type"] == "authentication_error"


def test_a_real_remote_peer_is_served_with_steps_remote(namespace, server_factory):
    name, host_ip, _ = namespace
    server = server_factory(config=ServerConfig(host=host_ip, api_key="k"), steps_remote=True)
    got = probe_from(name, server.base, "k")
    assert got["caps_key"][0] == 200 and got["caps_key"][1]["contract"]["major"] == 1
    assert got["caps_nokey"][0] == 401


# ---------------------------------------------------------------- fake peers


def client_for(server, steps_remote: bool = False, **config) -> testing.TestClient:
    """A test client of an app over the live server's registry and service, with other
    settings (no socket: the peer address is whatever the test says)."""
    settings = ServerConfig(**config)
    settings.image.steps_remote = steps_remote
    ctx = type(server.ctx)(
        config=settings, registry=server.ctx.registry, service=server.ctx.service
    )
    return testing.TestClient(create_app(ctx), headers={"Host": "localhost"})


CAPS = "/internal/image-steps/v1/capabilities"


def test_loopback_bind_refuses_other_peers_in_the_nested_shape(live):
    client = client_for(live, host="127.0.0.1")
    r = client.simulate_get(CAPS, remote_addr="10.1.2.3")
    assert r.status_code == 403 and r.json["error"]["type"] == "permission_error"
    assert "10.1.2.3" in r.json["error"]["message"]
    r = client.simulate_get("/health", extras={"REMOTE_ADDR": ""})  # unknown peer
    assert r.status_code == 403
    for peer in ("127.0.0.1", "::1", "::ffff:127.0.0.1"):
        assert client.simulate_get(CAPS, remote_addr=peer).status_code == 200


def test_the_step_gate_on_a_public_bind(live):
    client = client_for(live, host="0.0.0.0", api_key="k")
    auth = {"Authorization": "Bearer k"}
    r = client.simulate_get(CAPS, remote_addr="192.0.2.7", headers=auth)
    assert r.status_code == 403 and isinstance(r.json["error"], str)
    assert "192.0.2.7" in r.json["error"] and "steps_remote" in r.json["error"]
    r = client.simulate_get(CAPS, extras={"REMOTE_ADDR": ""}, headers=auth)
    assert r.status_code == 403
    assert (
        client.simulate_get(CAPS, remote_addr="::ffff:127.0.0.1", headers=auth).status_code == 200
    )
    assert client.simulate_get("/health", remote_addr="192.0.2.7").status_code == 200
    remote = client_for(live, steps_remote=True, host="0.0.0.0", api_key="k")
    assert remote.simulate_get(CAPS, remote_addr="192.0.2.7", headers=auth).status_code == 200
    assert remote.simulate_get(CAPS, remote_addr="192.0.2.7").status_code == 401
