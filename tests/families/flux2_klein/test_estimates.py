"""FLUX.2 klein's step estimate bounds the measured MLX peak of the tiny model's steps (float32
on the CPU backend): rows of different caption lengths, with and without references, several
sizes; and the 9B KV family's, whose reference convention builds the references' K/V."""

from __future__ import annotations

import numpy as np
import pytest
from gmlx_contract.hashing import tensor_hash
from gmlx_server.engine.base import StepRow
from gmlx_server.engine.families.flux2_klein import family

from tests.families.flux2_klein.tiny.folder import build_tiny_folder
from tests.families.z_image.test_estimates import peak_of


@pytest.fixture(scope="module", params=["flux2_klein", "flux2_klein_9b_kv"])
def model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("flux2_memory") / request.param
    build_tiny_folder(folder, family=request.param, num_single_layers=2)
    loaded = family.FLUX2_KLEIN.load(folder, folder.name)
    yield loaded
    loaded.close()


# (32, [512, 512], [16, 8]) repeats at four times the cost what (16, [512, 40], [8]) shows, two
# rows and references, and (24, [100, 5, 260], [24]) at three times (rows of three lengths,
# one reference as large as the image); they run with -m heavy.
@pytest.mark.parametrize(
    ("side", "lengths", "ref_sides"),
    [
        (8, [512], []),
        (16, [512, 40], [8]),
        pytest.param(32, [512, 512], [16, 8], marks=pytest.mark.heavy),
        pytest.param(24, [100, 5, 260], [24], marks=pytest.mark.heavy),
    ],
)
def test_step_estimate_bounds_the_measured_peak(model, side, lengths, ref_sides):
    rng = np.random.default_rng(side)
    refs = tuple(rng.standard_normal((128, s, s), dtype=np.float32) for s in ref_sides)
    rows = [
        StepRow(
            rng.standard_normal((n, 96), dtype=np.float32),
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
    measured = peak_of(lambda: model.denoise_step(x, t, rows, convention="reference"))
    print(
        f"{model.family} {len(rows)}x{side}^2 captions {lengths} refs {ref_sides}: measured"
        f" {measured / 2**20:.1f} MiB, estimate {estimate / 2**20:.1f} MiB,"
        f" quick {quick / 2**20:.1f} MiB"
    )
    assert quick <= estimate
    assert 1.05 * measured <= estimate <= 3 * measured
