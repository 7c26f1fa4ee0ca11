"""The step bodies' copy-free paths: the gate takes Waitress' request buffer as it is, and
container answers leave as a stream over the bytes written (no copy into Waitress' buffer)."""

from __future__ import annotations

import io

import falcon
import falcon.testing
import numpy as np
from gmlx_contract import wire
from gmlx_server.app import whole_body
from gmlx_server.routes.common import send_container


def request(body: bytes, **env) -> falcon.Request:
    return falcon.Request(falcon.testing.create_environ(method="POST", body=body, **env))


def test_whole_body_is_the_buffer_itself():
    body = bytes(range(256)) * 64
    req = request(b"")
    req.env["wsgi.input"] = stream = io.BytesIO(body)
    req.env["CONTENT_LENGTH"] = str(len(body))
    got = whole_body(falcon.Request(req.env))
    assert got is body  # no copy
    assert stream.read() == b""  # consumed, as a read would leave it


def test_whole_body_falls_back_when_it_cannot_be_sure():
    assert whole_body(request(b"abc", headers={"Content-Length": "2"})) is None
    req = request(b"abc")
    req.env["wsgi.input"].read(1)
    assert whole_body(req) is None  # someone read already
    req = request(b"abc")
    del req.env["CONTENT_LENGTH"]
    assert whole_body(falcon.Request(req.env)) is None  # no length: read it the slow way
    assert whole_body(request(b"abc")) == b"abc"


def test_container_answer_is_a_stream_over_the_same_bytes():
    body = wire.write_container({"out": np.arange(6, dtype=np.float32)})
    resp = falcon.Response()
    send_container(resp, body)
    assert resp.data is None and int(resp.content_length) == len(body)
    assert resp.content_type == wire.CONTAINER_TYPE
    assert resp.stream.read(len(body)) is body  # what Waitress' file wrapper sends
