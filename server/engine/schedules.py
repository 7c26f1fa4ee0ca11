"""Size-dependent sigma schedules (docs/contract.md §5.3), published in status `sampling.schedule`.

A rule object names its rule and carries its constants; `sigmas(rule, steps, tokens)` evaluates it
in float32 for an image of `tokens` latent tokens, giving steps + 1 sigmas that end in 0.0.
"""

from __future__ import annotations

import math

import numpy as np


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


def sigmas(rule: dict, steps: int, tokens: int, denoise: float = 1.0) -> np.ndarray:
    """steps + 1 float32 sigmas of `rule` for `tokens` latent tokens. With denoise < 1 the rule is
    evaluated for int(steps / denoise) steps and only the final steps + 1 sigmas are kept."""
    if not 0.0 < denoise <= 1.0:
        raise ValueError(f"denoise must lie in (0, 1], got {denoise}")
    total = steps if denoise >= 1.0 else int(steps / denoise)
    name = rule.get("rule")
    if name != "qwen_image21":
        raise ValueError(f"unknown schedule rule {name!r}")
    return qwen_image21_sigmas(rule, total, tokens)[-(steps + 1) :]


def qwen_image21_sigmas(rule: dict, steps: int, tokens: int) -> np.ndarray:
    """Dynamic exponential shift with a terminal stretch, as diffusers' FlowMatchEulerDiscrete
    scheduler computes it for the Qwen-Image 2.1 pipeline (mu in double, sigmas in float32)."""
    if steps < 2:
        raise ValueError("the qwen_image21 schedule needs at least 2 steps")
    base = np.linspace(1.0, 1.0 / steps, steps).astype(np.float32)
    slope = (rule["max_shift"] - rule["base_shift"]) / (rule["max_len"] - rule["base_len"])
    mu = tokens * slope + (rule["base_shift"] - slope * rule["base_len"])
    shift = np.float32(math.exp(mu))
    shifted = shift / (shift + (np.float32(1.0) / base - np.float32(1.0)))
    one_minus = np.float32(1.0) - shifted
    stretch = one_minus[-1] / (np.float32(1.0) - np.float32(rule["terminal"]))
    stretched = np.float32(1.0) - one_minus / stretch
    return np.append(stretched.astype(np.float32), np.float32(0.0))
