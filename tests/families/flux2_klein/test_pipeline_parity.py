"""A whole tiny sampling with two references through the step routes equals diffusers'
Flux2KleinPipeline (and Flux2KleinKVPipeline for the KV family) on the same weights, starting
latents, reference images and sigmas: the final latents, relative L2 <= 1e-4 in float32.

The routes' sampler takes its sigmas from the status's `flux2` rule; the pipeline is handed the
same ones (its scheduler without dynamic shifting, shift 1, so it uses them as they are). Its
guidance_scale g is `neg + g (pos - neg)` with the empty negative prompt, the sampler's cfg the
same; the distilled pipelines are unguided (cfg 1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gmlx_contract.schedules import rule_sigmas
from gmlx_server.engine.sampling import ImageRequest, initial_noise
from PIL import Image

from tests.compare import rel_l2
from tests.families.flux2_klein.reference import use_kv_processors
from tests.families.flux2_klein.tiny.folder import SCHEDULER_CONFIG, build_tiny_folder
from tests.families.routes import served_folder, through_routes

WIDTH, HEIGHT = 64, 48
PROMPT = "a red fox in the snow"
REFERENCE_SIZES = [(64, 96), (128, 64)]  # (height, width), multiples of 16
CASES = {
    "4b-distilled": ("flux2_klein", True, 4, 1.0),
    "4b-base": ("flux2_klein", False, 3, 4.0),
    "9b-kv": ("flux2_klein_9b_kv", True, 3, 1.0),
}


def references() -> list[np.ndarray]:
    rng = np.random.default_rng(11)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in REFERENCE_SIZES]


# The distilled 4B runs the same pipeline class as the base 4B, unguided: the base case (cfg
# 4) covers its arithmetic. The KV pipeline's references at time 0 and their kept K/V are
# tests/families/flux2_klein/test_seam.py's against the transformer. Both run with -m heavy.
HEAVY_CASES = ("4b-distilled", "9b-kv")


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(name, marks=pytest.mark.heavy) if name in HEAVY_CASES else name
        for name in sorted(CASES)
    ],
)
def case(request, tmp_path_factory):
    family, distilled, steps, cfg = CASES[request.param]
    folder = tmp_path_factory.mktemp("flux2_pipeline") / f"klein-{request.param}"
    build_tiny_folder(folder, family=family, distilled=distilled, num_single_layers=2)
    with served_folder(folder) as server:
        yield folder, server, family, steps, cfg


def pipeline(folder, family: str):
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinKVPipeline,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(
        {**SCHEDULER_CONFIG, "use_dynamic_shifting": False, "shift": 1.0}
    )
    parts = {
        "scheduler": scheduler,
        "vae": AutoencoderKLFlux2.from_pretrained(folder / "vae").eval(),
        "text_encoder": Qwen3ForCausalLM.from_pretrained(folder / "text_encoder").eval(),
        "tokenizer": AutoTokenizer.from_pretrained(folder / "tokenizer"),
        "transformer": Flux2Transformer2DModel.from_pretrained(folder / "transformer").eval(),
    }
    if family == "flux2_klein_9b_kv":
        use_kv_processors(parts["transformer"])
        return Flux2KleinKVPipeline(**parts)
    return Flux2KleinPipeline(**parts, is_distilled=False)


def test_sampling_with_two_references_equals_the_pipeline(case):
    folder, server, family, steps, cfg = case
    images = references()
    request = ImageRequest(
        prompt=PROMPT,
        width=WIDTH,
        height=HEIGHT,
        seed=7,
        steps=steps,
        cfg=cfg,
        images=tuple(images),
    )
    noise = initial_noise(request.seed, 128, HEIGHT // 16, WIDTH // 16)
    sigmas = rule_sigmas({"rule": "flux2"}, steps, (HEIGHT // 16) * (WIDTH // 16))
    pipe = pipeline(folder, family)
    kwargs = {} if family == "flux2_klein_9b_kv" else {"guidance_scale": cfg}
    with torch.no_grad():
        expected = pipe(
            image=[Image.fromarray(image) for image in images],
            prompt=PROMPT,
            height=HEIGHT,
            width=WIDTH,
            num_inference_steps=steps,
            sigmas=[float(s) for s in sigmas[:-1]],
            latents=torch.from_numpy(noise.copy()),
            output_type="latent",
            **kwargs,
        ).images
        # the pipeline answers the VAE's raw latents: back to model space (the routes' space)
        vae = pipe.vae
        mean = vae.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        expected = ((pipe._patchify_latents(expected) - mean) / std).numpy()
    ours = through_routes(server, request)
    assert ours.shape == expected.shape == noise.shape
    assert rel_l2(ours, expected) <= 1e-4
    assert rel_l2(ours, noise) > 0.1  # the sampling moved the latents
    unreferenced = through_routes(server, ImageRequest(**{**request.__dict__, "images": ()}))
    assert rel_l2(ours, unreferenced) > 0.01  # and the references moved the result
