"""ComfyUI's `uni_pc_bh2` sampler, for the in-process sampler (`engine/sampling.py`).

UniPC (Zhao et al. 2023) as ComfyUI runs it (`comfy/extra_samplers/uni_pc.py`,
`sample_unipc(..., variant="bh2")`): data prediction, B(h) = e^h - 1, multistep of order
min(3, steps - 1) with lower orders while the history fills and at the end, a corrector after
every model call but the last update, and the final sigma 0 replaced by 0.001 (so a trace of
noise is left, as in ComfyUI). ComfyUI treats every model as a variance-preserving one with
alpha = 1/sqrt(1 + sigma^2) and log-SNR lambda = -log(sigma); written back in the sampler's own
latents (x = x0 + sigma * eps in k-diffusion terms, which for a flow model is the flow latent,
because the model's denoised output there is x - sigma * v) its update from sigma_s to sigma_t is

    x_t = (sigma_t / sigma_s) x_s - phi * D_s - phi * sum_k rho_k * D1_k,   phi = e^-h - 1,

with h = lambda_t - lambda_s, D the denoised predictions of the model calls so far and
D1_k = (D_k - D_s) / r_k their differences over the log-SNR ratios r_k. The model is called at
the predicted x_t; the corrector then recomputes x_t with that call's D included, and the call's
D (not a call at the corrected x_t) enters the history. So a schedule of n steps makes n model
calls, like Euler. Coefficients are worked out in float64 and applied to float32 arrays. At
the end the latents are divided by 1 - 0.001, as ComfyUI's sampler wrapper does for a flow model
(`UniPCSteps._unscaled`). ComfyUI's KSampler node also drops the penultimate sigma of a schedule
made one step longer for uni_pc; that is the caller's schedule, not this update rule.

tests/sampling/test_unipc.py checks it against the exact solution of a Gaussian problem (third
order) and, given a ComfyUI checkout, against ComfyUI's own module.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

NAME = "uni_pc_bh2"
MAX_ORDER = 3
# ComfyUI's stand-in for a final sigma of 0 (its log-SNR would be infinite).
FINAL_SIGMA = 0.001


@dataclass(frozen=True)
class Update:
    """One UniPC update from the last history entry's sigma to `sigma`."""

    ratio: float  # sigma_t / sigma_s
    phi: float  # e^-h - 1, which is also B(h) for bh2
    differences: tuple[float, ...]  # 1 / r_k for the history entries before the last, newest first
    predictor: tuple[float, ...]  # rho_k of the predictor (empty for order 1)
    corrector: tuple[float, ...]  # rho_k of the corrector, the new call's weight last


def update(lambdas: list[float], sigma_s: float, sigma_t: float, order: int) -> Update:
    """The coefficients of an update of `order` (1..3) from sigma_s to sigma_t, given the log-SNRs
    of the history (oldest first, the last one sigma_s's)."""
    lambda_s = lambdas[-1]
    h = log_snr(sigma_t) - lambda_s
    hh = -h
    phi = math.expm1(hh)
    ratios = [(lambdas[-(k + 1)] - lambda_s) / h for k in range(1, order)] + [1.0]
    rows, b = [], []
    phi_k, factorial = phi / hh - 1.0, 1
    for i in range(1, order + 1):
        rows.append([r ** (i - 1) for r in ratios])
        b.append(phi_k * factorial / phi)
        factorial *= i + 1
        phi_k = phi_k / hh - 1.0 / factorial
    matrix, b = np.array(rows), np.array(b)
    if order == 1:
        predictor: tuple[float, ...] = ()
    elif order == 2:
        predictor = (0.5,)
    else:
        predictor = tuple(np.linalg.solve(matrix[:-1, :-1], b[:-1]).tolist())
    corrector = (0.5,) if order == 1 else tuple(np.linalg.solve(matrix, b).tolist())
    return Update(
        ratio=sigma_t / sigma_s,
        phi=phi,
        differences=tuple(1.0 / r for r in ratios[:-1]),
        predictor=predictor,
        corrector=corrector,
    )


def followed_sigmas(sigmas: np.ndarray) -> list[float]:
    """The sigmas the sampler steps along (a final 0 becomes 0.001), or a ValueError saying why
    it cannot follow this schedule."""
    followed = [float(s) for s in np.asarray(sigmas, dtype=np.float32)]
    if len(followed) < 3:
        raise ValueError(f"{NAME} needs at least 2 steps")
    if followed[-1] == 0.0:
        followed[-1] = FINAL_SIGMA
    if any(later >= earlier for earlier, later in itertools.pairwise(followed)):
        raise ValueError(f"{NAME} needs falling sigmas")
    if followed[-1] <= 0.0:
        raise ValueError(f"{NAME} needs positive sigmas before the last")
    return followed


def log_snr(sigma: float) -> float:
    return -math.log(sigma)


class UniPCSteps:
    """The update rule of `sampling.sample` for uni_pc_bh2: for step i, `model_input(i)` is the
    x to call the model at sigmas[i], and `advance(i, velocity)` takes that call's (guided)
    velocity and returns the sampler's latents after the step (the final ones after the last).
    """

    def __init__(self, x: np.ndarray, sigmas: np.ndarray):
        steps = len(sigmas) - 1
        self.sigmas = followed_sigmas(sigmas)
        self.stretched_end = float(sigmas[-1]) == 0.0
        self.steps = steps
        self.order = min(MAX_ORDER, steps - 1)
        self.x = x
        self.history: list[tuple[float, np.ndarray]] = []  # (log-SNR, denoised), oldest first
        self.called_at = x  # the latents of the step's model call
        self.pending: tuple[Update, np.ndarray, list[np.ndarray]] | None = None

    def model_input(self, i: int) -> np.ndarray:
        if i == 0:
            self.called_at = self.x
        else:
            plan = self._update_to(i)
            base = self._base(plan)
            self.pending = (plan, base, self._differences(plan))
            self.called_at = self._combine(base, plan, plan.predictor, self.pending[2])
        return self.called_at

    def advance(self, i: int, velocity: np.ndarray) -> np.ndarray:
        # The model's denoised prediction, as ComfyUI's flow models give it: x - sigma * v.
        sigma = np.float32(self.sigmas[i])
        denoised = (self.called_at - sigma * velocity).astype(np.float32)
        if i > 0:
            plan, base, differences = self.pending
            latest = (denoised - self.history[-1][1]).astype(np.float32)
            self.x = self._combine(base, plan, plan.corrector, differences + [latest])
        self.history = [*self.history, (log_snr(self.sigmas[i]), denoised)][-self.order :]
        if i == self.steps - 1:
            final = self._update_to(self.steps)
            self.x = self._unscaled(self._combine(self._base(final), final, (), []))
        return self.x

    def _unscaled(self, x: np.ndarray) -> np.ndarray:
        """ComfyUI's last act: its uni_pc writes 0.001 into the caller's sigmas, so the sampler
        wrapper then treats the result as a flow latent at that sigma, (1 - sigma) x0 + sigma eps,
        and divides it by 1 - sigma (`inverse_noise_scaling`); 0.1 % on every value."""
        if self.stretched_end:
            return (x / (np.float32(1.0) - np.float32(FINAL_SIGMA))).astype(np.float32)
        return x

    def _update_to(self, target: int) -> Update:
        """The update to sigmas[target]: of a lower order while the history fills, and towards
        the end (ComfyUI's `lower_order_final`)."""
        if target < self.order:
            order = target
        else:
            order = min(self.order, self.steps + 1 - target)
        lambdas = [entry[0] for entry in self.history]
        return update(lambdas, self.sigmas[target - 1], self.sigmas[target], order)

    def _base(self, plan: Update) -> np.ndarray:
        """(sigma_t / sigma_s) x_s - phi D_s: the first-order update."""
        last = self.history[-1][1]
        return (np.float32(plan.ratio) * self.x - np.float32(plan.phi) * last).astype(np.float32)

    def _differences(self, plan: Update) -> list[np.ndarray]:
        """D1_k = (D_k - D_s) / r_k for the entries before the last, newest first."""
        last = self.history[-1][1]
        older = self.history[-2::-1]
        return [
            (np.float32(inverse) * (denoised - last)).astype(np.float32)
            for inverse, (_, denoised) in zip(plan.differences, older, strict=False)
        ]

    @staticmethod
    def _combine(base, plan: Update, rhos, differences) -> np.ndarray:
        """base - phi * sum_k rho_k D1_k."""
        if not rhos:
            return base
        total = sum(np.float32(rho) * d for rho, d in zip(rhos, differences, strict=True))
        return (base - np.float32(plan.phi) * total).astype(np.float32)
