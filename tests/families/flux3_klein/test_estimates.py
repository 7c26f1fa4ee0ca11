"""FLUX.3 klein's step estimate bounds the measured MLX peak of the tiny model's steps (float32
on the CPU backend): rows of different text lengths, with and without references, and the
flow map's target time, several sizes."""

from __future__ import annotations

import numpy as np
import pytest
from gmlx_contract.hashing import tensor_hash
from gmlx_server.engine.base import StepRow
from gmlx_server.engine.families.flux3_klein import family

from tests.families.flux3_klein.tiny import build_tiny_folder
from tests.families.z_image.test_estimates import peak_of

SCHEDULE = np.float32([1.0, 0.7, 0.3, 0.0])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = build_tiny_folder(tmp_path_factory.mktemp("flux3_memory") / "flux3-tiny")
    loaded = family.FLUX3_KLEIN.load(folder, folder.name)
    yield loaded
    loaded.close()


# (32, [400, 400], [16, 8]) repeats at four times the cost what (16, [160, 80], [8]) shows;
# it runs with -m heavy.
@pytest.mark.parametrize(
    ("side", "lengths", "ref_sides"),
    [
        (8, [80], []),
        (16, [160, 80], [8]),
        pytest.param(32, [400, 400], [16, 8], marks=pytest.mark.heavy),
    ],
)
def test_step_estimate_bounds_the_measured_peak(model, side, lengths, ref_sides):
    rng = np.random.default_rng(side)
    width = model.dit.config.joint_attention_dim
    refs = tuple(rng.standard_normal((128, s, s), dtype=np.float32) for s in ref_sides)
    rows = [
        StepRow(
            rng.standard_normal((n, width), dtype=np.float32),
            f"c{i}",
            ref_latents=refs,
            ref_keys=tuple(tensor_hash(r) for r in refs),
        )
        for i, n in enumerate(lengths)
    ]
    x = rng.standard_normal((len(rows), 128, side, side), dtype=np.float32)
    t = np.full((len(rows),), 0.7, np.float32)
    estimate = model.step_peak_bytes(x.shape, rows)
    quick = model.step_peak_bytes(x.shape, None)
    measured = peak_of(lambda: model.denoise_step(x, t, rows, sample_sigmas=SCHEDULE))
    print(
        f"{len(rows)}x{side}^2 texts {lengths} refs {ref_sides}: measured"
        f" {measured / 2**20:.1f} MiB, estimate {estimate / 2**20:.1f} MiB,"
        f" quick {quick / 2**20:.1f} MiB"
    )
    assert quick <= estimate
    assert 1.05 * measured <= estimate <= 3 * measured
