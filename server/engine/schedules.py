"""Size-dependent sigma schedules (docs/contract.md §5.3), published in status `sampling.schedule`.

The rules themselves live in `gmlx_contract.schedules`, shared with the clients; this adds the
server's `denoise` reading of them.
"""

from __future__ import annotations

import numpy as np
from gmlx_contract.schedules import rule_sigmas


def sigmas(rule: dict, steps: int, tokens: int, denoise: float = 1.0) -> np.ndarray:
    """steps + 1 float32 sigmas of `rule` for `tokens` latent tokens. With denoise < 1 the rule is
    evaluated for int(steps / denoise) steps and only the final steps + 1 sigmas are kept."""
    if not 0.0 < denoise <= 1.0:
        raise ValueError(f"denoise must lie in (0, 1], got {denoise}")
    total = steps if denoise >= 1.0 else int(steps / denoise)
    return rule_sigmas(rule, total, tokens)[-(steps + 1) :]
