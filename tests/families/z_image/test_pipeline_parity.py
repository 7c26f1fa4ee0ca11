"""A whole tiny sampling through the step routes equals diffusers' ZImagePipeline on the same
weights, starting latents and sigmas: the final latents, relative L2 <= 1e-4 in float32. The
sampler's own schedule (the turbo variant's shift) is the pipeline's default one
(test_schedule.py), so neither side is handed sigmas.

The pipeline's guidance_scale g is `pos + g (pos - neg)`, the sampler's cfg is
`uncond + cfg (cond - uncond)`: cfg = g + 1 (unguided turbo: g = 0, cfg = 1)."""

from __future__ import annotations

import pytest
import torch
from gmlx_server.engine.sampling import ImageRequest, initial_noise

from tests.compare import rel_l2
from tests.families.routes import through_routes

WIDTH, HEIGHT = 64, 48
PROMPT, NEGATIVE = "a red fox in the snow", "blurry"


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


@pytest.mark.parametrize(("steps", "guidance_scale"), [(4, 0.0), (3, 1.5)])
def test_sampling_through_the_routes_equals_the_pipeline(
    turbo_folder, turbo_server, steps, guidance_scale
):
    folder, server = turbo_folder, turbo_server
    request = ImageRequest(
        prompt=PROMPT,
        negative=NEGATIVE,
        width=WIDTH,
        height=HEIGHT,
        seed=7,
        steps=steps,
        cfg=guidance_scale + 1.0,
    )
    noise = initial_noise(request.seed, 16, HEIGHT // 8, WIDTH // 8)
    pipe = pipeline(folder)
    with torch.no_grad():
        expected = pipe(
            PROMPT,
            negative_prompt=NEGATIVE,
            height=HEIGHT,
            width=WIDTH,
            num_inference_steps=steps,
            guidance_scale=guidance_scale,
            latents=torch.from_numpy(noise.copy()),
            output_type="latent",
        ).images.numpy()
    ours = through_routes(server, request)
    assert ours.shape == expected.shape
    assert rel_l2(ours, expected) <= 1e-4
    assert rel_l2(ours, noise) > 0.1  # the sampling moved the latents
