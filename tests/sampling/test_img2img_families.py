"""Image to image and inpainting on every family, through its embedded model: a family with no
img2img or inpaint pipeline in diffusers (Qwen-Image 2.1, Krea 2, FLUX.3 klein) samples by the
same arithmetic as those that have one (tests/families/*/test_*img2img*, *inpaint*). Inpainting
keeps the unmasked region's latents exactly the init image's; the in-process sampler and the
step routes give the same latents."""

from __future__ import annotations

import numpy as np
import pytest
from gmlx_server.engine.registry import embedded_modules
from gmlx_server.engine.sampling import ImageRequest, generate

from tests.families.routes import served_folder, through_routes

MODELS = {module.MODEL_NAME: module for module in embedded_modules()}
WIDTH, HEIGHT = 128, 96
STEPS = 6  # at most (MOSS-Image samples 50 of its own)


# FLUX.2 klein's inpainting is checked against its pipeline (test_inpaint_parity.py); here it
# runs with -m heavy.
@pytest.fixture(
    scope="module",
    params=[
        pytest.param(m, marks=pytest.mark.heavy) if m.startswith("flux2") else m
        for m in sorted(MODELS)
    ],
)
def server(request, tmp_path_factory):
    folder = MODELS[request.param].ensure_embedded_model(tmp_path_factory.mktemp("cache"))
    with served_folder(folder) as running:
        yield running


def picture() -> np.ndarray:
    rows, cols = np.mgrid[0:HEIGHT, 0:WIDTH]
    return np.stack([rows * 2, cols * 2, 255 - rows * 2], axis=-1).astype(np.uint8)


def box_mask() -> np.ndarray:
    mask = np.zeros((HEIGHT, WIDTH), np.uint8)
    mask[32:64, 48:96] = 255
    return mask


def test_inpainting_keeps_the_unmasked_latents_and_is_the_same_over_the_routes(server):
    status = server.loaded.model.status()
    stride = int(status["latent"]["stride"])
    sampling = status["sampling"]
    steps = None if sampling["sigmas"] else min(int(sampling["steps"]), STEPS)
    request = ImageRequest(
        prompt="a boat",
        width=WIDTH,
        height=HEIGHT,
        seed=2,
        steps=steps,
        init_image=picture(),
        mask=box_mask(),
    )
    inpainted, _ = generate(server.direct(), status, request)
    start = server.direct().encode_image(picture().astype(np.float32) / 255)
    far = np.ones((HEIGHT // stride, WIDTH // stride), bool)
    far[32 // stride - 1 : 64 // stride + 1, 48 // stride - 1 : 96 // stride + 1] = False
    assert np.array_equal(inpainted[0][:, far], start[0][:, far])
    assert not np.allclose(inpainted[0][:, ~far], start[0][:, ~far])
    assert np.array_equal(through_routes(server, request), inpainted)
