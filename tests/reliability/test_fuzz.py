"""Hostile input: the container reader directly, then every route of a live server.

Properties: the reader either returns a container equal to what was written or refuses with a
400 `WireError` (never another exception); a route never answers 5xx, every refusal is a JSON
error body, and the image worker is alive and serving afterwards.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import requests
from gmlx_contract import wire
from gmlx_contract.errors import WireError
from gmlx_contract.hashing import tensor_hash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ..server.conftest import CONTAINER, VERSION, start_server
from .strategies import (
    arrays,
    deep,
    hostile_containers,
    json_values,
    valid_containers,
)

QUICK = settings(max_examples=60, deadline=None, database=None)
# The long runs' inputs per test: 3,000, or GMLX_FUZZ_EXAMPLES (docs/reliability.md's run of
# a million hostile containers set it to 1000000).
HEAVY = settings(
    max_examples=int(os.environ.get("GMLX_FUZZ_EXAMPLES", "3000")),
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
ROUTE_QUICK = settings(
    max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)

CONTAINER_ROUTES = [
    ("POST", "step"),
    ("POST", "vae/decode"),
    ("POST", "vae/encode"),
    ("POST", "encode"),
    ("PUT", "tensors/" + "0" * 64),
    ("PUT", "adapters/" + "0" * 64),
]
JSON_ROUTES = [
    ("POST", "models/load"),
    ("POST", "models/unload"),
    ("POST", "encode"),
    ("POST", "adapters/register"),
    ("PUT", "patch-tables/" + "0" * 64),
    ("POST", "runs/begin"),
    ("POST", "runs/0123456789abcdef/end"),
    ("POST", "interrupt"),
]


# ---------------------------------------------------------------- the reader


@QUICK
@given(valid_containers())
def test_reader_round_trips_what_the_writer_wrote(made):
    body, tensors, dtypes, fields = made
    got = wire.read_container(body)
    assert got.fields == fields
    assert got.dtypes == dtypes
    for name, array in tensors.items():
        assert got.tensors[name].shape == array.shape
        assert bytes(got.raw(name)) == np.ascontiguousarray(array).tobytes()


def reader_refuses_cleanly(body: bytes) -> None:
    try:
        wire.read_container(body)
    except WireError as error:
        assert error.status == 400 and error.message
    # any other exception fails the test


@QUICK
@given(hostile_containers())
def test_reader_refuses_hostile_containers_with_400(body):
    reader_refuses_cleanly(body)


@pytest.mark.heavy
@HEAVY
@given(hostile_containers())
def test_reader_long_run(body):
    reader_refuses_cleanly(body)


# ---------------------------------------------------------------- a live server


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A server of its own (fuzzed runs/begin calls fill its run slots); after the module its
    worker must be alive and a plain step must still give the right answer."""
    server = start_server(tmp_path_factory.mktemp("fuzz"))
    yield server
    assert_still_serving(server)
    server.close()


def assert_still_serving(server) -> None:
    assert server.ctx.service.worker.alive
    for run in list(server.ctx.service._runs):
        server.ctx.service.end_run(run)
    cond = np.full((1, 3, 8), 0.5, np.float32)
    digest = server.put_tensor(cond)
    x = np.ones((1, 4, 2, 2), np.float32)
    r = server.post_container(
        "step", {"x": x, "timestep": np.array([0.5], np.float32)}, {"rows": [{"cond": digest}]}
    )
    assert r.status_code == 200, r.text
    from ..server import linear_family

    out = wire.read_container(r.content).tensors["out"]
    assert np.array_equal(out[0], linear_family.row_output(x[0], 0.5, cond[0]))


def refusal_is_clean(r: requests.Response) -> None:
    """Not a 5xx; a refusal carries a JSON error body."""
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400 and r.request.method != "HEAD":
        body = r.json()
        assert "error" in body, body


def send(server, method: str, path: str, body: bytes, content_type: str) -> requests.Response:
    headers = {**VERSION, "Content-Type": content_type}
    return server.session.request(
        method, f"{server.url}/{path}", data=body, headers=headers, timeout=60
    )


@ROUTE_QUICK
@given(route=st.sampled_from(CONTAINER_ROUTES), body=hostile_containers())
def test_hostile_containers_on_every_tensor_route(target, route, body):
    r = send(target, *route, body, wire.CONTAINER_TYPE)
    refusal_is_clean(r)
    assert r.status_code in (400, 409, 413), r.text


@ROUTE_QUICK
@given(
    route=st.sampled_from(JSON_ROUTES),
    body=st.one_of(
        json_values.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=64),
        st.integers(900, 100_000).map(lambda d: deep(d).encode()),
        st.integers(900, 100_000).map(lambda d: ('{"model":' + deep(d) + "}").encode()),
        st.dictionaries(
            st.sampled_from(["model", "run", "path", "text", "images", "refs", "entries"]),
            json_values,
        ).map(lambda v: json.dumps(v).encode()),
    ),
    content_type=st.sampled_from(["application/json", "text/plain", wire.CONTAINER_TYPE]),
)
def test_hostile_json_on_every_json_route(target, route, body, content_type):
    r = send(target, *route, body, content_type)
    refusal_is_clean(r)
    if route[1] == "runs/begin" and r.status_code == 200:
        target.call("POST", f"runs/{r.json()['run']}/end")


@st.composite
def step_requests(draw):
    """Structurally plausible steps with adversarial tensors and fields."""
    rows = draw(st.integers(1, 3))
    dtype, x = draw(arrays(max_dims=5, max_side=4))
    if draw(st.booleans()):  # usually the right rank and batch
        side = draw(st.sampled_from([0, 1, 2, 3, 600]))
        x = np.zeros((rows, 4, 1 if side == 600 else 2, side), np.float32)
        dtype = "F32"
    t_dtype, timestep = draw(arrays(max_dims=2, max_side=3))
    row = st.fixed_dictionaries(
        {"cond": st.sampled_from(["good", "0" * 64, 5, None, ""])},
        optional={
            "num_tokens": json_values | st.integers(-2, 5),
            "attention_mask": json_values,
            "ref_latents": json_values | st.just(["good"]),
            "image_slots": json_values | st.lists(st.integers(-1, 5), max_size=3),
            "prefix_cache": json_values,
        },
    )
    fields = draw(
        st.fixed_dictionaries(
            {"rows": st.lists(row, min_size=rows, max_size=rows) | json_values},
            optional={
                "run": json_values | st.just("0123456789abcdef"),
                "convention": st.sampled_from(["comfy", "reference", "other", 1, None]),
                "patch_table": json_values,
                "ref_cache": json_values,
                "skip": json_values | st.lists(st.integers(-1, 3), max_size=3),
                "model": st.sampled_from(["alpha", "beta", "broken", "stranger", "nope", 3]),
                "dry_run": json_values,
            },
        )
    )
    tensors = {"x": (dtype, x), "timestep": (t_dtype, timestep)}
    if draw(st.booleans()):  # a schedule, which only a flow map reads
        tensors["sample_sigmas"] = draw(arrays(max_dims=2, max_side=4))
    return tensors, fields


@ROUTE_QUICK
@given(step_requests())
def test_adversarial_steps(target, request):
    tensors, fields = request
    good = target.put_tensor(np.full((1, 3, 8), 0.25, np.float32))
    for row in fields.get("rows") if isinstance(fields.get("rows"), list) else ():
        if isinstance(row, dict):
            for key in ("cond", "attention_mask"):
                if row.get(key) == "good":
                    row[key] = good
            if row.get("ref_latents") == ["good"]:
                row["ref_latents"] = [good]
    body = wire.write_container(
        {name: array for name, (_, array) in tensors.items()},
        fields,
        {name: dtype for name, (dtype, _) in tensors.items()},
    )
    r = send(target, "POST", "step", body, wire.CONTAINER_TYPE)
    refusal_is_clean(r)
    if r.status_code == 200 and r.headers["Content-Type"].startswith("application/json"):
        assert r.json()["dry_run"] is True  # a dry run's plan
    elif r.status_code == 200:
        out = wire.read_container(r.content).tensors["out"]
        assert out.shape == tensors["x"][1].shape


@ROUTE_QUICK
@given(made=arrays(), honest=st.booleans(), kind=st.sampled_from(["tensors", "adapters"]))
def test_uploads_store_only_verified_hashes(target, made, honest, kind):
    dtype, array = made
    digest = tensor_hash(array, dtype) if honest else "f" * 64
    body = wire.write_container({"t": array}, None, {"t": dtype})
    r = target.call("PUT", f"{kind}/{digest}", data=body, headers=CONTAINER)
    refusal_is_clean(r)
    held = target.call("HEAD", f"{kind}/{digest}").status_code == 200
    if honest:
        assert r.status_code == 200 and held
    else:
        assert r.status_code == 400 and r.json()["got"] == tensor_hash(array, dtype)
        assert not held


@ROUTE_QUICK
@given(
    latents=arrays(max_dims=5, max_side=6),
    fields=st.dictionaries(st.sampled_from(["model", "alpha"]), json_values, max_size=2),
    route=st.sampled_from([("vae/decode", "latents"), ("vae/encode", "image")]),
)
def test_adversarial_vae_passes(target, latents, fields, route):
    dtype, array = latents
    path, name = route
    body = wire.write_container({name: array}, fields, {name: dtype})
    r = send(target, "POST", path, body, wire.CONTAINER_TYPE)
    refusal_is_clean(r)


@pytest.mark.heavy
@HEAVY
@given(route=st.sampled_from(CONTAINER_ROUTES), body=hostile_containers())
def test_long_run_of_hostile_containers(target, route, body):
    r = send(target, *route, body, wire.CONTAINER_TYPE)
    refusal_is_clean(r)


@pytest.mark.heavy
@HEAVY
@given(step_requests())
def test_long_run_of_adversarial_steps(target, request):
    test_adversarial_steps.hypothesis.inner_test(target, request)


# ---------------------------------------------------------------- the real model's edges


def served_embedded(tmp_path_factory, family: str, text: str):
    """The embedded model of `family` (its module under engine/families), served, with the
    encoding of `text` as `server.cond`; after the module its worker must be alive."""
    from gmlx_server.config import ServerConfig
    from gmlx_server.engine.registry import ModelRegistry

    from ..server.conftest import serve

    embedded = pytest.importorskip(f"gmlx_server.engine.families.{family}.embedded")
    folder = embedded.ensure_embedded_model(tmp_path_factory.mktemp(f"embedded_{family}"))
    server = serve(
        ServerConfig(host="127.0.0.1", port=0),
        ModelRegistry([], folder.name, extra_models=[folder]),
    )
    reply = server.post_json("encode", {"text": text})
    assert reply.status_code == 200
    server.cond = wire.read_container(reply.content).fields["cond"]
    yield server
    assert server.ctx.service.worker.alive
    server.close()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    yield from served_embedded(tmp_path_factory, "qwen_image21", "\x00")


EDGE_STEPS = [
    ((1, 64, 0, 0), 0.5),
    ((1, 64, 0, 2), 0.5),
    ((1, 64, 1, 3), 0.5),
    ((1, 63, 2, 2), 0.5),
    ((1, 64, 2, 2), float("nan")),
    ((1, 64, 2, 2), float("inf")),
    ((1, 64, 2, 2), -1e30),
]
EDGE_VAE = [
    ("vae/decode", "latents", (1, 64, 0, 0)),
    ("vae/decode", "latents", (1, 16, 2, 2)),
    ("vae/encode", "image", (1, 0, 0, 3)),
    ("vae/encode", "image", (1, 15, 17, 4)),
    ("vae/encode", "image", (1, 32, 32, 0)),
]


@pytest.mark.parametrize("shape, t", EDGE_STEPS)
def test_edge_steps_on_the_embedded_model(qwen, shape, t):
    tensors = {"x": np.zeros(shape, np.float32), "timestep": np.array([t], np.float32)}
    r = qwen.post_container("step", tensors, {"rows": [{"cond": qwen.cond}]})
    refusal_is_clean(r)


@pytest.mark.parametrize("path, name, shape", EDGE_VAE)
def test_edge_vae_passes_on_the_embedded_model(qwen, path, name, shape):
    r = qwen.post_container(path, {name: np.zeros(shape, np.float32)})
    refusal_is_clean(r)
    assert r.status_code == 400


@pytest.fixture(scope="module")
def flux3(tmp_path_factory):
    """The embedded FLUX.3 klein (a flow map: its steps read `sample_sigmas`), served."""
    yield from served_embedded(tmp_path_factory, "flux3_klein", "a fox")


@ROUTE_QUICK
@given(sigmas=arrays(max_dims=3, max_side=5), t=st.floats(allow_nan=True, allow_infinity=True))
def test_adversarial_sample_sigmas_on_a_flow_map(flux3, sigmas, t):
    """Any dtype and shape of `sample_sigmas` (NaN, infinities, one value, none), at any
    timestep: a step answered (the jump's target from the schedule) or refused 400, no 5xx."""
    dtype, array = sigmas
    tensors = {"x": np.zeros((1, 128, 2, 2), np.float32), "timestep": np.float32([t])}
    dtypes = {"x": "F32", "timestep": "F32", "sample_sigmas": dtype}
    body = wire.write_container(
        {**tensors, "sample_sigmas": array}, {"rows": [{"cond": flux3.cond}]}, dtypes
    )
    r = send(flux3, "POST", "step", body, wire.CONTAINER_TYPE)
    refusal_is_clean(r)
    if r.status_code == 200:
        assert wire.read_container(r.content).tensors["out"].shape == (1, 128, 2, 2)


@pytest.fixture(scope="module")
def moss(tmp_path_factory):
    """The embedded MOSS-Image (its steps take `skip`: 24 blocks), served."""
    yield from served_embedded(tmp_path_factory, "moss_image", "a sign")


SKIPS = (
    json_values
    | st.lists(st.integers(-30, 30), max_size=30)
    | st.lists(st.integers(0, 23), max_size=30)
    | st.lists(st.integers(-(2**70), 2**70) | st.booleans() | st.floats(), max_size=3)
)


@ROUTE_QUICK
@given(skip=SKIPS, t=st.floats(allow_nan=True, allow_infinity=True), rows=st.integers(1, 3))
def test_adversarial_skip_on_a_dit_that_skips(moss, skip, t, rows):
    """Any `skip` (every JSON kind; indices in and out of range, repeated, huge, booleans,
    floats; every block at once) at any timestep on rows of two lengths: answered, every row's
    output of the shape of x, or refused 400, no 5xx."""
    x = np.zeros((rows, 128, 2, 2), np.float32)
    short = moss.put_tensor(np.full((1, 3, 32), 0.25, np.float32))
    row_list = [{"cond": moss.cond if i % 2 == 0 else short} for i in range(rows)]
    body = wire.write_container(
        {"x": x, "timestep": np.full(rows, t, np.float32)}, {"rows": row_list, "skip": skip}
    )
    r = send(moss, "POST", "step", body, wire.CONTAINER_TYPE)
    refusal_is_clean(r)
    if r.status_code == 200:
        assert wire.read_container(r.content).tensors["out"].shape == x.shape


@pytest.mark.heavy
@HEAVY
@given(skip=SKIPS, t=st.floats(allow_nan=True, allow_infinity=True), rows=st.integers(1, 3))
def test_long_run_of_adversarial_skip(moss, skip, t, rows):
    test_adversarial_skip_on_a_dit_that_skips.hypothesis.inner_test(moss, skip, t, rows)
