"""The gmlx Sigmas node's schedules (docs/contract.md §5.3, §7.3)."""

import numpy as np
import pytest
import torch
from gmlx_comfy import schedule

QWEN_RULE = {
    "rule": "qwen_image21",
    "base_len": 256,
    "max_len": 8192,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "terminal": 0.02,
}
LATENT = {"channels": 64, "stride": 16, "patch": 1}


@pytest.mark.parametrize("count", [2, 3, 5, 9, 21, 51])
def test_linspace_is_torch_bit_for_bit(count):
    ours = schedule._torch_linspace(1.0, 0.0, count)
    theirs = torch.linspace(1.0, 0.0, count, dtype=torch.float32).numpy()
    assert ours.tobytes() == theirs.tobytes()


def test_qwen_rule_matches_the_server_where_present():
    server = pytest.importorskip("gmlx_server.engine.schedules")
    for steps, tokens in [(2, 256), (8, 4096), (40, 4096), (30, 9000)]:
        ours = schedule.qwen_image21_sigmas(steps, tokens, QWEN_RULE)
        theirs = np.asarray(server.sigmas(QWEN_RULE, steps, tokens), dtype=np.float32)
        np.testing.assert_array_equal(ours, theirs)


def test_qwen_rule_shape_and_ends():
    sigmas = schedule.qwen_image21_sigmas(10, 4096, QWEN_RULE)
    assert sigmas.dtype == np.float32 and len(sigmas) == 11
    assert sigmas[0] == pytest.approx(1.0) and sigmas[-1] == 0.0
    # the terminal stretch puts the last non-zero sigma at 1 - (1 - terminal) = terminal
    assert sigmas[-2] == pytest.approx(0.02, rel=1e-5)
    assert np.all(np.diff(sigmas) < 0)


def test_qwen_rule_needs_two_steps():
    with pytest.raises(schedule.ScheduleError):
        schedule.qwen_image21_sigmas(1, 4096, QWEN_RULE)


def test_rule_needs_width_and_height():
    sampling = {"steps": 40, "cfg": 4.0, "sigmas": None, "schedule": QWEN_RULE}
    with pytest.raises(schedule.ScheduleError, match="width and height"):
        schedule.server_sigmas(sampling, LATENT, 0, 1.0, 0, 0)


def test_rule_uses_tokens_of_the_size_and_variant_steps():
    sampling = {"steps": 12, "cfg": 4.0, "sigmas": None, "schedule": QWEN_RULE}
    got = schedule.server_sigmas(sampling, LATENT, 0, 1.0, 1024, 768)
    want = schedule.qwen_image21_sigmas(12, (768 // 16) * (1024 // 16), QWEN_RULE)
    np.testing.assert_array_equal(got, want)


def test_denoise_evaluates_longer_schedule_and_keeps_tail():
    sampling = {"steps": 40, "sigmas": None, "schedule": QWEN_RULE}
    got = schedule.server_sigmas(sampling, LATENT, 10, 0.5, 512, 512)
    full = schedule.qwen_image21_sigmas(20, 1024, QWEN_RULE)
    np.testing.assert_array_equal(got, full[-11:])


def test_fixed_sigmas_win_and_refuse_other_step_counts():
    fixed = [1.0, 0.978453, 0.95418, 0.926626, 0.89508, 0.845148, 0.704534, 0.414568, 0.0]
    sampling = {"steps": 8, "cfg": 1.0, "sigmas": fixed, "schedule": None}
    got = schedule.server_sigmas(sampling, LATENT, 0, 1.0, 0, 0)
    np.testing.assert_array_equal(got, np.asarray(fixed, dtype=np.float32))
    assert len(schedule.server_sigmas(sampling, LATENT, 8, 1.0, 0, 0)) == 9
    with pytest.raises(schedule.ScheduleError, match="fixed 8-step"):
        schedule.server_sigmas(sampling, LATENT, 20, 1.0, 0, 0)
    tail = schedule.server_sigmas(sampling, LATENT, 0, 0.5, 0, 0)
    np.testing.assert_array_equal(tail, np.asarray(fixed[-5:], dtype=np.float32))


def test_no_rule_and_no_sigmas_means_comfy_simple():
    sampling = {"steps": 8, "cfg": 3.0, "sigmas": None, "schedule": None}
    assert schedule.server_sigmas(sampling, LATENT, 0, 1.0, 512, 512) is None
    assert schedule.default_steps(sampling, 0) == 8
    assert schedule.cfg_of(sampling) == 3.0
    assert schedule.cfg_of(None) == 1.0


def test_flux2_rule_starts_at_one_and_ends_at_zero():
    sigmas = schedule.rule_sigmas({"rule": "flux2"}, 4, 4096)
    assert sigmas[0] == pytest.approx(1.0) and sigmas[-1] == 0.0 and len(sigmas) == 5


def test_unknown_rule_is_refused():
    with pytest.raises(schedule.ScheduleError, match="lacks"):
        schedule.rule_sigmas({"rule": "mystery"}, 4, 4096)
