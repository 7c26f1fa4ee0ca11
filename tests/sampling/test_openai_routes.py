"""The OpenAI image routes on a real server (loopback port) with the deterministic test model."""

import base64
import io
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import pytest
import requests
from gmlx_server.engine.registry import ModelRegistry
from gmlx_server.engine.sampling import ImageRequest, generate, to_uint8
from gmlx_server.model_choice import ModelChoice
from gmlx_server.step_server import StepServer
from PIL import Image

from . import toy_family


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with toy_server(toy_family.make_folder(tmp_path_factory.mktemp("models"))) as running:
        yield running


@pytest.fixture(scope="module")
def turbo_server(tmp_path_factory):
    """A server whose default samples its fixed 3-step schedule only."""
    root = tmp_path_factory.mktemp("turbo")
    with toy_server(toy_family.make_folder(root, sigmas=[1.0, 0.75, 0.5, 0.0])) as running:
        yield running


@contextmanager
def toy_server(folder):
    registry = ModelRegistry(
        extra_models=[folder], default_model=folder.name, families={"toy": toy_family.TOY}
    )
    with StepServer(ModelChoice(registry, folder.name, 0.0)) as running:
        running.load()
        yield running


def png_pixels(b64: str) -> np.ndarray:
    with Image.open(io.BytesIO(base64.b64decode(b64))) as image:
        assert image.format == "PNG"
        return np.asarray(image.convert("RGB"))


def png_file(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def post(server, path, **kwargs):
    return requests.post(server.base_url + path, timeout=60, **kwargs)


def direct_pixels(server, request):
    status = server.loaded.model.status()
    transport = server.direct()
    latents, _ = generate(transport, status, request)
    return to_uint8(transport.decode(latents))


def test_generation_answers_the_openai_shape_and_equals_direct(server):
    doc = {"prompt": "a green hill", "size": "64x32", "n": 2, "seed": 11, "steps": 3, "cfg": 2.0}
    resp = post(server, "/v1/images/generations", json=doc)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert set(body) == {"created", "data", "output_format", "size"}
    assert isinstance(body["created"], int) and body["size"] == "64x32"
    assert len(body["data"]) == 2 and set(body["data"][0]) == {"b64_json"}
    first, second = (png_pixels(item["b64_json"]) for item in body["data"])
    assert first.shape == (32, 64, 3)
    assert not np.array_equal(first, second)  # seeds 11 and 12
    request = ImageRequest(prompt="a green hill", width=64, height=32, seed=11, steps=3, cfg=2.0)
    np.testing.assert_array_equal(first, direct_pixels(server, request))


def test_generation_refusals(server):
    cases = [
        ({"prompt": "x", "response_format": "link"}, 400, "response_format"),
        ({"prompt": "x", "response_format": "url", "stream": True}, 400, "response_format"),
        ({"prompt": "x", "stream": "yes"}, 400, "stream"),
        ({"prompt": "x", "stream": True, "partial_images": 4}, 400, "partial_images"),
        ({"prompt": "x", "size": "32x32", "strength": 0.5}, 400, "strength"),
        ({"prompt": "x", "size": "2064x2048"}, 413, "size"),
        ({"prompt": "x", "size": "4112x16"}, 413, "size"),
        ({"prompt": "x", "size": "100x100"}, 400, "size"),
        ({"prompt": "x", "size": "big"}, 400, "size"),
        ({"prompt": "", "size": "32x32"}, 400, "prompt"),
        ({"size": "32x32"}, 400, "prompt"),
        ({"prompt": "x", "n": 11}, 400, "n"),
        ({"prompt": "x", "steps": 0}, 400, "steps"),
        ({"prompt": "x", "model": "no-such-model", "size": "32x32"}, 404, "model"),
        ({"prompt": "x", "size": "32x32", "sampler": "dpmpp_2m"}, 400, "sampler"),
        # a JSON body's fields are JSON values of their type (a form's text is converted)
        ({"prompt": "x", "size": "32x32", "n": "2"}, 400, "n"),
        ({"prompt": "x", "size": " 32x32"}, 400, "size"),
        ({"prompt": "x", "size": "32x32", "model": 5}, 400, "model"),
        ({"prompt": "x", "size": "32x32", "response_format": ""}, 400, "response_format"),
        ({"prompt": "x", "size": "32x32", "output_format": ["png"]}, 400, "output_format"),
        ({"prompt": "x", "size": "32x32", "cfg": 2.0, "guidance": "high"}, 400, "guidance"),
        ({"prompt": "x", "size": "32x32", "cfg": 10**400}, 400, "cfg"),
        # a malformed field is refused 400 whatever the size (413 only for a well-formed job)
        ({"size": "4096x4096"}, 400, "prompt"),
        ({"prompt": "x", "size": "4096x4096", "n": 0}, 400, "n"),
        ({"prompt": "x", "size": "4096x4096", "model": 5}, 400, "model"),
    ]
    for doc, status, param in cases:
        resp = post(server, "/v1/images/generations", json=doc)
        assert resp.status_code == status, (doc, resp.text)
        error = resp.json()["error"]
        assert isinstance(error["message"], str) and error["param"] == param, doc


def test_refused_settings_are_named_by_their_request_field(turbo_server):
    """The sampler's refusals name the field the request sent (not the command line's flags)."""
    doc = {"prompt": "x", "size": "32x32"}
    fixed = post(turbo_server, "/v1/images/generations", json={**doc, "steps": 5})
    assert fixed.status_code == 400, fixed.text
    error = fixed.json()["error"]
    assert error["param"] == "steps"
    assert error["message"].endswith("fixed 3-step schedule; leave steps out or set it to 3")
    assert "--" not in error["message"]
    assert post(turbo_server, "/v1/images/generations", json={**doc, "steps": 3}).status_code == 200


def test_generation_with_uni_pc_bh2_equals_direct(server):
    doc = {"prompt": "a barn", "size": "48x32", "seed": 2, "steps": 4, "sampler": "uni_pc_bh2"}
    resp = post(server, "/v1/images/generations", json=doc)
    assert resp.status_code == 200, resp.text
    got = png_pixels(resp.json()["data"][0]["b64_json"])
    request = ImageRequest(
        prompt="a barn", width=48, height=32, seed=2, steps=4, sampler="uni_pc_bh2"
    )
    np.testing.assert_array_equal(got, direct_pixels(server, request))
    assert not np.array_equal(got, direct_pixels(server, replace(request, sampler="euler")))

    one_step = post(server, "/v1/images/generations", json={**doc, "steps": 1})
    assert one_step.status_code == 400
    assert "uni_pc_bh2 needs at least 2 steps" in one_step.json()["error"]["message"]


def test_edit_multipart_and_json_agree(server):
    image = png_file(48, 32, 3)
    fields = {"prompt": "make it blue", "seed": "5", "steps": "2", "size": "48x32"}
    multipart = post(server, "/v1/images/edits", data=fields, files={"image": ("a.png", image)})
    assert multipart.status_code == 200, multipart.text
    uri = "data:image/png;base64," + base64.b64encode(image).decode()
    as_json = post(
        server, "/v1/images/edits", json={**fields, "seed": 5, "steps": 2, "images": [uri]}
    )
    assert as_json.status_code == 200, as_json.text
    a = png_pixels(multipart.json()["data"][0]["b64_json"])
    b = png_pixels(as_json.json()["data"][0]["b64_json"])
    np.testing.assert_array_equal(a, b)
    plain = post(server, "/v1/images/generations", json={**fields, "seed": 5, "steps": 2})
    assert not np.array_equal(a, png_pixels(plain.json()["data"][0]["b64_json"]))


def test_too_many_images_are_refused_before_any_is_decoded(server):
    """A small file may hold a large image: eleven parts (of junk, which a decode would refuse
    first) are counted before any is decoded, in both forms, as is a variation's second."""
    junk = [("image[]", (f"{i}.png", b"not an image")) for i in range(11)]
    multipart = post(server, "/v1/images/edits", data={"prompt": "x"}, files=junk)
    assert multipart.status_code == 400, multipart.text
    assert multipart.json()["error"]["message"] == "at most 10 images"
    as_json = post(server, "/v1/images/edits", json={"prompt": "x", "images": ["AAAA"] * 11})
    assert as_json.status_code == 400 and as_json.json()["error"]["message"] == "at most 10 images"
    two = post(server, "/v1/images/variations", files=junk[:2])
    assert two.status_code == 400
    assert two.json()["error"]["message"] == "a variation takes exactly one image"


def test_edit_auto_size_and_refusals(server):
    image = png_file(40, 72, 4)  # auto size: 32x64 (down to multiples of 16)
    resp = post(
        server,
        "/v1/images/edits",
        data={"prompt": "x", "steps": "1"},
        files={"image": ("a.png", image)},
    )
    assert resp.status_code == 200, resp.text
    assert png_pixels(resp.json()["data"][0]["b64_json"]).shape == (64, 32, 3)
    no_image = post(server, "/v1/images/edits", json={"prompt": "x"})
    assert no_image.status_code == 400 and no_image.json()["error"]["param"] == "image"
    masked = post(
        server,
        "/v1/images/edits",
        data={"prompt": "x"},
        files={"image": ("a.png", image), "mask": ("m.png", png_file(40, 64, 4))},
    )
    assert masked.status_code == 400 and masked.json()["error"]["param"] == "mask"
    assert "the mask is 40x64 but the init image is 40x72" in masked.json()["error"]["message"]
    for strength in ("0", "1e-9", "1.5", "nan"):  # 1e-9 would evaluate 10^9 steps to keep 1
        weak = post(
            server,
            "/v1/images/edits",
            data={"prompt": "x", "steps": "1", "strength": strength},
            files={"image": ("a.png", image)},
        )
        assert weak.status_code == 400 and weak.json()["error"]["param"] == "strength", weak.text
    remote = post(
        server, "/v1/images/edits", json={"prompt": "x", "image": "https://example.com/a.png"}
    )
    assert remote.status_code == 400
    not_base64 = post(server, "/v1/images/edits", json={"prompt": "x", "images": ["%%"]})
    error = not_base64.json()["error"]
    assert not_base64.status_code == 400 and error["param"] == "images"
    assert error["message"] == "images[0] is not standard base64 (nor a base64 data URI)"
    garbage = post(
        server,
        "/v1/images/edits",
        data={"prompt": "x"},
        files={"image": ("a.png", b"not an image")},
    )
    assert garbage.status_code == 400


def test_a_body_that_is_not_json_is_refused_in_openais_shape(server):
    """The front gate's refusal, as an OpenAI client reads errors: param and code present, no
    word of the step routes' tensor containers."""
    headers = {"Content-Type": "application/json"}
    resp = post(server, "/v1/images/generations", data=b"prompt=x", headers=headers)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error == {
        "message": "the request body is not JSON",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }


@pytest.mark.parametrize(
    ("height", "width", "size"),
    [
        (72, 40, (32, 64)),  # down to multiples of 16
        (3000, 4000, (2352, 1760)),  # a photo over 2048x2048 pixels, its aspect kept
        (600, 9000, (4096, 272)),  # a side over 4096
        (8, 4000, (1024, 1024)),  # a side under 16 once within the limits: the default
    ],
)
def test_an_edits_auto_size_is_its_images_within_the_limits(height, width, size):
    from gmlx_server.openai import edit_size

    assert edit_size(np.zeros((height, width, 3), np.uint8)) == size


def test_image_jobs_at_once_leave_threads_for_the_step_routes(tmp_path, monkeypatch):
    """With 3 threads one image samples at a time: a second is refused 429 with a Retry-After
    (the openai client's cue to wait and send again) while health checks are still answered,
    and is taken once the first is done."""
    import threading
    import types

    from gmlx_server import openai
    from gmlx_server.config import ServerConfig

    from tests.server.conftest import serve

    folder = toy_family.make_folder(tmp_path / "models")
    registry = ModelRegistry(
        extra_models=[folder], default_model=folder.name, families={"toy": toy_family.TOY}
    )
    entered, release = threading.Event(), threading.Event()
    one_image = openai.ImageRoute.one_image

    def held(self, *args, **kwargs):
        entered.set()
        release.wait(30)
        return one_image(self, *args, **kwargs)

    monkeypatch.setattr(openai.ImageRoute, "one_image", held)
    live = serve(ServerConfig(host="127.0.0.1", threads=3), registry)
    server = types.SimpleNamespace(base_url=live.base)
    try:
        job = {"prompt": "x", "size": "64x64", "steps": 2}
        first: dict = {}
        sampling = threading.Thread(
            target=lambda: first.update(answer=post(server, "/v1/images/generations", json=job))
        )
        sampling.start()
        assert entered.wait(30)
        refused = post(server, "/v1/images/generations", json=job)
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "2"
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
        assert requests.get(server.base_url + "/health?ready=1", timeout=5).status_code == 200
        release.set()
        sampling.join(30)
        assert first["answer"].status_code == 200
        assert post(server, "/v1/images/generations", json=job).status_code == 200
    finally:
        release.set()
        live.close()


def test_images_are_counted_with_their_time_and_how_they_ended(server):
    """/metrics counts the OpenAI routes' images by family and outcome, with their seconds."""
    from prometheus_client.parser import text_string_to_metric_families

    def samples() -> dict:
        text = requests.get(server.base_url + "/metrics", timeout=30).text
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    done = ("gmlx_images_total", (("family", "toy"), ("outcome", "done")))
    timed = ("gmlx_image_seconds_count", (("family", "toy"),))
    before = samples()
    job = {"prompt": "x", "size": "64x64", "steps": 2, "n": 2}
    assert post(server, "/v1/images/generations", json=job).status_code == 200
    after = samples()
    assert after[done] - before.get(done, 0) == 2
    assert after[timed] - before.get(timed, 0) == 2
