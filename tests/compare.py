"""How the tests compare an output with its reference."""

from __future__ import annotations

import numpy as np


def rel_l2(actual, expected) -> float:
    """‖actual − expected‖ / ‖expected‖ in float64 (a zero `expected` gives a huge figure, not
    a NaN, so a bound still fails)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30))
