"""The shared sigma rules of docs/contract.md §5.3 (gmlx_contract.schedules), which the server
publishes and the ComfyUI pack evaluates."""

import numpy as np
import pytest
import torch
from gmlx_contract import schedules

QWEN_RULE = schedules.qwen_image21_rule()


@pytest.mark.parametrize("count", [2, 3, 5, 9, 21, 51])
def test_linspace_is_torch_bit_for_bit(count):
    ours = schedules.torch_linspace(1.0, 0.0, count)
    theirs = torch.linspace(1.0, 0.0, count, dtype=torch.float32).numpy()
    assert ours.tobytes() == theirs.tobytes()


def test_qwen_rule_shape_and_ends():
    sigmas = schedules.rule_sigmas(QWEN_RULE, 10, 4096)
    assert sigmas.dtype == np.float32 and len(sigmas) == 11
    assert sigmas[0] == pytest.approx(1.0) and sigmas[-1] == 0.0
    # the terminal stretch puts the last non-zero sigma at 1 - (1 - terminal) = terminal
    assert sigmas[-2] == pytest.approx(0.02, rel=1e-5)
    assert np.all(np.diff(sigmas) < 0)


def test_qwen_rule_needs_two_steps():
    with pytest.raises(schedules.ScheduleError, match="at least 2 steps"):
        schedules.rule_sigmas(QWEN_RULE, 1, 4096)


def test_flux2_rule_starts_at_one_ends_at_zero_and_falls():
    sigmas = schedules.rule_sigmas({"rule": "flux2"}, 4, 4096)
    assert sigmas[0] == pytest.approx(1.0) and sigmas[-1] == 0.0 and len(sigmas) == 5
    assert np.all(np.diff(sigmas) < 0)


def test_flux2_shift_grows_with_the_image_up_to_its_fitted_range():
    small = schedules.rule_sigmas({"rule": "flux2"}, 8, 256)
    large = schedules.rule_sigmas({"rule": "flux2"}, 8, 4096)
    assert np.all(large[1:-1] > small[1:-1])


def test_an_unknown_rule_is_refused_by_name():
    with pytest.raises(schedules.ScheduleError, match="'mystery'"):
        schedules.rule_sigmas({"rule": "mystery"}, 4, 4096)
