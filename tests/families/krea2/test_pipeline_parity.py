"""Whole tiny samplings through the step routes equal diffusers' Krea2Pipeline on the same
weights and starting latents: the final latents, relative L2 <= 1e-4 in float32. Neither side is
handed sigmas: the turbo variant's static shift e^1.15 and the raw variant's `krea2` size rule
are the pipeline's own schedules.

The pipeline's guidance_scale g is `cond + g (cond - uncond)`, the sampler's cfg is
`uncond + cfg (cond - uncond)`: cfg = g + 1 (unguided turbo: g = 0, cfg = 1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gmlx_server.engine.base import StepRow
from gmlx_server.engine.families.krea2.embedded import write_embedded_model
from gmlx_server.engine.sampling import ImageRequest, initial_noise

from tests.compare import rel_l2
from tests.families.krea2.tiny import build_tiny_folder, reference_pipeline
from tests.families.routes import through_routes, variant_folder

PROMPT, NEGATIVE = "a red fox in the snow", "blurry"
PROMPTS = (PROMPT, "a lighthouse at dusk")


@pytest.fixture(scope="module", params=["turbo", "raw", "embedded"])
def folder(request, tmp_path_factory):
    """The tests' tiny folders of both variants, and the embedded krea2-random-tiny (turbo),
    its product recipe loaded into the references."""
    root = tmp_path_factory.mktemp("krea2_pipeline") / f"krea2-{request.param}-tiny"
    return variant_folder(root, request.param, build_tiny_folder, write_embedded_model)


def packed(latents: np.ndarray) -> np.ndarray:
    """(B, C, H, W) -> the pipeline's (B, (H/2)(W/2), C*4)."""
    b, c, h, w = latents.shape
    x = latents.reshape(b, c, h // 2, 2, w // 2, 2).transpose(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpacked(tokens: np.ndarray, h: int, w: int) -> np.ndarray:
    b, _, channels = tokens.shape
    x = tokens.reshape(b, h // 2, w // 2, channels // 4, 2, 2).transpose(0, 3, 1, 4, 2, 5)
    return x.reshape(b, channels // 4, h, w)


@pytest.mark.parametrize(
    ("width", "height", "steps", "guidance"), [(64, 48, 3, 0.0), (48, 80, 2, 3.5)]
)
def test_sampling_through_the_routes_equals_the_pipeline(
    folder, server, width, height, steps, guidance
):
    if server.loaded.model.status()["sampling"]["cfg"] == 1.0 and guidance:
        steps += 1  # turbo guided too: the pipeline guides whatever the checkpoint
    request = ImageRequest(
        prompt=PROMPT,
        negative=NEGATIVE,
        width=width,
        height=height,
        seed=7,
        steps=steps,
        cfg=guidance + 1.0,
    )
    h, w = height // 8, width // 8
    noise = initial_noise(request.seed, 16, h, w)
    pipe = reference_pipeline(folder)
    with torch.no_grad():
        expected = pipe(
            PROMPT,
            negative_prompt=NEGATIVE,
            height=height,
            width=width,
            num_inference_steps=steps,
            guidance_scale=guidance,
            latents=torch.from_numpy(packed(noise)),
            output_type="latent",
        ).images.numpy()
    ours = through_routes(server, request)
    assert rel_l2(ours, unpacked(expected, h, w)) <= 1e-4
    assert rel_l2(ours, noise) > 0.1  # the sampling moved the latents


def test_the_prompt_moves_the_latents(server):
    """The recipes' rule (engine/embedded.py): the prompt visibly moves the image."""
    requests = [ImageRequest(prompt=p, width=32, height=32, seed=3, steps=2) for p in PROMPTS]
    first, second = (through_routes(server, request) for request in requests)
    assert rel_l2(first, second) > 1e-2


@pytest.mark.parametrize("convention", ["comfy", "reference"])
def test_a_step_in_each_convention_is_the_references_velocity(folder, server, convention):
    """Both conventions read the timestep as sigma and answer the DiT's velocity as it is."""
    from diffusers import Krea2Transformer2DModel

    from tests.families.krea2.reference import reference_dit

    model = server.loaded.model
    config = model.dit.config
    rng = np.random.default_rng(5)
    cond = rng.standard_normal((6, config.num_text_layers, config.text_dim)).astype(np.float32)
    x = rng.standard_normal((1, config.latent_channels, 6, 4)).astype(np.float32)
    row = StepRow(cond.reshape(1, 6, -1), "wire:c")
    out = model.denoise_step(x, np.float32([0.45]), [row], convention=convention).out
    reference = Krea2Transformer2DModel.from_pretrained(str(folder / "transformer")).eval()
    assert rel_l2(out, reference_dit(reference, x, [0.45], [cond])) <= 1e-4
