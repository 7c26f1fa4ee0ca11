"""The sampler's Euler and guidance arithmetic against values worked out by hand."""

import numpy as np
import pytest
from gmlx_server.engine import sampling
from gmlx_server.engine.noise import comfy_noise
from gmlx_server.engine.sampling import Guidance


class RecordingStep:
    """out[b] = k(row b) * x[b] + t[b]: simple enough to follow by hand; records every call."""

    def __init__(self, slopes):
        self.slopes = slopes
        self.calls = []

    def __call__(self, x, timestep, rows):
        self.calls.append((x.copy(), timestep.copy(), list(rows)))
        slopes = np.array([self.slopes[row] for row in rows], dtype=np.float32)
        return slopes[:, None, None, None] * x + timestep[:, None, None, None]


SIGMAS = np.array([1.0, 0.5, 0.0], dtype=np.float32)


def test_guided_euler_matches_hand_computation():
    step = RecordingStep({"pos": 2.0, "neg": 1.0})
    noise = np.ones((1, 1, 1, 1), dtype=np.float32)
    out = sampling.sample(step, noise, SIGMAS, Guidance("pos", "neg", cfg=3.0))
    # step 0: x=1, cond=2*1+1=3, uncond=1*1+1=2, v=2+3*(3-2)=5, x=1+(0.5-1)*5=-1.5
    # step 1: cond=2*-1.5+0.5=-2.5, uncond=-1.5+0.5=-1, v=-1+3*(-2.5+1)=-5.5, x=-1.5+(-0.5)(-5.5)
    assert out.dtype == np.float32
    assert out.shape == (1, 1, 1, 1)
    assert out.item() == 1.25
    first_x, first_t, first_rows = step.calls[0]
    assert first_rows == ["pos", "neg"]
    assert first_x.shape == (2, 1, 1, 1) and first_x.dtype == np.float32
    assert first_t.tolist() == [1.0, 1.0] and first_t.dtype == np.float32
    assert step.calls[1][1].tolist() == [0.5, 0.5]
    assert step.calls[1][0][:, 0, 0, 0].tolist() == [-1.5, -1.5]


def test_cfg_one_sends_only_the_cond_row():
    step = RecordingStep({"pos": 2.0, "neg": 1.0})
    noise = np.ones((1, 1, 1, 1), dtype=np.float32)
    out = sampling.sample(step, noise, SIGMAS, Guidance("pos", "neg", cfg=1.0))
    # step 0: v=3, x=1-1.5=-0.5; step 1: v=2*-0.5+0.5=-0.5, x=-0.5+0.25=-0.25
    assert out.item() == -0.25
    assert all(rows == ["pos"] for _, _, rows in step.calls)
    assert all(x.shape[0] == 1 for x, _, _ in step.calls)


def test_update_is_float32_per_element():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 4, 3, 5), dtype=np.float32)
    cond = rng.standard_normal((1, 4, 3, 5), dtype=np.float32)
    uncond = rng.standard_normal((1, 4, 3, 5), dtype=np.float32)
    guidance = Guidance("c", "u", cfg=4.5)
    velocity = sampling.guided_velocity(np.concatenate([cond, uncond]), guidance)
    updated = sampling.euler_update(x, velocity, np.float32(0.8), np.float32(0.3))
    expected_v = uncond + np.float32(4.5) * (cond - uncond)
    expected = x + (np.float32(0.3) - np.float32(0.8)) * expected_v
    assert velocity.dtype == np.float32 and updated.dtype == np.float32
    np.testing.assert_array_equal(velocity, expected_v)
    np.testing.assert_array_equal(updated, expected)
    # and close to the same sum worked out in float64
    wide = x.astype(np.float64) - 0.5 * (
        uncond.astype(np.float64) + 4.5 * (cond.astype(np.float64) - uncond.astype(np.float64))
    )
    np.testing.assert_allclose(updated, wide, rtol=1e-5, atol=1e-5)


def test_noise_is_seeded_float32_in_model_space():
    a = sampling.initial_noise(7, 64, 4, 6)
    b = sampling.initial_noise(7, 64, 4, 6)
    c = sampling.initial_noise(8, 64, 4, 6)
    assert a.shape == (1, 64, 4, 6) and a.dtype == np.float32
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    # ComfyUI's noise: torch.randn after torch.manual_seed(7) (tests/comfy/test_noise.py)
    np.testing.assert_array_equal(a, comfy_noise(7, (1, 64, 4, 6)))


def test_fixed_sigmas_win_and_refuse_another_step_count():
    fixed = [1.0, 0.9, 0.4, 0.0]
    sampling_info = {"steps": 3, "sigmas": fixed, "schedule": None}
    got = sampling.resolve_sigmas(sampling_info, None, 64, 64, pixels_per_token=16)
    assert got.dtype == np.float32 and got.tolist() == np.float32(fixed).tolist()
    assert sampling.resolve_sigmas(sampling_info, 3, 64, 64, pixels_per_token=16).shape == (4,)
    with pytest.raises(ValueError, match="fixed 3-step"):
        sampling.resolve_sigmas(sampling_info, 5, 64, 64, pixels_per_token=16)


def test_linear_schedule_without_a_rule():
    got = sampling.resolve_sigmas(
        {"steps": 4, "sigmas": None, "schedule": None}, None, 64, 64, pixels_per_token=16
    )
    assert got.tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert sampling.resolve_sigmas(None, 2, 64, 64, pixels_per_token=16).tolist() == [1.0, 0.5, 0.0]
    with pytest.raises(ValueError):
        sampling.resolve_sigmas(None, None, 64, 64, pixels_per_token=16)


def test_unknown_sampler_and_short_schedule_are_refused():
    step = RecordingStep({"pos": 1.0})
    noise = np.ones((1, 1, 1, 1), dtype=np.float32)
    with pytest.raises(ValueError, match="unknown sampler"):
        sampling.sample(step, noise, SIGMAS, Guidance("pos"), sampler="dpm")
    with pytest.raises(ValueError):
        sampling.sample(step, noise, SIGMAS[:1], Guidance("pos"))


def test_refused_settings_leave_their_name_to_the_caller():
    """A refused setting says which ImageRequest field it is about; each caller names it (the
    command line's flag, an HTTP route's field) and str() names the field itself."""
    turbo = {"steps": 2, "sigmas": [1.0, 0.5, 0.0], "schedule": None}
    with pytest.raises(sampling.SettingError) as fixed:
        sampling.resolve_sigmas(turbo, 4, 64, 64, pixels_per_token=16)
    assert fixed.value.setting == "steps"
    assert str(fixed.value).endswith("leave steps out or set it to 2")
    assert fixed.value.naming("--steps").endswith("leave --steps out or set it to 2")
    with pytest.raises(sampling.SettingError, match="^steps must be at least 1$"):
        sampling.resolve_sigmas(None, -1, 64, 64, pixels_per_token=16)
    with pytest.raises(sampling.SettingError) as side:
        sampling.check_image_size(64, 40, 16)
    assert side.value.setting == "height"
    assert side.value.naming("--height") == "--height must be a positive multiple of 16, not 40"
