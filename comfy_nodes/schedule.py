"""Sigma schedules of the gmlx Sigmas node (docs/contract.md §7.3, §5.3).

The pack must not import the server, so the two size-dependent rules of §5.3 are written here
once more, in numpy float32; tests/comfy checks them against the server's own where it exists.
Pure: numpy only.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


class ScheduleError(ValueError):
    """A schedule request the model's sampling settings cannot satisfy."""


def _f32(value: float) -> np.float32:
    return np.float32(value)


def flux2_sigmas(steps: int, tokens: int) -> np.ndarray:
    """The `flux2` rule: shifted torch-style linspace from 1 to 0 with steps + 1 points."""
    t = _torch_linspace(1.0, 0.0, steps + 1)
    a1, b1 = _f32(8.73809524e-05), _f32(1.89833333)
    a2, b2 = _f32(0.00016927), _f32(0.45666666)
    tokens32 = _f32(tokens)
    if tokens > 4300:
        mu = a2 * tokens32 + b2
    else:
        m_200 = a2 * tokens32 + b2
        m_10 = a1 * tokens32 + b1
        slope = (m_200 - m_10) / _f32(190.0)
        intercept = m_200 - _f32(200.0) * slope
        mu = slope * _f32(steps) + intercept
    e_mu = np.exp(mu, dtype=np.float32)
    out = np.zeros_like(t)
    positive = t > 0
    with np.errstate(divide="ignore"):
        out[positive] = e_mu / (e_mu + (_f32(1.0) / t[positive] - _f32(1.0)))
    return out.astype(np.float32)


def _torch_linspace(start: float, end: float, count: int) -> np.ndarray:
    """torch.linspace in float32, bit for bit: the first half steps up from `start`, the second
    half steps down from `end`, each value one fused multiply-add (torch's vectorised CPU
    kernel); a float32 product is exact in float64, so float64 then one rounding is that FMA."""
    if count == 1:
        return np.array([start], dtype=np.float32)
    step = np.float64((_f32(end) - _f32(start)) / _f32(count - 1))
    index = np.arange(count, dtype=np.float64)
    half = count // 2
    out = np.empty(count, dtype=np.float32)
    out[:half] = (np.float64(_f32(start)) + step * index[:half]).astype(np.float32)
    out[half:] = (np.float64(_f32(end)) - step * (count - 1 - index[half:])).astype(np.float32)
    return out


def qwen_image21_sigmas(steps: int, tokens: int, rule: dict[str, Any]) -> np.ndarray:
    """The `qwen_image21` rule: dynamic shift with a terminal stretch, then a final 0."""
    if steps < 2:
        raise ScheduleError("the qwen_image21 schedule needs at least 2 steps")
    base = np.linspace(1.0, 1.0 / steps, steps, dtype=np.float32)
    base_len, max_len = _f32(rule["base_len"]), _f32(rule["max_len"])
    base_shift, max_shift = _f32(rule["base_shift"]), _f32(rule["max_shift"])
    m = (max_shift - base_shift) / (max_len - base_len)
    mu = _f32(tokens) * m + (base_shift - m * base_len)
    e_mu = np.exp(mu, dtype=np.float32)
    s = e_mu / (e_mu + (_f32(1.0) / base - _f32(1.0)))
    z = _f32(1.0) - s
    k = z[-1] / (_f32(1.0) - _f32(rule["terminal"]))
    s = _f32(1.0) - z / k
    return np.append(s, _f32(0.0)).astype(np.float32)


def rule_sigmas(rule: dict[str, Any], steps: int, tokens: int) -> np.ndarray:
    """Sigmas of a status `sampling.schedule` object for `steps` steps at `tokens` tokens."""
    name = rule.get("rule")
    if name == "flux2":
        return flux2_sigmas(steps, tokens)
    if name == "qwen_image21":
        return qwen_image21_sigmas(steps, tokens, rule)
    raise ScheduleError(f"gmlx: the server names schedule rule {name!r}, which this pack lacks")


def image_tokens(width: int, height: int, latent: dict[str, Any]) -> int:
    """tokens = (H // px) * (W // px) with px = latent stride * patch (docs/contract.md §5.3)."""
    px = int(latent.get("stride", 8)) * int(latent.get("patch", 1))
    return (height // px) * (width // px)


def keep_tail(sigmas: np.ndarray, steps: int) -> np.ndarray:
    """The final steps + 1 sigmas (how denoise < 1 shortens a schedule)."""
    return sigmas[-(steps + 1) :]


def fixed_sigmas(fixed: list[float], steps: int, denoise: float) -> np.ndarray:
    """A variant's fixed schedule: steps must be 0 or its count; denoise keeps the tail."""
    sigmas = np.asarray(fixed, dtype=np.float32)
    count = len(sigmas) - 1
    if steps not in (0, count):
        raise ScheduleError(
            f"gmlx: this model samples with its fixed {count}-step schedule; "
            f"set steps to 0 or {count}"
        )
    if denoise >= 1.0:
        return sigmas
    kept = int(count * denoise)
    if kept < 1:
        return np.zeros(0, dtype=np.float32)
    return keep_tail(sigmas, kept)


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
    total = steps if denoise >= 1.0 else int(steps / denoise)
    sigmas = rule_sigmas(rule, total, image_tokens(width, height, latent))
    return keep_tail(sigmas, steps)


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
