"""Whole tiny samplings through the step routes equal diffusers' FLUX.3 modular pipelines on the
same weights and starting latents: the final latents, relative L2 <= 1e-4 in float32, for the
distilled (flow-map) checkpoint, the base (guided) one and the embedded flux3-klein-random-tiny,
with and without reference images. Neither side is handed sigmas: the static shift 6.93 over the
pipelines' linspace is both sides' own schedule, and a flow-map step's target is the entry of
the schedule the client sends (`sample_sigmas`) after the row's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gmlx_contract.client import StepClient
from gmlx_contract.errors import StepError
from gmlx_server.engine.base import StepRow
from gmlx_server.engine.families.flux3_klein.embedded import write_embedded_model
from gmlx_server.engine.families.flux3_klein.family import flow_map_targets
from gmlx_server.engine.sampling import ImageRequest, initial_noise, to_uint8
from PIL import Image

from tests.compare import rel_l2
from tests.families.flux3_klein.reference import reference_dit
from tests.families.flux3_klein.tiny import OUT_LAYERS, build_tiny_folder, reference_pipeline
from tests.families.routes import through_routes, variant_folder

PROMPT, NEGATIVE = "a red fox in the snow", "blurry"


@pytest.fixture(scope="module", params=["distilled", "base", "embedded"])
def folder(request, tmp_path_factory):
    """The tests' tiny folders of both variants, and the embedded flux3-klein-random-tiny
    (distilled), its product recipe loaded into the references."""
    root = tmp_path_factory.mktemp("flux3_pipeline") / f"flux3-{request.param}-tiny"
    return variant_folder(root, request.param, build_tiny_folder, write_embedded_model)


@pytest.fixture(scope="module")
def pipe(folder):
    return reference_pipeline(folder)


def pictures(sizes, seed: int = 3) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    return tuple(rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for w, h in sizes)


def pipeline_latents(pipe, server, request: ImageRequest, guidance: float) -> np.ndarray:
    h, w = request.height // 16, request.width // 16
    noise = initial_noise(request.seed, 128, h, w)
    arguments = {
        "prompt": request.prompt,
        "height": request.height,
        "width": request.width,
        "num_inference_steps": request.steps,
        "latents": torch.from_numpy(noise),
        "text_encoder_out_layers": OUT_LAYERS,
    }
    if not server.loaded.model.capabilities.flow_map:
        assert pipe.guider.guidance_scale == guidance  # the base blocks' own guidance
        arguments["negative_prompt"] = request.negative or ""
    if request.images:
        arguments["image"] = [Image.fromarray(image) for image in request.images]
    with torch.no_grad():
        return pipe(**arguments, output="latents").numpy()


def guided(server) -> float:
    """The variant's own guidance (the distilled checkpoint samples unguided)."""
    return 1.0 if server.loaded.model.capabilities.flow_map else 3.5


@pytest.mark.parametrize(("width", "height", "steps"), [(64, 48, 3), (48, 80, 2)])
def test_sampling_through_the_routes_equals_the_pipeline(server, pipe, width, height, steps):
    cfg = guided(server)
    request = ImageRequest(PROMPT, width, height, seed=7, steps=steps, cfg=cfg, negative=NEGATIVE)
    expected = pipeline_latents(pipe, server, request, cfg)
    ours = through_routes(server, request)
    assert rel_l2(ours, expected) <= 1e-4
    noise = initial_noise(7, 128, height // 16, width // 16)
    assert rel_l2(ours, noise) > 0.1  # the sampling moved the latents


@pytest.mark.parametrize("sizes", [[(80, 64)], [(64, 64), (96, 64)]], ids=["one", "two"])
def test_an_edit_through_the_routes_equals_the_pipeline(server, pipe, sizes):
    """Reference images at the pipeline's own sizes (it resizes none of them): their VAE
    latents as the references' token mode."""
    cfg = guided(server)
    request = ImageRequest(
        PROMPT, 64, 48, seed=5, steps=2, cfg=cfg, negative=NEGATIVE, images=pictures(sizes)
    )
    expected = pipeline_latents(pipe, server, request, cfg)
    ours = through_routes(server, request)
    assert rel_l2(ours, expected) <= 1e-4
    plain = through_routes(server, ImageRequest(PROMPT, 64, 48, seed=5, steps=2, cfg=cfg))
    assert rel_l2(ours, plain) > 1e-3  # the references moved the image


def test_an_openai_edit_of_one_reference_at_auto_size_is_the_pipelines_picture(server, pipe):
    """A lone reference off the grid (70x100) is padded to its 80x112 canvas; with no size
    given the pipeline samples at the canvas and crops its picture back to the reference's
    size, and so does an edit at size "auto"."""
    (reference,) = pictures([(100, 70)])
    cfg = guided(server)
    fields = {"prompt": PROMPT, "seed": 5, "steps": 2, "size": "auto", "negative_prompt": NEGATIVE}
    answer = openai_edit(server, fields, reference)
    arguments = {
        "prompt": PROMPT,
        "image": [Image.fromarray(reference)],
        "num_inference_steps": 2,
        "latents": torch.from_numpy(initial_noise(5, 128, 80 // 16, 112 // 16)),
        "text_encoder_out_layers": OUT_LAYERS,
        "output_type": "np",
    }
    if not server.loaded.model.capabilities.flow_map:
        assert pipe.guider.guidance_scale == cfg
        arguments["negative_prompt"] = NEGATIVE
    with torch.no_grad():
        expected = to_uint8(pipe(**arguments, output="images")[0])
    assert answer.shape == expected.shape == (70, 100, 3)
    assert np.abs(answer.astype(int) - expected.astype(int)).max() <= 1


def openai_edit(server, fields: dict, image: np.ndarray) -> np.ndarray:
    """The answer's picture of an OpenAI edit of `image` (JSON, a data URL)."""
    import base64
    import io

    import requests

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
    body = {**fields, "images": [{"image_url": url}]}
    answer = requests.post(server.base_url + "/v1/images/edits", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["size"] == f"{image.shape[1]}x{image.shape[0]}"
    data = base64.b64decode(answer.json()["data"][0]["b64_json"])
    with Image.open(io.BytesIO(data)) as picture:
        return np.asarray(picture.convert("RGB"))


@pytest.mark.parametrize("convention", ["comfy", "reference"])
def test_a_step_in_each_convention_is_the_references_velocity(folder, server, convention):
    """Both conventions read the timestep as sigma and answer the DiT's velocity as it is; a
    flow map jumps to the schedule's entry after the row's."""
    from diffusers import Flux3Transformer2DModel

    model = server.loaded.model
    rng = np.random.default_rng(5)
    cond = rng.standard_normal((6, model.dit.config.joint_attention_dim)).astype(np.float32)
    x = rng.standard_normal((1, 128, 3, 2)).astype(np.float32)
    row = StepRow(cond[None], "wire:c")
    schedule = np.float32([1.0, 0.8, 0.45, 0.2, 0.0])
    flow_map = model.capabilities.flow_map
    out = model.denoise_step(
        x, np.float32([0.45]), [row], convention=convention, sample_sigmas=schedule
    ).out
    reference = Flux3Transformer2DModel.from_pretrained(str(folder / "transformer")).eval()
    want = reference_dit(reference, x, [0.45], cond[None], targets=[0.2] if flow_map else None)
    assert rel_l2(out, want) <= 1e-4


def test_a_flow_map_step_without_sample_sigmas_is_refused(server):
    if not server.loaded.model.capabilities.flow_map:
        pytest.skip("the base checkpoint needs no schedule")
    cond = np.zeros((1, 4, server.loaded.model.dit.config.joint_attention_dim), np.float32)
    x = np.zeros((1, 128, 2, 2), np.float32)
    with StepClient(server.base_url) as client:
        rows = [{"cond": client.put_tensor(cond)}]
        for sigmas, named in ((None, "send sample_sigmas"), ([0.5], "at least 2 finite")):
            with pytest.raises(StepError) as refused:
                client.step(x, [0.5], rows, model=server.choice.model_id, sample_sigmas=sigmas)
            assert refused.value.status == 400 and named in str(refused.value)


def test_the_target_is_the_entry_after_the_nearest():
    schedule = np.float32([1.0, 0.75, 0.5, 0.25, 0.0])
    sigmas = np.float32([1.0, 0.74, 0.26, 0.0, 0.6])
    assert flow_map_targets(sigmas, schedule).tolist() == [0.75, 0.5, 0.0, 0.0, 0.25]
