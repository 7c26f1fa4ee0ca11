"""Inpainting on the tiny FLUX.2 klein equals diffusers' Flux2KleinInpaintPipeline on the same
weights, init image, mask, seed and schedule: the final latents in model space, relative L2
<= 1e-4 in float32, through the in-process sampler, the step routes and an OpenAI edit (its
PNG is the decode of those latents). The pipeline also takes the init image as its first
reference (status `conditioning.inpaint_reference`).

As in test_pipeline_parity.py the pipeline is handed the `flux2` rule's sigmas (its scheduler
unshifted); the sampler shortens its schedule as ComfyUI does (int(steps / strength) steps
evaluated, the last `steps` run), the pipeline drops the first steps of that N-step schedule,
which is the same schedule where N = steps / strength is an integer.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gmlx_contract.schedules import rule_sigmas
from gmlx_server.engine.sampling import ImageRequest, generate
from PIL import Image

from tests.compare import rel_l2
from tests.families.flux2_klein.test_pipeline_parity import pipeline
from tests.families.flux2_klein.tiny.folder import build_tiny_folder
from tests.families.routes import decoded, served_folder, through_openai_edit, through_routes

WIDTH, HEIGHT = 64, 48
PROMPT = "a red fox in the snow"
SEED = 9


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flux2_inpaint") / "klein-inpaint"
    build_tiny_folder(folder, family="flux2_klein", distilled=False, num_single_layers=2)
    with served_folder(folder) as server:
        yield folder, server


def init_image() -> np.ndarray:
    rows, cols = np.mgrid[0:HEIGHT, 0:WIDTH]
    return (np.stack([rows * 5, cols * 4, 255 - rows * 3], axis=-1) % 256).astype(np.uint8)


def mask_image() -> np.ndarray:
    mask = np.zeros((HEIGHT, WIDTH), np.uint8)
    mask[8:40, 16:56] = 255
    return mask


def to_model_space(pipe, latents: torch.Tensor) -> np.ndarray:
    """The pipeline's unpacked VAE latents back in model space (patchified, normalised)."""
    vae = pipe.vae
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    return ((pipe._patchify_latents(latents) - mean) / std).numpy()


# The guided, whole-strength case runs with -m heavy (its arithmetic is the unguided one's,
# with the base pipeline's guidance that test_pipeline_parity.py covers).
@pytest.mark.parametrize(
    ("steps", "strength", "cfg"),
    [(2, 0.5, 1.0), pytest.param(3, 1.0, 4.0, marks=pytest.mark.heavy)],
)
def test_inpainting_equals_the_pipeline(served, steps, strength, cfg):
    from diffusers import Flux2KleinInpaintPipeline

    folder, server = served
    total = round(steps / strength)
    sigmas = rule_sigmas({"rule": "flux2"}, total, (HEIGHT // 16) * (WIDTH // 16))
    pipe = Flux2KleinInpaintPipeline(**pipeline(folder, "flux2_klein").components)
    with torch.no_grad():
        expected = pipe(
            prompt=PROMPT,
            image=Image.fromarray(init_image()),
            mask_image=Image.fromarray(mask_image(), "L"),
            height=HEIGHT,
            width=WIDTH,
            strength=strength,
            num_inference_steps=total,
            sigmas=[float(s) for s in sigmas[:-1]],
            guidance_scale=cfg,
            generator=torch.Generator().manual_seed(SEED),
            output_type="latent",
        ).images
        expected = to_model_space(pipe, expected)
    request = ImageRequest(
        prompt=PROMPT,
        width=WIDTH,
        height=HEIGHT,
        seed=SEED,
        steps=steps,
        cfg=cfg,
        init_image=init_image(),
        strength=strength,
        mask=mask_image(),
    )
    direct, _ = generate(server.direct(), server.loaded.model.status(), request)
    assert direct.shape == expected.shape
    assert rel_l2(direct, expected) <= 1e-4
    print(
        f"FIGURE klein inpaint {steps} steps at {strength}: rel-L2 {rel_l2(direct, expected):.1e}"
    )
    assert np.array_equal(through_routes(server, request), direct)
    assert np.array_equal(through_openai_edit(server, request), decoded(server, direct))
