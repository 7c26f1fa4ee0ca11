"""Image to image and inpainting on the tiny Z-Image equal diffusers' ZImageImg2ImgPipeline and
ZImageInpaintPipeline on the same weights, init image, mask, seed and schedule: the final
latents, relative L2 <= 1e-4 in float32, through the in-process sampler, the step routes and
an OpenAI edit (its PNG is the decode of those latents).

The sampler shortens its schedule as ComfyUI does (int(steps / strength) steps evaluated, the
last `steps` run); the pipelines drop the first steps of an N-step schedule. With N = steps /
strength an integer the two are the same schedule, so the pipelines run N steps at `strength`.
The pipelines draw the init image's latents from the VAE's distribution; the server takes its
mean, as ComfyUI does, so the pipelines are run with the mean too (`retrieve_latents` with
"argmax"). Their noise is torch's `randn` from a generator seeded as ComfyUI seeds it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gmlx_server.engine.sampling import ImageRequest, generate
from PIL import Image

from tests.compare import rel_l2
from tests.families.routes import decoded, through_openai_edit, through_routes
from tests.families.z_image.test_pipeline_parity import pipeline

WIDTH, HEIGHT = 64, 48
PROMPT, NEGATIVE = "a red fox in the snow", "blurry"
SEED = 5


def init_image() -> np.ndarray:
    rows, cols = np.mgrid[0:HEIGHT, 0:WIDTH]
    rng = np.random.default_rng(3)
    smooth = np.stack([rows * 4, cols * 3, (rows + cols) * 2], axis=-1) % 256
    return np.clip(smooth + rng.integers(-20, 20, smooth.shape), 0, 255).astype(np.uint8)


def mask_image() -> np.ndarray:
    mask = np.zeros((HEIGHT, WIDTH), np.uint8)
    mask[10:38, 20:52] = 255
    return mask


def mean_latents(monkeypatch, module) -> None:
    original = module.retrieve_latents

    def mean(encoder_output, generator=None, sample_mode="sample"):
        return original(encoder_output, generator, sample_mode="argmax")

    monkeypatch.setattr(module, "retrieve_latents", mean)


def pipeline_of(folder, kind: str):
    import diffusers

    pipeline_class = {
        "img2img": diffusers.ZImageImg2ImgPipeline,
        "inpaint": diffusers.ZImageInpaintPipeline,
    }[kind]
    return pipeline_class(**pipeline(folder).components)


def expected_latents(monkeypatch, folder, kind, steps, strength, guidance_scale) -> np.ndarray:
    from diffusers.pipelines.z_image import pipeline_z_image_img2img, pipeline_z_image_inpaint

    mean_latents(monkeypatch, pipeline_z_image_img2img)
    mean_latents(monkeypatch, pipeline_z_image_inpaint)
    total = round(steps / strength)
    extra = {"mask_image": Image.fromarray(mask_image(), "L")} if kind == "inpaint" else {}
    with torch.no_grad():
        return (
            pipeline_of(folder, kind)(
                PROMPT,
                image=Image.fromarray(init_image()),
                negative_prompt=NEGATIVE,
                height=HEIGHT,
                width=WIDTH,
                strength=strength,
                num_inference_steps=total,
                guidance_scale=guidance_scale,
                generator=torch.Generator().manual_seed(SEED),
                output_type="latent",
                **extra,
            )
            .images.float()
            .numpy()
        )


CASES = {
    "img2img": ("img2img", 2, 0.5, 0.0),
    "img2img-guided": ("img2img", 3, 0.75, 1.5),
    "inpaint": ("inpaint", 2, 0.5, 0.0),
    "inpaint-whole": ("inpaint", 3, 1.0, 1.5),
}


# The guided cases run with -m heavy: their guidance is the pipelines' of
# test_pipeline_parity.py, the image-to-image arithmetic the unguided cases'.
HEAVY = ("img2img-guided", "inpaint-whole")


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.heavy) if n in HEAVY else n for n in sorted(CASES)],
)
def test_image_to_image_equals_the_pipeline(monkeypatch, turbo_folder, turbo_server, name):
    folder, server = turbo_folder, turbo_server
    kind, steps, strength, guidance_scale = CASES[name]
    request = ImageRequest(
        prompt=PROMPT,
        negative=NEGATIVE,
        width=WIDTH,
        height=HEIGHT,
        seed=SEED,
        steps=steps,
        cfg=guidance_scale + 1.0,
        init_image=init_image(),
        strength=strength,
        mask=mask_image() if kind == "inpaint" else None,
    )
    expected = expected_latents(monkeypatch, folder, kind, steps, strength, guidance_scale)
    direct, _ = generate(server.direct(), server.loaded.model.status(), request)
    assert direct.shape == expected.shape
    assert rel_l2(direct, expected) <= 1e-4
    print(f"FIGURE z-image {name}: rel-L2 {rel_l2(direct, expected):.1e}")
    assert np.array_equal(through_routes(server, request), direct)
    assert np.array_equal(through_openai_edit(server, request), decoded(server, direct))
    if kind == "inpaint":  # the kept region is the init image's latents, exactly
        start = server.direct().encode_image(init_image().astype(np.float32) / 255)
        kept = mask_image()[::8, ::8] == 0
        assert np.array_equal(direct[0][:, kept], start[0][:, kept])


def test_the_init_image_holds_the_result_closer_than_text_alone(turbo_server):
    server = turbo_server
    request = ImageRequest(
        prompt=PROMPT, width=WIDTH, height=HEIGHT, seed=SEED, steps=2, init_image=init_image()
    )
    start = server.direct().encode_image(init_image().astype(np.float32) / 255)
    status = server.loaded.model.status()
    strong, _ = generate(server.direct(), status, request)
    light, _ = generate(
        server.direct(), status, ImageRequest(**{**request.__dict__, "strength": 0.3})
    )
    assert rel_l2(light, start) < rel_l2(strong, start)
