"""FLUX.3 klein's step estimate bounds the measured MLX peak of the tiny model's steps (float32
on the CPU backend): rows of different text lengths, with and without references, and the
flow map's target time, several sizes."""

from __future__ import annotations

import numpy as np
import pytest
from gmlx_server.engine.families.flux3_klein import family

from tests.families.estimates import check_estimate_with_refs
from tests.families.flux3_klein.tiny import build_tiny_folder

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
    width = model.dit.config.joint_attention_dim
    check_estimate_with_refs(
        model, width, side, lengths, ref_sides, "flux3_klein", sample_sigmas=SCHEDULE
    )
