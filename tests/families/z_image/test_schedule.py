"""The in-process sampler's Z-Image schedule (the variant's static shift) against diffusers'
FlowMatchEulerDiscreteScheduler fed ZImagePipeline's default sigmas, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas
from gmlx_server.engine.families.z_image.family import Z_IMAGE
from gmlx_server.engine.families.z_image.spec import SAMPLING
from gmlx_server.engine.sampling import resolve_sigmas


@pytest.mark.parametrize("variant", sorted(SAMPLING))
@pytest.mark.parametrize("steps", [1, 2, 3, 7, 8, 9, 13, 50])
def test_shifted_schedule_is_the_schedulers(variant, steps):
    scheduler = FlowMatchEulerDiscreteScheduler(shift=SAMPLING[variant]["shift"])
    scheduler.set_timesteps(sigmas=get_default_z_image_sigmas(steps))
    expected = scheduler.sigmas.numpy()
    ours = resolve_sigmas(
        Z_IMAGE.sampling_row(None, variant), steps, 1024, 1024, pixels_per_token=16
    )
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours, expected)


def test_the_variants_own_step_count():
    assert (
        len(resolve_sigmas(Z_IMAGE.sampling_row(None, "turbo"), None, 64, 64, pixels_per_token=16))
        == 9
    )
    assert (
        len(resolve_sigmas(Z_IMAGE.sampling_row(None, "base"), None, 64, 64, pixels_per_token=16))
        == 51
    )
