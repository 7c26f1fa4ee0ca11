"""FLUX.2 klein's step estimate bounds the measured MLX peak of the tiny model's steps (float32
on the CPU backend): rows of different caption lengths, with and without references, several
sizes; and the 9B KV family's, whose reference convention builds the references' K/V."""

from __future__ import annotations

import pytest
from gmlx_server.engine.families.flux2_klein import family

from tests.families.estimates import check_estimate_with_refs
from tests.families.flux2_klein.tiny.folder import build_tiny_folder


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
    width = 96
    check_estimate_with_refs(
        model, width, side, lengths, ref_sides, model.family, convention="reference"
    )
