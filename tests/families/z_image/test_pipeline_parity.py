"""A whole tiny sampling through the step routes equals diffusers' ZImagePipeline on the same
weights, starting latents and sigmas: the final latents, relative L2 <= 1e-4 in float32.

The pipeline's guidance_scale g is `pos + g (pos - neg)`, the sampler's cfg is
`uncond + cfg (cond - uncond)`: cfg = g + 1 (unguided turbo: g = 0, cfg = 1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gmlx_contract.client import StepClient
from gmlx_server.engine.registry import ModelRegistry
from gmlx_server.engine.sampling import Guidance, sample
from gmlx_server.image_cli import ModelChoice, StepServer, ViaStepsTransport

from tests.families.z_image.reference import rel_l2
from tests.families.z_image.tiny.folder import build_tiny_folder

WIDTH, HEIGHT = 64, 48
PROMPT, NEGATIVE = "a red fox in the snow", "blurry"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("z_image_pipeline") / "z-image-tiny"
    build_tiny_folder(root, variant="turbo")
    return root


@pytest.fixture(scope="module")
def server(folder):
    registry = ModelRegistry(extra_models=[folder], default_model=folder.name)
    with StepServer(ModelChoice(registry, folder.name, 0.0)) as server:
        server.load()
        yield server


def pipeline(folder):
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        ZImagePipeline,
        ZImageTransformer2DModel,
    )
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    return ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(folder / "scheduler"),
        vae=AutoencoderKL.from_pretrained(folder / "vae"),
        text_encoder=Qwen3ForCausalLM.from_pretrained(folder / "text_encoder").eval(),
        tokenizer=AutoTokenizer.from_pretrained(folder / "tokenizer"),
        transformer=ZImageTransformer2DModel.from_pretrained(folder / "transformer").eval(),
    )


def through_routes(server, noise, sigmas, cfg: float) -> np.ndarray:
    with StepClient(server.base_url) as client:
        via = ViaStepsTransport(client, server.direct(), server.choice.model_id)
        cond = via.row(via.encode(PROMPT, ()))
        uncond = via.row(via.encode(NEGATIVE, ())) if cfg != 1.0 else None
        via.begin()
        try:
            return sample(via.step, noise, sigmas, Guidance(cond, uncond, cfg))
        finally:
            via.end()


@pytest.mark.parametrize(("steps", "guidance_scale"), [(4, 0.0), (3, 1.5)])
def test_sampling_through_the_routes_equals_the_pipeline(folder, server, steps, guidance_scale):
    noise = np.random.default_rng(7).standard_normal((1, 16, HEIGHT // 8, WIDTH // 8))
    noise = noise.astype(np.float32)
    pipe = pipeline(folder)
    with torch.no_grad():
        expected = pipe(
            PROMPT,
            negative_prompt=NEGATIVE,
            height=HEIGHT,
            width=WIDTH,
            num_inference_steps=steps,
            guidance_scale=guidance_scale,
            latents=torch.from_numpy(noise),
            output_type="latent",
        ).images.numpy()
    sigmas = pipe.scheduler.sigmas.numpy().astype(np.float32)  # shifted, the terminal 0 appended
    assert len(sigmas) == steps + 1 and sigmas[0] == 1.0 and sigmas[-1] == 0.0
    ours = through_routes(server, noise, sigmas, cfg=guidance_scale + 1.0)
    assert ours.shape == expected.shape
    assert rel_l2(ours, expected) <= 1e-4
    assert rel_l2(ours, noise) > 0.1  # the sampling moved the latents
