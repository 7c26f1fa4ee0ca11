"""equal_to_direct on a real (tiny, random-weight) Qwen-Image 2.1: the embedded default model
served by the real routes, sampled through them and in process, must reach the same latents
bit for bit: several sizes and seeds, guided and unguided, with and without references."""

import numpy as np
import pytest
from gmlx_contract.client import StepClient
from gmlx_server.engine.families.qwen_image21.embedded import ensure_embedded_model
from gmlx_server.engine.registry import ModelRegistry
from gmlx_server.engine.sampling import ImageRequest, generate
from gmlx_server.model_choice import ModelChoice
from gmlx_server.step_server import StepServer, ViaStepsTransport


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = ensure_embedded_model(tmp_path_factory.mktemp("embedded"))
    registry = ModelRegistry(extra_models=[folder], default_model=folder.name)
    with StepServer(ModelChoice(registry, folder.name, 0.0)) as running:
        running.load()
        yield running


def reference(width, height, seed):
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


CASES = [
    # (width, height, seed, cfg, number of 256x256 references)
    (64, 64, 0, 1.0, 0),
    (96, 64, 3, 4.0, 0),
    (64, 128, 17, 1.0, 1),
    (80, 48, 5, 2.5, 1),
]


@pytest.mark.parametrize(("width", "height", "seed", "cfg", "refs"), CASES)
def test_real_model_via_steps_equals_direct(server, width, height, seed, cfg, refs):
    status = server.loaded.model.status()
    request = ImageRequest(
        prompt="a lighthouse on a cliff",
        width=width,
        height=height,
        seed=seed,
        cfg=cfg,
        images=tuple(reference(256, 256, seed + i) for i in range(refs)),
    )
    with StepClient(server.base_url) as client:
        via = ViaStepsTransport(client, server.direct(), server.choice.model_id)
        through_routes, _ = generate(via, status, request)
    direct, _ = generate(server.direct(), status, request)
    assert len(via.transport_ms) == status["sampling"]["steps"]  # one request per step
    assert through_routes.shape == (1, 64, height // 16, width // 16)
    assert np.isfinite(through_routes).all()
    np.testing.assert_array_equal(through_routes, direct)


def test_real_model_latents_depend_on_prompt_and_guidance(server):
    status = server.loaded.model.status()
    base = dict(width=64, height=64, seed=1)
    direct = server.direct()
    a, _ = generate(direct, status, ImageRequest(prompt="a red boat", **base))
    b, _ = generate(direct, status, ImageRequest(prompt="a snowy mountain", **base))
    c, _ = generate(direct, status, ImageRequest(prompt="a red boat", cfg=3.0, **base))
    assert not np.array_equal(a, b) and not np.array_equal(a, c)
