"""Sampling through the step routes (a real server on a loopback port) equals sampling in
process, bit for bit, on a deterministic test model; and the bench record has the shape of
docs/contract.md §6."""

import numpy as np
import pytest
from gmlx_contract.client import StepClient
from gmlx_server.engine.registry import ModelRegistry
from gmlx_server.engine.sampling import ImageRequest, generate
from gmlx_server.image_bench import run_bench
from gmlx_server.model_choice import ModelChoice
from gmlx_server.step_server import StepServer, ViaStepsTransport

from . import toy_family


@pytest.fixture
def toy_choice(tmp_path):
    folder = toy_family.make_folder(tmp_path)
    registry = ModelRegistry(
        extra_models=[folder], default_model=folder.name, families={"toy": toy_family.TOY}
    )
    return ModelChoice(registry, folder.name, 0.0)


@pytest.fixture
def toy_server(toy_choice):
    with StepServer(toy_choice) as server:
        server.load()
        yield server


def reference_image(width, height, seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (height, width, 3), dtype=np.uint8)


CASES = [
    # (width, height, seed, cfg, references, sampler)
    (64, 64, 0, 1.0, 0, "euler"),
    (64, 64, 0, 4.0, 0, "euler"),
    (96, 48, 7, 3.5, 0, "euler"),
    (48, 112, 123, 1.0, 1, "euler"),
    (64, 32, 5, 2.5, 2, "euler"),
    (64, 64, 0, 4.0, 0, "uni_pc_bh2"),
    (48, 80, 9, 1.0, 1, "uni_pc_bh2"),
]


@pytest.mark.parametrize(("width", "height", "seed", "cfg", "refs", "sampler"), CASES)
def test_via_steps_equals_direct(toy_server, width, height, seed, cfg, refs, sampler):
    status = toy_server.loaded.model.status()
    request = ImageRequest(
        prompt="a red boat on a calm sea",
        negative="blurry" if cfg != 1.0 else None,
        images=tuple(reference_image(64, 48, seed + i) for i in range(refs)),
        width=width,
        height=height,
        seed=seed,
        cfg=cfg,
        steps=5,
        sampler=sampler,
    )
    model = toy_server.loaded.model
    with StepClient(toy_server.base_url) as client:
        via = ViaStepsTransport(client, toy_server.direct(), toy_server.choice.model_id)
        through_routes, _ = generate(via, status, request)
    http_calls = list(model.calls)
    direct, _ = generate(toy_server.direct(), status, request)

    assert len(via.transport_ms) == 5  # one request per step
    rows = 2 if cfg != 1.0 else 1
    assert [n for n, _ in http_calls] == [rows] * 5
    assert http_calls[0][1] != model.calls[-1][1]  # the routes' run, then the direct run
    assert through_routes.shape == (1, toy_family.CHANNELS, height // 16, width // 16)
    assert through_routes.dtype == np.float32
    np.testing.assert_array_equal(through_routes, direct)


def test_guidance_and_references_change_the_latents(toy_server):
    """The equality above would be empty if the rows did not reach the model (or the sampler
    were not used)."""
    status = toy_server.loaded.model.status()
    base = dict(prompt="a red boat", width=64, height=64, seed=1, steps=4)
    direct = toy_server.direct()
    plain, _ = generate(direct, status, ImageRequest(**base))
    guided, _ = generate(direct, status, ImageRequest(**base, cfg=3.0, negative="fog"))
    edited, _ = generate(direct, status, ImageRequest(**base, images=(reference_image(64, 64, 2),)))
    other_seed, _ = generate(direct, status, ImageRequest(**{**base, "seed": 2}))
    unipc, _ = generate(direct, status, ImageRequest(**base, sampler="uni_pc_bh2"))
    for changed in (guided, edited, other_seed, unipc):
        assert not np.array_equal(plain, changed)


def test_bench_record_via_steps(toy_choice):
    request = ImageRequest(prompt="a lighthouse", width=64, height=48, seed=3, steps=3, cfg=2.0)
    record = run_bench(toy_choice, request, runs=2, warmup=1, via_steps=True, label="toy")
    assert record["schema"] == "gmlx.image.bench/1"
    assert set(record) == {
        "schema",
        "gmlx_version",
        "mlx_version",
        "label",
        "machine",
        "model",
        "settings",
        "runs",
        "summary",
        "transport",
    }
    assert record["label"] == "toy"
    assert set(record["machine"]) == {"chip", "ram_bytes", "os"}
    assert record["settings"] == {
        "width": 64,
        "height": 48,
        "steps": 3,
        "sampler": "euler",
        "scheduler": None,
        "guidance": 2.0,
        "batch": 1,
        "adapters": [],
        "seed": 3,
        "prompt": "a lighthouse",
    }
    assert len(record["runs"]) == 2
    for run in record["runs"]:
        assert set(run) == {
            "encode_s",
            "step_s",
            "decode_s",
            "image_s",
            "peak_bytes",
            "transport_ms",
        }
        assert len(run["step_s"]) == 3 and len(run["transport_ms"]) == 3
        assert all(ms > 0 for ms in run["transport_ms"])
    assert set(record["summary"]) == {
        "load_s",
        "encode_s",
        "s_per_step",
        "decode_s",
        "s_per_image",
        "peak_bytes",
    }
    assert "total" in record["summary"]["load_s"]
    transport = record["transport"]
    assert transport["mode"] == "steps"
    assert transport["equal_to_direct"] is True
    all_ms = sorted(ms for run in record["runs"] for ms in run["transport_ms"])
    assert transport["overhead_ms_median"] == pytest.approx(float(np.median(all_ms)), abs=1e-3)
    assert set(record["model"]) == {"id", "family", "variant", "dit", "encoder", "vae"}
    assert record["model"]["family"] == "toy"


def test_bench_record_direct(toy_choice):
    request = ImageRequest(prompt="a lighthouse", width=32, height=32, seed=0, steps=2)
    record = run_bench(toy_choice, request, runs=1, warmup=0, via_steps=False)
    assert record["transport"] == {"mode": "direct", "overhead_ms_median": None}
    assert "transport_ms" not in record["runs"][0]
    assert record["settings"]["guidance"] == 1.0
