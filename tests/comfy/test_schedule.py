"""The gmlx Sigmas node's schedules (docs/contract.md §5.3, §7.3)."""

import numpy as np
import pytest
from gmlx_comfy import schedule
from gmlx_contract import schedules

QWEN_RULE = {
    "rule": "qwen_image21",
    "base_len": 256,
    "max_len": 8192,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "terminal": 0.02,
}
LATENT = {"channels": 64, "stride": 16, "patch": 1}


def test_pack_schedules_match_the_server_where_present():
    server = pytest.importorskip("gmlx_server.engine.schedules")
    for steps, tokens, denoise in [(2, 256, 1.0), (8, 4096, 1.0), (40, 4096, 0.5), (30, 9000, 0.3)]:
        side = int(tokens**0.5) * 16
        sampling = {"steps": 40, "sigmas": None, "schedule": QWEN_RULE}
        ours = schedule.server_sigmas(sampling, LATENT, steps, denoise, side, tokens // side * 256)
        tokens = schedule.image_tokens(side, tokens // side * 256, LATENT)
        theirs = np.asarray(server.sigmas(QWEN_RULE, steps, tokens, denoise), dtype=np.float32)
        np.testing.assert_array_equal(ours, theirs)


def test_rule_needs_width_and_height():
    sampling = {"steps": 40, "cfg": 4.0, "sigmas": None, "schedule": QWEN_RULE}
    with pytest.raises(schedule.ScheduleError, match="width and height"):
        schedule.server_sigmas(sampling, LATENT, 0, 1.0, 0, 0)


def test_rule_uses_tokens_of_the_size_and_variant_steps():
    sampling = {"steps": 12, "cfg": 4.0, "sigmas": None, "schedule": QWEN_RULE}
    got = schedule.server_sigmas(sampling, LATENT, 0, 1.0, 1024, 768)
    want = schedules.qwen_image21_sigmas(QWEN_RULE, 12, (768 // 16) * (1024 // 16))
    np.testing.assert_array_equal(got, want)


def test_denoise_evaluates_longer_schedule_and_keeps_tail():
    sampling = {"steps": 40, "sigmas": None, "schedule": QWEN_RULE}
    got = schedule.server_sigmas(sampling, LATENT, 10, 0.5, 512, 512)
    full = schedules.qwen_image21_sigmas(QWEN_RULE, 20, 1024)
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
