"""The size-dependent sigma rules of docs/contract.md §5.3, written once for the server and
its clients (the ComfyUI pack's Sigmas node).

A server publishes a rule in status `sampling.schedule` as an object naming the rule and
carrying its constants; `rule_sigmas(rule, steps, tokens)` evaluates it in float32 for an image
of `tokens` latent tokens, giving steps + 1 sigmas that end in 0.0. A new rule is a function of
(rule, steps, tokens) added to `RULES`. Pure: numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np


class ScheduleError(ValueError):
    """A schedule that cannot be made: an unknown rule or too few steps for one."""


def qwen_image21_rule(
    base_len: int = 256,
    max_len: int = 8192,
    base_shift: float = 0.5,
    max_shift: float = 0.9,
    terminal: float = 0.02,
) -> dict:
    """The status object of the Qwen-Image 2.1 base rule (defaults: docs/contract.md §5.3)."""
    return {
        "rule": "qwen_image21",
        "base_len": base_len,
        "max_len": max_len,
        "base_shift": base_shift,
        "max_shift": max_shift,
        "terminal": terminal,
    }


def qwen_image21_sigmas(rule: dict[str, Any], steps: int, tokens: int) -> np.ndarray:
    """Dynamic exponential shift with a terminal stretch, as diffusers' FlowMatchEulerDiscrete
    scheduler computes it for the Qwen-Image 2.1 pipeline (mu in double, sigmas in float32)."""
    if steps < 2:
        raise ScheduleError("the qwen_image21 schedule needs at least 2 steps")
    base = np.linspace(1.0, 1.0 / steps, steps).astype(np.float32)
    slope = (rule["max_shift"] - rule["base_shift"]) / (rule["max_len"] - rule["base_len"])
    mu = tokens * slope + (rule["base_shift"] - slope * rule["base_len"])
    shift = np.float32(math.exp(mu))
    shifted = shift / (shift + (np.float32(1.0) / base - np.float32(1.0)))
    one_minus = np.float32(1.0) - shifted
    stretch = one_minus[-1] / (np.float32(1.0) - np.float32(rule["terminal"]))
    stretched = np.float32(1.0) - one_minus / stretch
    return np.append(stretched.astype(np.float32), np.float32(0.0))


def krea2_rule(
    base_len: int = 256, max_len: int = 6400, base_shift: float = 0.5, max_shift: float = 1.15
) -> dict:
    """The status object of the Krea 2 raw rule (Krea2Pipeline's `calculate_shift` constants
    from its scheduler config)."""
    return {
        "rule": "krea2",
        "base_len": base_len,
        "max_len": max_len,
        "base_shift": base_shift,
        "max_shift": max_shift,
    }


def krea2_sigmas(rule: dict[str, Any], steps: int, tokens: int) -> np.ndarray:
    """Dynamic exponential shift, as Krea2Pipeline's base checkpoint samples: numpy's linspace
    from 1 to 1/steps in float32, mu linear in the token count (double precision), then
    e^mu / (e^mu + (1/t - 1)) in float32 (diffusers' FlowMatchEulerDiscreteScheduler), 0 appended."""
    base = np.linspace(1.0, 1.0 / steps, steps).astype(np.float32)
    slope = (rule["max_shift"] - rule["base_shift"]) / (rule["max_len"] - rule["base_len"])
    mu = tokens * slope + (rule["base_shift"] - slope * rule["base_len"])
    shift = np.float32(math.exp(mu))
    shifted = shift / (shift + (np.float32(1.0) / base - np.float32(1.0)))
    return np.append(shifted.astype(np.float32), np.float32(0.0))


def flux2_mu(tokens: int, steps: int) -> float:
    """The `flux2` rule's shift exponent, fitted to the token count and the step count, in
    double precision (as BFL's and ComfyUI's `compute_empirical_mu`)."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    if tokens > 4300:
        return a2 * tokens + b2
    m_200 = a2 * tokens + b2
    m_10 = a1 * tokens + b1
    slope = (m_200 - m_10) / 190.0
    return slope * steps + (m_200 - 200.0 * slope)


def flux2_sigmas(rule: dict[str, Any], steps: int, tokens: int) -> np.ndarray:
    """The `flux2` rule (no constants): a shifted torch-style linspace from 1 to 0 with
    steps + 1 points, e^mu / (e^mu + (1/t - 1)) in float32 with e^mu rounded once from double,
    bit for bit as ComfyUI's Flux2Scheduler computes it in torch."""
    t = torch_linspace(1.0, 0.0, steps + 1)
    e_mu = np.float32(math.exp(flux2_mu(tokens, steps)))
    out = np.zeros_like(t)
    positive = t > 0
    with np.errstate(divide="ignore"):
        # torch's scalar / tensor is reciprocal(tensor) * scalar
        denominator = e_mu + (np.float32(1.0) / t[positive] - np.float32(1.0))
        out[positive] = (np.float32(1.0) / denominator) * e_mu
    return out.astype(np.float32)


def moss_image_rule(shift: float = 5.0, train_steps: int = 1000) -> dict:
    """The status object of MOSS-Image's rule: a static shift whose sigmas snap to the
    training grid (MOSSImageScheduler's constants)."""
    return {"rule": "moss_image", "shift": shift, "train_steps": train_steps}


def moss_image_sigmas(rule: dict[str, Any], steps: int, tokens: int) -> np.ndarray:
    """MOSS-Image's schedule (the size does not enter): torch's float32 linspace from 1 to
    shift / (train_steps + shift - 1) with `steps` points under the static shift
    s t / (1 + (s - 1) t), each sigma snapped to the nearest of the training grid's
    linspace(1, 1 / train_steps, train_steps) (the lower one on a tie), repeats dropped as
    torch's unique_consecutive drops them, then 0: so where two steps snap to one grid value
    the schedule has fewer than steps + 1 sigmas."""
    shift, total = float(rule["shift"]), int(rule["train_steps"])
    base = torch_linspace(1.0, shift / (total + shift - 1), steps)
    sigmas = (np.float32(shift) * base / (np.float32(1) + np.float32(shift - 1) * base)).astype(
        np.float32
    )
    grid = torch_linspace(1.0, 1.0 / total, total)[::-1].copy()  # ascending
    upper = np.clip(np.searchsorted(grid, sigmas, side="left"), None, total - 1)
    lower = np.clip(upper - 1, 0, None)
    nearer_lower = np.abs(sigmas - grid[lower]) <= np.abs(grid[upper] - sigmas)
    snapped = grid[np.where(nearer_lower, lower, upper)]
    kept = np.concatenate([[True], snapped[1:] != snapped[:-1]])
    return np.append(snapped[kept], np.float32(0.0)).astype(np.float32)


def torch_linspace(start: float, end: float, count: int) -> np.ndarray:
    """torch.linspace in float32, bit for bit: the first half steps up from `start`, the second
    half steps down from `end`, each value one fused multiply-add (torch's vectorised CPU
    kernel); a float32 product is exact in float64, so float64 then one rounding is that FMA."""
    if count == 1:
        return np.array([start], dtype=np.float32)
    step = np.float64((np.float32(end) - np.float32(start)) / np.float32(count - 1))
    index = np.arange(count, dtype=np.float64)
    half = count // 2
    out = np.empty(count, dtype=np.float32)
    out[:half] = (np.float64(np.float32(start)) + step * index[:half]).astype(np.float32)
    out[half:] = (np.float64(np.float32(end)) - step * (count - 1 - index[half:])).astype(
        np.float32
    )
    return out


def denoise_total(steps: int, denoise: float) -> int:
    """The step count a schedule is evaluated for when only its last `steps` steps run, at
    denoise (strength) below 1: int(steps / denoise), as ComfyUI's schedulers do (docs/contract.md
    §5.3). `keep_tail` then keeps the final steps + 1 sigmas."""
    return steps if denoise >= 1.0 else int(steps / denoise)


def keep_tail(sigmas: np.ndarray, steps: int) -> np.ndarray:
    """The final steps + 1 sigmas (how denoise < 1 shortens a schedule)."""
    return sigmas[-(steps + 1) :]


def fixed_tail(sigmas: np.ndarray, denoise: float) -> np.ndarray:
    """A variant's fixed schedule at denoise (strength) `denoise`: its last int(count x denoise)
    steps; empty when none is left (denoise 0)."""
    if denoise >= 1.0:
        return sigmas
    kept = int((len(sigmas) - 1) * denoise)
    return keep_tail(sigmas, kept) if kept >= 1 else np.zeros(0, dtype=np.float32)


# Rule name (status `sampling.schedule.rule`) -> its sigmas(rule, steps, tokens).
RULES: dict[str, Callable[[dict[str, Any], int, int], np.ndarray]] = {
    "qwen_image21": qwen_image21_sigmas,
    "flux2": flux2_sigmas,
    "krea2": krea2_sigmas,
    "moss_image": moss_image_sigmas,
}


def rule_sigmas(rule: dict[str, Any], steps: int, tokens: int) -> np.ndarray:
    """steps + 1 float32 sigmas of a status `sampling.schedule` object at `tokens` tokens."""
    evaluate = RULES.get(rule.get("rule"))
    if evaluate is None:
        raise ScheduleError(f"unknown schedule rule {rule.get('rule')!r}")
    return evaluate(rule, steps, tokens)
