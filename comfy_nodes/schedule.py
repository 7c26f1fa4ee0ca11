"""Sigma schedules of the gmlx Sigmas node (docs/contract.md §7.3, §5.3).

The size-dependent rules of §5.3 are the server's own, from `gmlx_contract.schedules` (the pack
never imports the server); this reads a status `sampling` row with them. Pure: numpy only.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from gmlx_contract import schedules
from gmlx_contract.schedules import ScheduleError


def rule_sigmas(rule: dict[str, Any], steps: int, tokens: int) -> np.ndarray:
    """Sigmas of a status `sampling.schedule` object for `steps` steps at `tokens` tokens."""
    name = rule.get("rule")
    if name not in schedules.RULES:
        raise ScheduleError(f"gmlx: the server names schedule rule {name!r}, which this pack lacks")
    return schedules.rule_sigmas(rule, steps, tokens)


def image_tokens(width: int, height: int, latent: dict[str, Any]) -> int:
    """tokens = (H // px) * (W // px) with px = latent stride * patch (docs/contract.md §5.3)."""
    px = int(latent.get("stride", 8)) * int(latent.get("patch", 1))
    return (height // px) * (width // px)


def fixed_sigmas(fixed: list[float], steps: int, denoise: float) -> np.ndarray:
    """A variant's fixed schedule: steps must be 0 or its count; denoise keeps the tail."""
    sigmas = np.asarray(fixed, dtype=np.float32)
    count = len(sigmas) - 1
    if steps not in (0, count):
        raise ScheduleError(
            f"gmlx: this model samples with its fixed {count}-step schedule; "
            f"set steps to 0 or {count}"
        )
    return schedules.fixed_tail(sigmas, denoise)


def server_sigmas(
    sampling: dict[str, Any] | None,
    latent: dict[str, Any],
    steps: int,
    denoise: float,
    width: int,
    height: int,
) -> np.ndarray | None:
    """The schedule the server's `sampling` settings give, or None when ComfyUI's own "simple"
    schedule is to be used (no fixed sigmas and no rule).

    `steps` 0 means the variant's step count. An empty array means nothing to sample
    (denoise 0), as ComfyUI's own schedulers answer.
    """
    sampling = sampling or {}
    if sampling.get("sigmas"):
        return fixed_sigmas(sampling["sigmas"], steps, denoise)
    steps = steps or int(sampling.get("steps") or 0)
    if steps < 1:
        raise ScheduleError("gmlx: give a step count of at least 1")
    rule = sampling.get("schedule")
    if not rule:
        return None
    if width <= 0 or height <= 0:
        raise ScheduleError(
            "gmlx: this model's schedule depends on the image size; set width and height "
            "on the gmlx Sigmas node"
        )
    if denoise <= 0.0:
        return np.zeros(0, dtype=np.float32)
    sigmas = rule_sigmas(
        rule, schedules.denoise_total(steps, denoise), image_tokens(width, height, latent)
    )
    return schedules.keep_tail(sigmas, steps)


def default_steps(sampling: dict[str, Any] | None, steps: int) -> int:
    """`steps`, or the variant's own count when 0 (at least 1)."""
    if steps:
        return steps
    sampling = sampling or {}
    if sampling.get("sigmas"):
        return len(sampling["sigmas"]) - 1
    return max(1, int(sampling.get("steps") or 1))


def cfg_of(sampling: dict[str, Any] | None) -> float:
    """The variant's cfg (`sampling.cfg`), 1.0 when the server gives none."""
    value = (sampling or {}).get("cfg")
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else 1.0
