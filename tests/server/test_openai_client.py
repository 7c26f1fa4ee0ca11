"""The official `openai` Python client drives every OpenAI image route of a real server (loopback
port) on the embedded tiny models: generations, edits with and without a mask, variations,
`b64_json` and `url` answers, and `stream=True` with partial images. What the client parses is
compared with the in-process sampler's image of the same request, pixel for pixel."""

from __future__ import annotations

import base64
import io
from dataclasses import replace

import numpy as np
import pytest
import requests
from gmlx_server.engine.sampling import ImageRequest, generate, to_uint8
from gmlx_server.imagefiles import mask_of
from gmlx_server.memory import PlannedTransport
from gmlx_server.model_choice import ModelChoice
from gmlx_server.step_server import StepServer
from PIL import Image

openai = pytest.importorskip("openai")

Z_IMAGE = "z-image-random-tiny"  # takes no references: edits start from the image
KLEIN = "flux2-klein-random-tiny"  # takes references
FLUX3 = "flux3-klein-random-tiny"  # pads a lone reference to its canvas
SIZE = (96, 64)


@pytest.fixture(scope="module")
def server():
    """The two embedded models, both kept loaded (no reload between the tests' models)."""
    from gmlx_server.engine.registry import ModelRegistry, embedded_modules

    folders = [module.ensure_embedded_model() for module in embedded_modules()]
    registry = ModelRegistry(extra_models=folders, default_model=Z_IMAGE, max_resident=2)
    with StepServer(ModelChoice(registry, Z_IMAGE, 0.0)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def pixels_of(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"))


def init_picture() -> np.ndarray:
    rows, cols = np.mgrid[0 : SIZE[1], 0 : SIZE[0]]
    return np.stack([rows * 5, cols * 4, 255 - rows * 5], axis=-1).astype(np.uint8)


def alpha_mask() -> np.ndarray:
    """OpenAI's edit mask: opaque where kept, transparent where to paint."""
    mask = np.full((SIZE[1], SIZE[0], 4), 255, np.uint8)
    mask[8:40, 16:48, 3] = 0
    return mask


def in_process(server, model_id: str, request: ImageRequest) -> np.ndarray:
    loaded = server.service.acquire(model_id)
    try:
        service = server.service
        transport = PlannedTransport(
            loaded, service.memory, call=service.worker.call, table=loaded.default_table
        )
        status = loaded.model.status()
        latents, _ = generate(transport, status, request)
        return to_uint8(transport.decode(latents))
    finally:
        server.service.release(loaded)


def request_of(prompt: str, **settings) -> ImageRequest:
    return ImageRequest(prompt=prompt, width=SIZE[0], height=SIZE[1], **settings)


def test_generation_as_base64_and_as_a_url(server, client):
    args = {"prompt": "a lighthouse", "size": "96x64", "extra_body": {"seed": 3}}
    answer = client.images.generate(model=Z_IMAGE, **args)
    image = pixels_of(base64.b64decode(answer.data[0].b64_json))
    np.testing.assert_array_equal(
        image, in_process(server, Z_IMAGE, request_of("a lighthouse", seed=3))
    )
    linked = client.images.generate(model=Z_IMAGE, response_format="url", **args)
    url = linked.data[0].url
    assert url.startswith(server.base_url + "/v1/images/files/")
    fetched = requests.get(url, timeout=30)
    assert fetched.status_code == 200 and fetched.headers["Content-Type"] == "image/png"
    np.testing.assert_array_equal(pixels_of(fetched.content), image)


def test_an_image_larger_than_the_url_store_is_a_refusal_clients_do_not_send_again(
    server, client, monkeypatch
):
    """400, naming the setting and b64_json: OpenAI's clients send a 5xx again, and each try
    would sample the same image to the same end."""
    monkeypatch.setattr(server.service.image_store(), "max_bytes", 16)
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.generate(model=Z_IMAGE, prompt="x", size="96x64", response_format="url")
    error = refused.value.body
    assert error["param"] == "response_format" and "image_url_store_mb" in error["message"]
    assert "ask for response_format b64_json" in error["message"]


def test_an_edit_with_a_mask_inpaints_the_first_image(server, client):
    answer = client.images.edit(
        model=Z_IMAGE,
        image=("init.png", png(init_picture()), "image/png"),
        mask=("mask.png", png(alpha_mask()), "image/png"),
        prompt="a boat",
        size="96x64",
        extra_body={"seed": 4, "mask_blur": 2},
    )
    expected = request_of(
        "a boat", seed=4, init_image=init_picture(), mask=mask_of(alpha_mask()), mask_blur=2.0
    )
    got = pixels_of(base64.b64decode(answer.data[0].b64_json))
    np.testing.assert_array_equal(got, in_process(server, Z_IMAGE, expected))


@pytest.mark.heavy  # the same paths as the masked edit and the variations, one image each
def test_an_edit_without_a_mask_references_or_starts_from_its_image(server, client):
    image = ("init.png", png(init_picture()), "image/png")
    klein = client.images.edit(
        model=KLEIN, image=image, prompt="a boat", size="96x64", extra_body={"seed": 4}
    )
    referenced = request_of("a boat", seed=4, images=(init_picture(),))
    got = pixels_of(base64.b64decode(klein.data[0].b64_json))
    np.testing.assert_array_equal(got, in_process(server, KLEIN, referenced))
    started = client.images.edit(
        model=Z_IMAGE, image=image, prompt="a boat", size="96x64", extra_body={"seed": 4}
    )
    from_image = request_of("a boat", seed=4, init_image=init_picture(), strength=0.75)
    got = pixels_of(base64.b64decode(started.data[0].b64_json))
    np.testing.assert_array_equal(got, in_process(server, Z_IMAGE, from_image))
    stronger = client.images.edit(
        model=Z_IMAGE, image=image, prompt="a boat", extra_body={"seed": 4, "strength": 0.5}
    )
    got = pixels_of(base64.b64decode(stronger.data[0].b64_json))
    np.testing.assert_array_equal(
        got, in_process(server, Z_IMAGE, replace(from_image, strength=0.5))
    )


def test_a_reference_of_any_size_is_taken_as_the_pipeline_sizes_it(server, client):
    """A picture that is no multiple of the stride is center-cropped to one, as
    Flux2KleinPipeline does (engine/reference_images.py), streamed or not; one the pipeline
    refuses is refused before the stream begins."""
    photo = np.pad(init_picture(), ((3, 3), (2, 2), (0, 0)), mode="edge")  # 100x70
    image = ("photo.png", png(photo), "image/png")
    events = list(
        client.images.edit(
            model=KLEIN,
            image=image,
            prompt="a boat",
            size="96x64",
            stream=True,
            extra_body={"seed": 4, "steps": 2},
        )
    )
    cropped = request_of("a boat", seed=4, steps=2, images=(init_picture(),))
    got = pixels_of(base64.b64decode(events[-1].b64_json))
    np.testing.assert_array_equal(got, in_process(server, KLEIN, cropped))
    tiny = ("tiny.png", png(init_picture()[:40, :40]), "image/png")
    with pytest.raises(openai.BadRequestError) as refused:
        list(client.images.edit(model=KLEIN, image=tiny, prompt="x", stream=True))
    assert "reference image 0 is 40x40" in refused.value.message


def test_a_lone_padded_reference_at_auto_size_is_answered_at_its_own_size(server, client):
    """FLUX.3 klein pads a lone 100x70 reference to its 112x80 canvas; at size "auto" the
    canvas is sampled and every picture, previews too, cropped back to the reference."""
    photo = np.pad(init_picture(), ((3, 3), (2, 2), (0, 0)), mode="edge")  # 100x70
    events = list(
        client.images.edit(
            model=FLUX3,
            image=("photo.png", png(photo), "image/png"),
            prompt="a boat",
            stream=True,
            partial_images=1,
            extra_body={"seed": 4, "steps": 2},
        )
    )
    assert [event.size for event in events] == ["100x70", "100x70"]
    pictures = [pixels_of(base64.b64decode(event.b64_json)) for event in events]
    assert [picture.shape for picture in pictures] == [(70, 100, 3)] * 2
    canvas = replace(request_of("a boat", seed=4, steps=2, images=(photo,)), width=112, height=80)
    np.testing.assert_array_equal(pictures[-1], in_process(server, FLUX3, canvas)[5:75, 6:106])


@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")  # the client's variations
# A model that takes references (klein) also gets the image as one: with -m heavy, as the
# unmasked edits that reference it.
@pytest.mark.parametrize(
    ("model_id", "count"), [(Z_IMAGE, 2), pytest.param(KLEIN, 1, marks=pytest.mark.heavy)]
)
def test_a_variation_is_an_image_to_image_of_its_picture(server, client, model_id, count):
    answer = client.images.create_variation(
        model=model_id,
        image=("init.png", png(init_picture()), "image/png"),
        n=count,
        extra_body={"seed": 8},
    )
    assert len(answer.data) == count
    references = (init_picture(),) if model_id == KLEIN else ()
    expected = request_of(
        "", seed=7 + count, init_image=init_picture(), strength=0.75, images=references
    )
    got = pixels_of(base64.b64decode(answer.data[-1].b64_json))
    np.testing.assert_array_equal(got, in_process(server, model_id, expected))


def test_streamed_images_arrive_with_their_partial_images(server, client):
    events = list(
        client.images.generate(
            model=Z_IMAGE,
            prompt="a lighthouse",
            size="96x64",
            stream=True,
            partial_images=2,
            extra_body={"seed": 3, "steps": 6},
        )
    )
    kinds = [event.type for event in events]
    assert kinds == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [event.partial_image_index for event in events[:2]] == [0, 1]
    for event in events[:2]:
        assert pixels_of(base64.b64decode(event.b64_json)).shape == (64, 96, 3)
    final = pixels_of(base64.b64decode(events[-1].b64_json))
    np.testing.assert_array_equal(
        final, in_process(server, Z_IMAGE, request_of("a lighthouse", seed=3, steps=6))
    )
    edits = list(
        client.images.edit(
            model=Z_IMAGE,
            image=("init.png", png(init_picture()), "image/png"),
            mask=("mask.png", png(alpha_mask()), "image/png"),
            prompt="a boat",
            stream=True,
            partial_images=1,
            extra_body={"seed": 4, "steps": 4},
        )
    )
    assert [event.type for event in edits] == ["image_edit.partial_image", "image_edit.completed"]


def test_refusals_reach_the_client_as_its_errors(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.generate(model=Z_IMAGE, prompt="x", size="60x48")
    assert "multiples of 16" in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.edit(
            model=Z_IMAGE,
            image=[("a.png", png(init_picture()), "image/png")] * 2,
            prompt="x",
        )
    assert "takes no reference images" in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.edit(
            model=Z_IMAGE,
            image=("init.png", png(init_picture()), "image/png"),
            mask=("mask.png", png(alpha_mask()[:32]), "image/png"),
            prompt="x",
        )
    assert "the mask is 96x32 but the init image is 96x64" in refused.value.message
    with pytest.raises(openai.NotFoundError):
        client.images.generate(model="no-such-model", prompt="x")


def test_the_models_list_names_the_models_a_client_may_ask_for(server, client):
    """`client.models.list()` parses the list; each id it names generates."""
    models = {model.id: model for model in client.models.list()}
    assert {Z_IMAGE, KLEIN} <= set(models)
    assert models[KLEIN].owned_by == "gmlx" and models[KLEIN].created > 0
    registry = server.service.registry
    assert set(models) == {e.model_id for e in registry.entries() if e.family is not None}


def test_an_expired_or_made_up_image_url_is_not_found(server):
    for name in ("0" * 32 + ".png", "../../etc/passwd", "x.png"):
        answer = requests.get(server.base_url + "/v1/images/files/" + name, timeout=30)
        assert answer.status_code == 404
        assert answer.json()["error"]["type"] == "not_found_error"


def test_a_stream_whose_client_goes_away_stops_and_lets_the_model_go(server):
    """A client that reads the first preview and hangs up: the sampling stops at its next step
    and the model's hold is released (nothing is left held or running)."""
    import json
    import time

    body = {"model": Z_IMAGE, "prompt": "x", "size": "96x64", "stream": True, "steps": 80}
    body["partial_images"] = 3
    with requests.post(
        server.base_url + "/v1/images/generations", json=body, stream=True, timeout=60
    ) as answer:
        assert answer.status_code == 200
        assert answer.headers["Content-Type"].startswith("text/event-stream")
        lines = answer.iter_lines()
        assert next(lines) == b"event: image_generation.partial_image"
        assert json.loads(next(lines).removeprefix(b"data: "))["partial_image_index"] == 0
    registry = server.service.registry
    deadline = time.monotonic() + 30
    while registry.holds(Z_IMAGE) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert registry.holds(Z_IMAGE) == 0
    # and the server serves the next request at once
    quick = {"model": Z_IMAGE, "prompt": "x", "size": "96x64", "steps": 1}
    started = time.monotonic()
    assert requests.post(server.base_url + "/v1/images/generations", json=quick, timeout=60).ok
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("stream", [False, True])
def test_a_job_whose_client_goes_away_stops_and_lets_the_model_go(server, stream):
    """A client that sends a long job (ten images of 1,000 steps, minutes of work) and closes
    its connection stops the sampling at its next step, and the model's hold is released,
    long before the job would have ended: an answer not streamed, and one streamed with no
    partial images, of which no event is written before the first image is done."""
    import json
    import socket
    import time

    body = {"model": Z_IMAGE, "prompt": "x", "size": "96x64", "steps": 1000, "n": 10}
    data = json.dumps({**body, "stream": stream}).encode()
    host, port = server.base_url.removeprefix("http://").split(":")
    head = (
        f"POST /v1/images/generations HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    registry = server.service.registry
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode() + data)
        deadline = time.monotonic() + 30
        while not registry.holds(Z_IMAGE) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert registry.holds(Z_IMAGE), "the job never started"
        time.sleep(0.5)  # some steps under way
    gone = time.monotonic()
    while registry.holds(Z_IMAGE) and time.monotonic() < gone + 30:
        time.sleep(0.05)
    assert registry.holds(Z_IMAGE) == 0
    assert time.monotonic() - gone < 10
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(server.base_url + "/metrics", timeout=30).text
    stopped = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "gmlx_images_total"
        and sample.labels == {"family": "z_image", "outcome": "stopped"}
    ]
    assert stopped and stopped[0] >= 1  # counted as stopped, not done
    if not stream:  # logged as nginx's 499, not a refusal (a stream's 200 went out first)
        gone = [
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "gmlx_http_responses_total" and sample.labels["status"] == "499"
        ]
        assert gone and gone[0] >= 1
