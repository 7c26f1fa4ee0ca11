"""StepClient against a tiny in-test HTTP server (docs/contract.md §7.2, §7.5-7.7)."""

import json
import socket

import numpy as np
import pytest
from gmlx_contract.client import StepClient, client_gmlx_version
from gmlx_contract.errors import ContractMismatch, NotGmlxServer, StepError
from gmlx_contract.hashing import canonical_json, table_id, tensor_hash
from gmlx_contract.version import HEADER
from gmlx_contract.wire import CONTAINER_TYPE, read_container

from .stepserver import Answer, FakeStepServer, json_answer

KEY = "sekrit"


@pytest.fixture
def server():
    fake = FakeStepServer(api_key=KEY).start()
    yield fake
    fake.stop()


@pytest.fixture
def client(server):
    with StepClient(server.url, api_key=KEY) as step_client:
        yield step_client


def free_port_url():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def cond_tensor(seed, length=3):
    return np.random.default_rng(seed).standard_normal((1, length, 4)).astype(np.float32)


# ---------------------------------------------------------------- handshake


def test_handshake_checks_health_then_capabilities(server, client):
    caps = client.handshake()
    assert caps["contract"] == {"major": 1, "minor": 0}
    assert [(s.method, s.path) for s in server.seen] == [
        ("GET", "/health"),
        ("GET", "capabilities"),
    ]
    for seen in server.seen:
        assert seen.headers["authorization"] == f"Bearer {KEY}"
        assert HEADER.lower() not in seen.headers


def test_handshake_with_nothing_listening_is_not_a_gmlx_server():
    with pytest.raises(NotGmlxServer, match="no gmlx server answers"):
        StepClient(free_port_url()).handshake()


def test_nothing_listening_is_one_sentence_without_retry_noise(caplog):
    url = free_port_url()
    with caplog.at_level("DEBUG", logger="urllib3"), pytest.raises(NotGmlxServer) as caught:
        StepClient(url).handshake()
    assert str(caught.value) == f"gmlx: no gmlx server answers at {url} (connection refused)"
    assert caught.value.reason == "connection refused"
    assert not [r for r in caplog.records if "Retrying" in r.getMessage()]


def test_a_call_that_gets_no_answer_names_route_server_reason_and_remedy():
    url = free_port_url()
    with pytest.raises(StepError) as caught:
        StepClient(url).models()
    text = str(caught.value)
    assert text == (
        f"gmlx: GET models got no answer from the gmlx server at {url} (connection refused); "
        "check that it runs there (`gmlx serve` starts one)"
    )


def test_refusals_name_the_server(server):
    with StepClient(server.url, api_key="wrong") as wrong, pytest.raises(StepError) as caught:
        wrong.models()
    text = str(caught.value)
    assert text.startswith(f"gmlx: GET models at {server.url} failed with status 401: ")
    assert text.count("gmlx:") == 1 and "GMLX_API_KEY" in text


def test_health_not_200_is_not_a_gmlx_server(server, client):
    server.overrides[("GET", "/health")] = json_answer(404, {"detail": "Not Found"})
    with pytest.raises(NotGmlxServer) as caught:
        client.handshake()
    assert str(caught.value) == (
        f"gmlx: no gmlx server answers at {server.url} (GET /health answered status 404: "
        "not a gmlx image server)"
    )
    assert client.health() is False


def test_capabilities_404_is_not_a_gmlx_server(server, client):
    server.overrides[("GET", "capabilities")] = json_answer(404, {"detail": "Not Found"})
    with pytest.raises(NotGmlxServer) as caught:
        client.handshake()
    assert caught.value.status == 404


@pytest.mark.parametrize(
    "body",
    [
        b"[1, 2]",
        b"<html>",
        b'{"contract": {"major": "1", "minor": 0}}',
        b'{"contract": {"major": 1, "minor": 0}, "min_client": [1, 0]}',
        b'{"contract": {"major": true, "minor": 0}}',
    ],
)
def test_malformed_capabilities_are_not_a_gmlx_server(server, client, body):
    server.overrides[("GET", "capabilities")] = Answer(200, body)
    with pytest.raises(NotGmlxServer):
        client.handshake()


def test_newer_major_names_the_client_side(server, client):
    server.capabilities = {
        "contract": {"major": 2, "minor": 0},
        "min_client": {"major": 2, "minor": 0},
        "gmlx_version": "9.9.9",
    }
    with pytest.raises(ContractMismatch) as caught:
        client.handshake()
    text = str(caught.value)
    assert text.startswith("gmlx:")
    assert "step contract 2.0" in text and "step contract 1.0" in text
    assert "9.9.9" in text and client_gmlx_version() in text
    assert "client is the side to upgrade" in text and "reinstall the gmlx nodes" in text


@pytest.mark.parametrize(
    "caps",
    [
        {"contract": {"major": 0, "minor": 9}},
        {"gmlx_version": "0.0.1"},  # no contract at all counts as major -1
    ],
)
def test_older_server_names_the_server_side(server, client, caps):
    server.capabilities = caps
    with pytest.raises(ContractMismatch) as caught:
        client.handshake()
    assert "gmlx server is the side to upgrade" in str(caught.value)


def test_min_client_above_ours_names_the_client(server, client):
    server.capabilities["contract"] = {"major": 1, "minor": 4}
    server.capabilities["min_client"] = {"major": 1, "minor": 2}
    with pytest.raises(ContractMismatch, match="client is the side to upgrade"):
        client.handshake()


def test_newer_minor_is_compatible_and_other_gmlx_version_only_warns(server, client):
    server.capabilities["contract"] = {"major": 1, "minor": 7}
    server.capabilities["gmlx_version"] = "7.0.0"
    client.handshake()
    assert len(client.warnings) == 1 and "7.0.0" in client.warnings[0]


def test_wrong_key_is_a_401_error_asking_for_the_key(server):
    with StepClient(server.url, api_key="wrong") as wrong:
        with pytest.raises(StepError) as caught:
            wrong.handshake()
    assert not isinstance(caught.value, NotGmlxServer)
    assert caught.value.status == 401
    assert '"invalid API key"' in str(caught.value) and "API key" in str(caught.value)


def test_403_tells_to_run_locally_or_enable_remote(server, client):
    server.overrides[("GET", "capabilities")] = json_answer(403, {"error": "peer 10.0.0.2"})
    with pytest.raises(StepError) as caught:
        client.handshake()
    assert caught.value.status == 403
    assert "steps_remote" in str(caught.value) and "peer 10.0.0.2" in str(caught.value)


# ---------------------------------------------------------------- transport


def test_versioned_routes_carry_the_header_and_key_on_one_connection(server, client):
    client.models()
    client.status("org/model x")
    client.has_tensor("0" * 64)
    client.put_tensor(cond_tensor(0))
    run = client.begin_run("m")
    assert client.end_run(run) is True
    assert client.interrupt(run) == 1
    assert client.interrupt(None) == 0
    for seen in server.seen:
        assert seen.headers[HEADER.lower()] == "1.0"
        assert seen.headers["authorization"] == f"Bearer {KEY}"
    assert server.seen[1].path == "models/org%2Fmodel%20x/status"
    assert len({seen.port for seen in server.seen}) == 1  # keep-alive: one connection


def test_non_json_error_body_is_quoted_up_to_300_bytes(server, client):
    server.overrides[("GET", "models")] = Answer(502, b"<html>" + b"y" * 600, "text/html")
    with pytest.raises(StepError) as caught:
        client.models()
    text = str(caught.value)
    assert text.startswith("gmlx:") and "502" in text
    assert "<html>" + "y" * 294 + '"' in text


def test_put_tensor_is_verified_and_known(server, client):
    cond = cond_tensor(1)
    digest = client.put_tensor(cond)
    assert digest == tensor_hash(cond)
    assert digest in server.tensors and digest in client.known
    assert client.has_tensor(digest) is True
    client.forget_known()
    assert client.known == set()


def test_ensure_adapter_heads_before_putting(server, client):
    up = np.ones((4, 2), np.float32)
    digest = client.ensure_adapter(up)
    assert [s.method for s in server.seen] == ["HEAD", "PUT"]
    assert client.ensure_adapter(up) == digest
    assert [s.method for s in server.seen] == ["HEAD", "PUT", "HEAD"]


# ---------------------------------------------------------------- step


def step_rows(*conds):
    return [{"cond": tensor_hash(c), "num_tokens": c.shape[1]} for c in conds]


def test_step_uploads_unknown_rows_without_head_and_parses_answer(server, client):
    pos, neg = cond_tensor(2), cond_tensor(3, length=5)
    x = np.random.default_rng(4).standard_normal((2, 4, 2, 2)).astype(np.float32)
    uploads = {tensor_hash(pos): pos, tensor_hash(neg): neg}
    answer = client.step(x, [0.5, 0.5], step_rows(pos, neg), model="m", run="r1", uploads=uploads)
    np.testing.assert_array_equal(answer.out, x * 2)
    assert answer.forward_ms == 12.34 and answer.server_ms == 15.0
    assert answer.prefix_cache == "miss" and answer.wall_ms > 0 and not answer.retried
    assert [s.method for s in server.seen] == ["PUT", "PUT", "POST"]
    sent = read_container(server.seen[-1].body)
    assert sent.dtypes == {"x": "F32", "timestep": "F32"}
    assert sent.fields == {
        "rows": step_rows(pos, neg),
        "convention": "comfy",
        "model": "m",
        "run": "r1",
    }
    assert server.seen[-1].headers["content-type"] == CONTAINER_TYPE

    client.step(x, [0.4, 0.4], step_rows(pos, neg), uploads=uploads)
    assert [s.method for s in server.seen][3:] == ["POST"]  # known tensors are not re-sent


def test_step_sends_optional_fields_and_sigmas_as_f32(server, client):
    cond = cond_tensor(5)
    x = np.zeros((1, 4, 2, 2), np.float64)
    client.step(
        x,
        np.float64(0.25),
        step_rows(cond),
        convention="reference",
        ref_cache=True,
        skip=[1, 2],
        sample_sigmas=[1.0, 0.5, 0.0],
        uploads={tensor_hash(cond): cond},
    )
    sent = read_container(server.seen[-1].body)
    assert sent.dtypes == {"x": "F32", "timestep": "F32", "sample_sigmas": "F32"}
    assert sent.tensors["timestep"].shape == ()
    assert sent.fields["ref_cache"] is True and sent.fields["skip"] == [1, 2]
    assert sent.fields["convention"] == "reference"


def test_step_409_missing_uploads_and_retries_once(server, client):
    cond = cond_tensor(6)
    digest = client.put_tensor(cond)
    server.tensors.clear()  # the server evicted it; the client still believes it is held
    x = np.ones((1, 4, 2, 2), np.float32)
    answer = client.step(x, [1.0], step_rows(cond), uploads={digest: cond})
    assert answer.retried
    assert [(s.method, s.path) for s in server.seen[1:]] == [
        ("POST", "step"),
        ("PUT", f"tensors/{digest}"),
        ("POST", "step"),
    ]


def test_step_second_409_raises(server, client):
    cond = cond_tensor(7)
    digest = tensor_hash(cond)
    server.overrides[("POST", "step")] = json_answer(409, {"error": "gone", "missing": [digest]})
    with pytest.raises(StepError) as caught:
        client.step(
            np.ones((1, 4, 2, 2), np.float32), [1.0], step_rows(cond), uploads={digest: cond}
        )
    assert caught.value.status == 409 and caught.value.missing == [digest]
    assert len(server.requests_to("POST", "step")) == 2


def test_step_409_without_upload_raises_at_once(server, client):
    cond = cond_tensor(8)
    with pytest.raises(StepError, match="no upload for") as caught:
        client.step(np.ones((1, 4, 2, 2), np.float32), [1.0], step_rows(cond))
    assert caught.value.status == 409
    assert len(server.requests_to("POST", "step")) == 1


def test_step_409_interrupted_is_not_retried(server, client):
    server.overrides[("POST", "step")] = json_answer(
        409, {"error": "run r was interrupted", "code": "interrupted"}
    )
    with pytest.raises(StepError) as caught:
        client.step(np.ones((1, 4, 2, 2), np.float32), [1.0], [{"cond": "a" * 64}])
    assert caught.value.code == "interrupted"
    assert '"run r was interrupted"' in str(caught.value)
    assert len(server.requests_to("POST", "step")) == 1


def test_step_answer_that_is_not_a_container_is_an_error(server, client):
    server.overrides[("POST", "step")] = json_answer(200, {"out": []})
    with pytest.raises(StepError, match="instead of application/vnd.gmlx"):
        client.step(np.ones((1, 4, 2, 2), np.float32), [1.0], [{"cond": "a" * 64}])


# ---------------------------------------------------------------- patch tables


def lora_table(up, down):
    entry = {"key": "diffusion_model.blocks.0.attn.to_q.weight", "band": None}
    patch = {
        "up": tensor_hash(up),
        "down": tensor_hash(down),
        "alpha": 4.0,
        "strength": 1.0,
        "strength_model": 1.0,
    }
    return {"model": "m", "entries": [{**entry, "patches": [patch]}]}


def test_patch_table_409_uploads_adapters_and_re_puts_once(server, client):
    up, down = np.ones((8, 2), np.float32), np.full((2, 8), 0.5, np.float32)
    doc = lora_table(up, down)
    adapters = {tensor_hash(up): up, tensor_hash(down): down}
    digest = client.put_patch_table(doc, "m", adapters)
    assert digest == table_id(doc)
    puts = server.requests_to("PUT", f"patch-tables/{digest}")
    assert len(puts) == 2
    assert puts[0].body == canonical_json(doc)
    assert puts[0].query == {"model": ["m"]}
    assert server.adapters == set(adapters)


def test_patch_table_409_without_adapters_raises(server, client):
    doc = lora_table(np.ones((8, 2), np.float32), np.ones((2, 8), np.float32))
    with pytest.raises(StepError) as caught:
        client.put_patch_table(doc, "m")
    assert caught.value.status == 409 and len(caught.value.missing) == 2


def test_step_with_lost_table_redefines_it_and_forgets_known(server, client):
    up, down = np.ones((8, 2), np.float32), np.ones((2, 8), np.float32)
    doc = lora_table(up, down)
    digest = client.put_patch_table(doc, "m", {tensor_hash(up): up, tensor_hash(down): down})
    cond = cond_tensor(9)
    uploads = {tensor_hash(cond): cond}
    x = np.ones((1, 4, 2, 2), np.float32)
    client.step(x, [1.0], step_rows(cond), patch_table=digest, uploads=uploads)
    other = np.zeros(3, np.float32)
    client.known.add(tensor_hash(other))
    server.tables.clear()  # e.g. the model was reloaded
    server.adapters.clear()
    answer = client.step(x, [1.0], step_rows(cond), patch_table=digest, uploads=uploads)
    assert answer.retried
    assert tensor_hash(other) not in client.known  # everything believed uploaded was forgotten
    assert digest in server.tables


def test_the_tables_kept_to_define_again_are_the_latest_used(server, client):
    """A client keeps the last TABLES_KEPT tables defined or stepped on (each holds its
    matrices); the one a run steps on stays while newer ones come and go, and a step naming a
    table let go cannot define it again."""
    from gmlx_contract.client import TABLES_KEPT

    def defined(seed: int) -> str:
        up, down = np.full((8, 2), seed, np.float32), np.ones((2, 8), np.float32)
        return client.put_patch_table(
            lora_table(up, down), "m", {tensor_hash(up): up, tensor_hash(down): down}
        )

    cond = cond_tensor(9)
    uploads, x = {tensor_hash(cond): cond}, np.ones((1, 4, 2, 2), np.float32)
    active, first = defined(1), defined(2)
    for seed in range(3, TABLES_KEPT + 2):
        defined(seed)
        client.step(x, [1.0], step_rows(cond), patch_table=active, uploads=uploads)
    server.tables.clear()
    assert client.step(x, [1.0], step_rows(cond), patch_table=active, uploads=uploads).retried
    assert client.keeps_table(active) and not client.keeps_table(first)
    server.tables.clear()
    with pytest.raises(StepError, match="this call has no upload for " + first):
        client.step(x, [1.0], step_rows(cond), patch_table=first, uploads=uploads)


def test_a_table_forgotten_lets_its_matrices_go(server, client):
    """`forget_table`: the client no longer holds the table's matrices (nothing else does
    here, so they are freed) and no longer defines it again."""
    import gc
    import weakref

    up, down = np.full((8, 2), 5, np.float32), np.ones((2, 8), np.float32)
    digest = client.put_patch_table(
        lora_table(up, down), "m", {tensor_hash(up): up, tensor_hash(down): down}
    )
    held = weakref.ref(up)
    del up
    gc.collect()
    assert held() is not None and client.keeps_table(digest)
    client.forget_table(digest)
    gc.collect()
    assert held() is None and not client.keeps_table(digest)
    client.forget_table(digest)  # once more: nothing to let go


# ---------------------------------------------------------------- encode and VAE


def test_encode_json_and_container_forms(server, client):
    tensors, fields = client.encode("a cat", model="m")
    assert server.seen[-1].headers["content-type"] == "application/json"
    assert json.loads(server.seen[-1].body) == {"model": "m", "text": "a cat"}
    assert tensors["cond"].shape == (1, 5, 4)
    assert fields["cond"] in client.known

    image = np.zeros((32, 32, 3), np.uint8)
    tensors, fields = client.encode("edit", images=[image, image], refs=False)
    sent = read_container(server.seen[-1].body)
    assert list(sent.tensors) == ["image_0", "image_1"]
    assert sent.dtypes["image_0"] == "U8"
    assert sent.fields == {"text": "edit", "refs": False}
    assert fields["image_slots"] == [0, 0]
    with pytest.raises(ValueError, match="uint8"):
        client.encode("x", images=[np.zeros((4, 4, 3), np.float32)])


def test_vae_decode_round_trip(server, client):
    latents = np.arange(8, dtype=np.float32).reshape(1, 2, 2, 2)
    image = client.vae_decode(latents, model="m", alpha=True)
    np.testing.assert_array_equal(image, np.transpose(latents, (0, 2, 3, 1)))
    assert read_container(server.seen[-1].body).fields == {"alpha": True, "model": "m"}


def test_timeouts_per_route(server, client):
    seen_timeouts = {}
    request = client.session.request

    def recording(method, url, **kwargs):
        seen_timeouts[url.rsplit("/", 1)[1]] = kwargs["timeout"]
        return request(method, url, **kwargs)

    client.session.request = recording
    client.handshake()
    client.models()
    client.interrupt("r")
    assert seen_timeouts == {"health": 2.0, "capabilities": 30.0, "models": 600.0, "interrupt": 5.0}
    assert StepClient(server.url, timeout=42.0).timeout == 42.0


def test_steps_share_one_kept_connection_and_carry_key_and_header(server, client):
    cond = cond_tensor(6)
    x = np.ones((1, 4, 2, 2), np.float32)
    client.models()
    client.step(x, [0.5], step_rows(cond), uploads={tensor_hash(cond): cond})
    client.step(x, [0.5], step_rows(cond))
    assert [s.method for s in server.seen] == ["GET", "PUT", "POST", "POST"]
    for seen in server.seen:
        assert seen.headers[HEADER.lower()] == "1.0"
        assert seen.headers["authorization"] == f"Bearer {KEY}"
    steps = [seen for seen in server.seen if seen.path == "step"]
    assert len(steps) == 2 and steps[0].port == steps[1].port  # the steps' keep-alive connection
    assert steps[0].headers["content-length"] == str(len(steps[0].body))


def test_step_to_nothing_listening_is_a_step_error():
    with StepClient(free_port_url()) as client, pytest.raises(StepError, match="POST step"):
        client.step(np.ones((1, 4, 2, 2), np.float32), [0.5], [{"cond": "0" * 64}])


def test_step_goes_through_requests_when_a_proxy_or_tls_applies(monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    assert StepClient("http://192.0.2.1:8080")._step_link() is None
    monkeypatch.setenv("NO_PROXY", "192.0.2.1")
    assert StepClient("http://192.0.2.1:8080")._step_link() is not None
    assert StepClient("https://192.0.2.1:8080")._step_link() is None
    untrusting = StepClient("http://192.0.2.1:8080")
    untrusting.session.proxies = {"http": "http://proxy.invalid:3128"}
    assert untrusting._step_link() is None


# ---------------------------------------------------------------- error texts: one sentence each


def _text_of(call) -> str:
    with pytest.raises(StepError) as caught:
        call()
    text = str(caught.value)
    assert text.count("gmlx:") == 1 and "Pool(" not in text and "object at 0x" not in text
    return text


def test_handshake_error_texts_name_the_server_and_what_to_do(server, client):
    with StepClient(server.url, api_key="wrong") as wrong:
        text = _text_of(wrong.handshake)
    assert text.startswith(f"gmlx: GET capabilities at {server.url} failed with status 401: ")
    assert text.endswith("(set the gmlx API key (GMLX_API_KEY) to the server's server.api_key)")
    server.overrides[("GET", "capabilities")] = json_answer(404, {"detail": "Not Found"})
    assert _text_of(client.handshake) == (
        f"gmlx: no gmlx server answers at {server.url} (GET /internal/image-steps/v1/capabilities "
        "answered 404: not a gmlx image server, or one with server.image.steps_api off)"
    )
    server.overrides[("GET", "capabilities")] = Answer(200, b"[1, 2]")
    assert _text_of(client.handshake) == (
        f"gmlx: no gmlx server answers at {server.url} (its capabilities are not a JSON "
        "object: not a gmlx image server)"
    )


def test_step_error_texts_name_the_server(server, client):
    x, rows = np.ones((1, 4, 2, 2), np.float32), [{"cond": "a" * 64}]
    server.overrides[("POST", "step")] = json_answer(400, {"error": "rows[0] is bad"})
    assert _text_of(lambda: client.step(x, [1.0], rows)) == (
        f'gmlx: POST step at {server.url} failed with status 400: "rows[0] is bad"'
    )
    url = free_port_url()
    with StepClient(url) as gone:  # the server went away: the step's own connection
        assert _text_of(lambda: gone.step(x, [1.0], rows)) == (
            f"gmlx: POST step got no answer from the gmlx server at {url} (connection refused); "
            "check that it runs there (`gmlx serve` starts one)"
        )


def test_a_request_that_runs_out_of_time_says_the_server_may_still_be_working():
    """Not "check that it runs there": it answered nothing in time, and the hint says how to
    give it longer."""
    import socket

    from gmlx_contract.errors import NoAnswer

    listener = socket.create_server(("127.0.0.1", 0))  # accepts (backlog), never answers
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    client = StepClient(url, timeout=0.3, timeout_hint="set request_timeout_s")
    try:
        with pytest.raises(NoAnswer) as refused:
            client.step(np.zeros((1, 4, 2, 2), np.float32), [1.0], step_rows(cond_tensor(1)))
    finally:
        client.close()
        listener.close()
    assert refused.value.timed_out
    message = str(refused.value)
    assert "POST step got no answer" in message and "within 0.3 s: it may still be" in message
    assert message.endswith("; set request_timeout_s") and "check that it runs" not in message
