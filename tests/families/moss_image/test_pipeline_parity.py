"""Whole tiny guided samplings of MOSS-Image through the step routes equal upstream's MLX port
(tests/families/moss_image/tiny.py) on the same weights, conditionings and starting latents:
its `_sample` (the pipeline's loop: its snapped schedule, cfg 3, the negative pass leaving out
block 22, Euler in float32) against `generate` over HTTP (the status's `moss_image` schedule,
`neg_skip` sent as the negative row's own step, timesteps of 1000 sigma); the final latents,
relative L2 <= 1e-4 in float32, on both shapes. The steps' `skip` is checked at the route too."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gmlx_contract.client import StepClient
from gmlx_contract.errors import StepError
from gmlx_server.engine.sampling import ImageRequest, initial_noise

from tests.compare import rel_l2
from tests.families.moss_image.tiny import SHAPES, build_tiny_folder, reference_dit
from tests.families.routes import through_routes

PROMPT, NEGATIVE = "a lighthouse at dusk", ""


@pytest.fixture(scope="module", params=sorted(SHAPES))
def folder(request, tmp_path_factory):
    return build_tiny_folder(
        tmp_path_factory.mktemp("moss_pipeline") / request.param, request.param
    )


def port_latents(folder, server, request: ImageRequest, neg_skip: list[int]) -> np.ndarray:
    from moss_image_mlx.pipeline import Request, _sample  # mlx-lm and transformers: seconds

    model = server.loaded.model
    positive = model.encode(request.prompt, [], False).cond
    negative = model.encode(request.negative or "", [], False).cond
    noise = initial_noise(request.seed, 128, request.height // 16, request.width // 16)
    port = Request(
        prompt=request.prompt,
        width=request.width,
        height=request.height,
        steps=request.steps,
        guidance=3.0,
        shift=5.0,
        seed=request.seed,
        uncond_skip_layers=neg_skip,
    )
    out = _sample(
        reference_dit(folder), port, mx.array(positive), mx.array(negative), mx.array(noise), None
    )
    return np.array(out)


@pytest.mark.parametrize(("width", "height", "steps"), [(64, 48, 3), (48, 80, 4)])
def test_a_guided_sampling_through_the_routes_equals_the_port(folder, server, width, height, steps):
    status = server.loaded.model.status()
    assert status["sampling"]["neg_skip"] == [22] and status["sampling"]["cfg"] == 3.0
    request = ImageRequest(PROMPT, width, height, seed=7, steps=steps, negative=NEGATIVE)
    ours = through_routes(server, request)
    assert rel_l2(ours, port_latents(folder, server, request, [22])) <= 1e-4
    # the negative pass's skip mattered: without it the port samples elsewhere
    assert rel_l2(ours, port_latents(folder, server, request, [])) > 1e-3
    noise = initial_noise(7, 128, height // 16, width // 16)
    assert rel_l2(ours, noise) > 0.1  # the sampling moved the latents


def test_steps_skip_blocks_at_the_route(server):
    """`skip` leaves the named blocks out of every row of a step; indices out of range, or not a
    list of integers, are 400 naming what is wrong; the capabilities list `skip_blocks`."""
    model = server.loaded.model
    rng = np.random.default_rng(3)
    cond = rng.standard_normal((1, 5, model.dit.config.text_dim)).astype(np.float32)
    x = rng.standard_normal((1, 128, 2, 3)).astype(np.float32)
    depth = model.dit.config.num_layers
    with StepClient(server.base_url) as client:
        assert "skip_blocks" in client.capabilities()["features"]
        rows = [{"cond": client.put_tensor(cond)}]
        name = server.choice.model_id
        plain = client.step(x, [500.0], rows, model=name).out
        skipped = client.step(x, [500.0], rows, model=name, skip=[1, 22]).out
        direct = np.array(
            model.dit.forward(mx.array(x), np.float32([500.0]), [mx.array(cond[0])], skip=(1, 22))
        )
        assert np.array_equal(skipped, direct) and rel_l2(skipped, plain) > 1e-3
        for skip, named in (([depth], f"out of range 0..{depth - 1}"), (["1"], "list of block")):
            with pytest.raises(StepError) as refused:
                client.step(x, [500.0], rows, model=name, skip=skip)
            assert refused.value.status == 400 and named in str(refused.value)
