"""The front gates and error shapes: version header, JSON and size gates, API key, host guard,
steps_api, unknown paths, and 500s that leave the worker alive (docs/contract.md §1.2, 1.9, 4)."""

from __future__ import annotations

import socket

import numpy as np
import pytest
import requests
from gmlx_contract import wire
from gmlx_server.config import ServerConfig

from .conftest import CONTAINER, VERSION


def nested(r: requests.Response) -> dict:
    body = r.json()
    assert isinstance(body["error"], dict), body
    assert set(body["error"]) >= {"type", "message"}
    return body["error"]


def flat(r: requests.Response) -> str:
    body = r.json()
    assert isinstance(body["error"], str), body
    return body["error"]


def test_health_and_capabilities_need_no_header(live):
    r = live.session.get(live.base + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    for query in ("", "?ready=1"):  # a load balancer's check by HEAD: the status, no body
        head = live.session.head(live.base + "/health" + query, timeout=10)
        assert head.status_code == 200 and head.content == b"", query
    r = live.call("GET", "capabilities", versioned=False)
    assert r.status_code == 200
    doc = r.json()
    assert doc["contract"] == {"major": 1, "minor": 0}
    assert doc["min_client"] == {"major": 1, "minor": 0}
    assert doc["gmlx_version"] == "0.1.0"
    assert doc["wire"] == {"container": "safetensors", "dtypes": ["f32", "f16", "bf16", "u8"]}
    assert doc["families"] == ["test_linear"]
    assert doc["conventions"] == ["comfy", "reference"]
    assert doc["patch_kinds"] == ["lora"]
    assert "ref_cache" not in doc["features"] and "prefix_cache" in doc["features"]
    assert doc["limits"] == {
        "max_tensor_bytes": 64 << 20,
        "max_adapter_bytes": 256 << 20,
        "max_rows": 16,
        "max_runs": 32,
    }
    assert "X-Gmlx-Steps-Contract" not in r.headers


def test_missing_header_names_no_side(live):
    r = live.call("GET", "models", versioned=False)
    assert r.status_code == 400
    text = flat(r)
    assert "X-Gmlx-Steps-Contract" in text and "1.0" in text and "upgrade" not in text


@pytest.mark.parametrize(
    "value, side",
    [("2.0", "gmlx server"), ("0.9", "client")],
)
def test_other_majors_name_the_side_to_upgrade(live, value, side):
    r = live.call("GET", "models", headers={"X-Gmlx-Steps-Contract": value})
    assert r.status_code == 400
    text = flat(r)
    assert "step contract" in text and value in text and "1.0" in text
    assert text.endswith(f"upgrade the {side}")


@pytest.mark.parametrize("value", ["x", "1.x", "", "1.0.0"])
def test_malformed_header(live, value):
    r = live.call("GET", "models", headers={"X-Gmlx-Steps-Contract": value})
    assert r.status_code == 400
    assert "MAJOR.MINOR" in flat(r)


@pytest.mark.parametrize("value", ["1.0", "1.5", "1 ", "1"])
def test_major_one_is_accepted(live, value):
    r = live.call("GET", "models", headers={"X-Gmlx-Steps-Contract": value})
    assert r.status_code == 200


def test_unknown_paths_and_methods_are_nested(live):
    r = live.call("GET", "no-such-route")
    assert r.status_code == 404 and nested(r)["message"] == "Not Found"
    r = live.session.get(live.base + "/elsewhere", timeout=10)
    assert r.status_code == 404 and nested(r)["message"] == "Not Found"
    r = live.call("GET", "step")
    assert r.status_code == 405
    nested(r)


def test_json_gate_refuses_non_json_in_the_nested_shape(live):
    r = live.call("POST", "runs/begin", data=b"{not json", headers={"Content-Type": "text/plain"})
    assert r.status_code == 400 and nested(r)["type"] == "invalid_request_error"
    # A tensor body under the wrong content type never reaches the route's 415.
    body = wire.write_container({"x": np.zeros(2, np.float32)})
    r = live.call("POST", "step", data=body, headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 400
    nested(r)


def test_route_415_for_valid_json_sent_to_a_tensor_route(live):
    r = live.call("POST", "step", json={"rows": []})
    assert r.status_code == 415
    assert wire.CONTAINER_TYPE in flat(r)


def test_json_routes_take_empty_bodies_and_refuse_non_objects(live):
    r = live.call("POST", "interrupt", data=b"")
    assert r.status_code == 200 and r.json() == {"interrupted": 0}
    r = live.call("POST", "interrupt", json=[1, 2])
    assert r.status_code == 400 and "object" in flat(r)


@pytest.mark.parametrize("depth", [wire.MAX_JSON_DEPTH + 1, 900, 5000])
def test_json_nested_too_deeply_is_400_before_any_route(live, depth):
    """A patch table nested hundreds of levels deep parses, but hashing it would overflow
    Python's recursion limit: the gate refuses it as not JSON, and the server goes on."""
    body = ('{"model":' * depth + "1" + "}" * depth).encode()
    digest = "0" * 64
    headers = {"Content-Type": "application/json"}
    r = live.call("PUT", f"patch-tables/{digest}", data=body, headers=headers)
    assert r.status_code == 400, r.text
    assert nested(r)["type"] == "invalid_request_error"
    r = live.call("POST", "interrupt", data=b"{}", headers=headers)
    assert r.status_code == 200


def test_json_body_over_64_mib_is_413_nested(live):
    body = b" " * (wire.MAX_JSON_BYTES + 1)
    r = live.call("POST", "interrupt", data=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert nested(r)["type"] == "request_too_large"


def test_body_over_the_container_limit_is_refused_before_it_is_sent(live):
    """Content-Length over 1 GiB + 1 MiB: refused 413 without the body ever being sent."""
    host, port = live.base.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        head = (
            f"POST /internal/image-steps/v1/step HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: {wire.CONTAINER_TYPE}\r\nX-Gmlx-Steps-Contract: 1.0\r\n"
            f"Content-Length: {wire.MAX_CONTAINER_BYTES + 1}\r\n\r\n"
        )
        sock.sendall(head.encode())
        answer = sock.recv(4096).decode("latin-1")
    assert answer.startswith("HTTP/1.1 413"), answer


@pytest.mark.parametrize("coding", ["0", "gzip", "gzip, chunked", "identity"])
def test_a_transfer_coding_it_does_not_read_is_400_nested(live, coding):
    """Waitress reads chunked alone and would answer 501; the request is what is wrong."""
    r = live.call("GET", "models", headers={**VERSION, "Transfer-Encoding": coding})
    assert r.status_code == 400
    assert "Transfer-Encoding" in nested(r)["message"]
    assert live.call("GET", "models", headers=VERSION).ok


def test_a_crashing_model_gives_500_and_the_worker_goes_on(fresh):
    cond = fresh.put_tensor(np.ones((1, 2, 8), np.float32))
    tensors = {"x": np.zeros((1, 4, 2, 2), np.float32), "timestep": np.zeros(1, np.float32)}
    fields = {"rows": [{"cond": cond}]}
    assert fresh.post_container("step", tensors, fields).status_code == 200
    fresh.model().crash_next = True
    r = fresh.post_container("step", tensors, fields)
    assert r.status_code == 500
    assert flat(r) == "internal error in POST /internal/image-steps/v1/step: RuntimeError"
    assert fresh.ctx.service.worker.alive
    assert fresh.post_container("step", tensors, fields).status_code == 200


def test_steps_api_off_removes_every_route(server_factory):
    server = server_factory(steps_api=False)
    for method, path in [("GET", "capabilities"), ("POST", "step"), ("GET", "models")]:
        r = server.call(method, path)
        assert r.status_code == 404
        assert nested(r)["message"] == "Not Found"
    assert server.session.get(server.base + "/health", timeout=10).status_code == 200


def test_api_key(server_factory):
    server = server_factory(config=ServerConfig(api_key="sesame"))
    r = server.call("GET", "capabilities", versioned=False)
    assert r.status_code == 401 and nested(r)["type"] == "authentication_error"
    r = server.call("GET", "models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    r = server.call("GET", "models", headers={"Authorization": "Bearer sesame"})
    assert r.status_code == 200
    r = server.call("GET", "models", headers={"x-api-key": "sesame"})
    assert r.status_code == 200
    # The key gate comes before the version gate.
    r = server.call("GET", "models", versioned=False)
    assert r.status_code == 401
    assert server.session.get(server.base + "/health", timeout=10).status_code == 200


def test_loopback_server_refuses_foreign_host_headers(live):
    r = live.call("GET", "capabilities", headers={"Host": "evil.example"})
    assert r.status_code == 403 and nested(r)["type"] == "permission_error"
    for host in ("localhost:8080", "127.0.0.1", "[::1]:80"):
        assert live.call("GET", "models", headers={"Host": host}).status_code == 200


def test_requests_are_logged(live, caplog):
    caplog.set_level("INFO", logger="gmlx.server")
    live.call("GET", "models", headers=VERSION)
    lines = [r.getMessage() for r in caplog.records if "/models" in r.getMessage()]
    assert any(line.startswith("GET /internal/image-steps/v1/models 200 ") for line in lines)


def test_container_type_with_parameters_is_accepted(live):
    digest_body = wire.write_container({"t": np.ones(3, np.float32)})
    from gmlx_contract.hashing import tensor_hash

    digest = tensor_hash(np.ones(3, np.float32))
    headers = {"Content-Type": CONTAINER["Content-Type"] + "; charset=binary"}
    r = live.call("PUT", f"tensors/{digest}", data=digest_body, headers=headers)
    assert r.status_code == 200 and r.json() == {"hash": digest}


def test_a_path_with_control_characters_writes_one_log_line(caplog):
    """The request log escapes the decoded path: `%0A` cannot forge a line of its own."""
    import logging
    import time

    from gmlx_server.http_gate import log_request

    with caplog.at_level(logging.INFO, logger="gmlx.server"):
        log_request(
            "POST",
            "/runs/abc\n2026-12-05 INFO gmlx.server: FORGED\x00/end",
            200,
            time.perf_counter(),
        )
    (line,) = [r.getMessage() for r in caplog.records]
    assert "\n" not in line and "\x00" not in line
    assert line.startswith("POST /runs/abc\\n2026-12-05 INFO gmlx.server: FORGED\\x00/end 200 ")


def test_a_json_body_nested_too_deep_is_told_so(live):
    body = "[" * 70 + "]" * 70
    r = live.call("POST", "models/load", data=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "nests deeper than 64 levels" in r.text, r.text
    r = live.call("POST", "models/load", data="{", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not JSON: Expecting property name" in r.text, r.text


def test_the_log_names_a_peer_from_another_machine(caplog):
    """A request from another machine (a server bound beyond loopback) is logged with its
    address, so that its 401s can be traced; a local one is not."""
    import logging
    import time

    from gmlx_server.http_gate import log_request

    with caplog.at_level(logging.INFO, logger="gmlx.server"):
        for peer in ("192.0.2.7", "127.0.0.1", "::1", None):
            log_request("GET", "/metrics", 401, time.perf_counter(), peer)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].endswith(" ms from 192.0.2.7")
    assert not any("from" in line for line in lines[1:]), lines
