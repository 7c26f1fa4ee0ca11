"""Z-Image's step estimate bounds the measured MLX peak of the tiny model's steps (float32 on
the CPU backend): rows of equal and of different caption lengths, several sizes."""

from __future__ import annotations

import numpy as np
import pytest
from gmlx_server.engine.base import StepRow
from gmlx_server.engine.families.z_image import family

from tests.compiled_dits import compiled_dits
from tests.families.estimates import peak_of
from tests.families.z_image.tiny.folder import build_tiny_folder


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("z_image_memory") / "z-image-tiny"
    build_tiny_folder(folder)
    with compiled_dits():  # the plan counts the fused kernels' extra buffers
        loaded = family.Z_IMAGE.load(folder, folder.name)
    yield loaded
    loaded.close()


# Two rows of one length batch: 48 with 200 tokens each shows it; 96 with 500 each, at five
# times the cost, runs with -m heavy.
@pytest.mark.parametrize(
    ("side", "lengths"),
    [
        (16, [32]),
        (32, [40, 7]),
        (64, [300, 12]),
        (48, [200, 200]),
        pytest.param(96, [500, 500], marks=pytest.mark.heavy),
        (48, [100, 5, 260]),
    ],
)
def test_step_estimate_bounds_the_measured_peak(model, side, lengths):
    rng = np.random.default_rng(side)
    rows = [
        StepRow(rng.standard_normal((n, 32), dtype=np.float32), f"c{i}")
        for i, n in enumerate(lengths)
    ]
    x = rng.standard_normal((len(rows), 16, side, side), dtype=np.float32)
    t = np.full((len(rows),), 0.7, np.float32)
    estimate = model.step_peak_bytes(x.shape, rows)
    quick = model.step_peak_bytes(x.shape, None)
    measured = peak_of(lambda: model.denoise_step(x, t, rows))
    print(
        f"step {len(rows)}x{side}^2 captions {lengths}: measured {measured / 2**20:.1f} MiB,"
        f" estimate {estimate / 2**20:.1f} MiB, quick {quick / 2**20:.1f} MiB"
    )
    assert quick <= estimate
    assert 1.05 * measured <= estimate <= 3 * measured
