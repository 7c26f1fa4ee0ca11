"""ComfyUI's starting noise, in numpy: what `comfy.sample.prepare_noise` gives on the CPU.

ComfyUI draws its noise with `torch.manual_seed(seed)` and `torch.randn(shape,
dtype=float32, generator=..., device="cpu")`. Reproducing that here lets ComfyUI's stock
samplers and `gmlx image sample` start from the same latents at the same seed, without the
server importing torch. Torch's CPU algorithm (ATen `normal_kernel`, `normal_fill`):

* the generator is MT19937 seeded with the low 32 bits of the seed (the standard
  `init_genrand`, the same as numpy's legacy `RandomState` seeding);
* a float32 tensor of 16 or more contiguous values is first filled with 24-bit uniforms,
  `(word & 0xFFFFFF) * 2**-24`, one 32-bit word each; then each block of 16 becomes 16 normals
  by Box-Muller (`u1 = 1 - u[j]`, `u2 = u[j + 8]`, `r = sqrt(-2 log u1)`, `theta = 2 pi u2`,
  `out[j] = r cos theta`, `out[j + 8] = r sin theta`); when the size is not a multiple of 16,
  16 fresh uniforms are drawn and the last 16 values are recomputed from them;
* fewer than 16 values come one at a time from the double-precision Box-Muller (53-bit
  uniforms from two words each, pairs cached: cos first, then sin).

The transcendental functions decide the last bits. On x86-64 (torch built with its AVX2 and
AVX512 kernels) the block step uses `avx_mathfun.h`'s cephes polynomials in float32, with
the multiply-adds GCC fused into FMAs; kernel "vector" reproduces that bit for bit. Elsewhere
(Apple silicon, ARM Linux) torch calls the platform's `logf`/`cosf`/`sinf`; kernel "scalar"
rounds float64 results once to float32, which matches a libm whose float functions round
correctly and otherwise differs by one unit in the last place on a small share of values
(measured against glibc: about 1.5 %, at most 2.4e-7 absolute).
"""

from __future__ import annotations

import math
import platform
from collections.abc import Sequence

import numpy as np

KERNELS = ("vector", "scalar")
BLOCK = 16
HALF = BLOCK // 2
F32 = np.float32

# avx_mathfun.h constants (cephes), as float32 like the intrinsics' _ps256 tables.
SQRT_HALF = F32(0.707106781186547524)
LOG_POLY = tuple(
    F32(v)
    for v in (
        7.0376836292e-2,
        -1.1514610310e-1,
        1.1676998740e-1,
        -1.2420140846e-1,
        1.4249322787e-1,
        -1.6668057665e-1,
        2.0000714765e-1,
        -2.4999993993e-1,
        3.3333331174e-1,
    )
)
LOG_Q1, LOG_Q2 = F32(-2.12194440e-4), F32(0.693359375)
FOUR_OVER_PI = F32(1.27323954473516)
MINUS_DP = (F32(-0.78515625), F32(-2.4187564849853515625e-4), F32(-3.77489497744594108e-8))
COS_POLY = (F32(2.443315711809948e-005), F32(-1.388731625493765e-003), F32(4.166664568298827e-002))
SIN_POLY = (F32(-1.9515295891e-4), F32(8.3321608736e-3), F32(-1.6666654611e-1))
# normal_fill's `2.0f * c10::pi<double>` set into a float vector.
TWO_PI_F32 = F32(2.0 * math.pi)


def default_kernel(machine: str | None = None) -> str:
    """The kernel torch's CPU build uses on this machine: "vector" on x86-64, else "scalar"."""
    machine = (machine or platform.machine()).lower()
    return "vector" if machine in ("x86_64", "amd64", "x64") else "scalar"


def comfy_noise(seed: int, shape: Sequence[int], kernel: str | None = None) -> np.ndarray:
    """`torch.randn(shape, generator=torch.manual_seed(seed), dtype=float32)` on the CPU,
    as a float32 numpy array (ComfyUI's `prepare_noise` without batch indices)."""
    if kernel is None:
        kernel = default_kernel()
    if kernel not in KERNELS:
        raise ValueError(f"unknown noise kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
    shape = tuple(int(d) for d in shape)
    count = math.prod(shape)
    if count == 0:
        return np.zeros(shape, dtype=np.float32)
    if count < BLOCK:
        pairs = (count + 1) // 2
        return double_normals(mt19937_words(seed, 4 * pairs), count).reshape(shape)
    words = mt19937_words(seed, count + (BLOCK if count % BLOCK else 0))
    fill = vector_blocks if kernel == "vector" else scalar_blocks
    out = np.empty(count, dtype=np.float32)
    whole = count - count % BLOCK
    out[:whole] = fill(uniform24(words[:whole]).reshape(-1, BLOCK)).reshape(-1)
    if count % BLOCK:
        # normal_fill's tail rule: 16 fresh uniforms, and the last 16 values recomputed.
        out[count - BLOCK :] = fill(uniform24(words[count:]).reshape(1, BLOCK)).reshape(-1)
    return out.reshape(shape)


# ---------------------------------------------------------------- the generator


def mt19937_words(seed: int, count: int) -> np.ndarray:
    """The first `count` 32-bit outputs of torch's CPU generator after manual_seed(seed)."""
    legacy = np.random.RandomState(int(seed) & 0xFFFFFFFF)  # init_genrand, as torch's
    _, key, pos = legacy.get_state()[:3]
    generator = np.random.MT19937()
    generator.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": pos}}
    return generator.random_raw(count).astype(np.uint32)


def uniform24(words: np.ndarray) -> np.ndarray:
    """uniform_real_distribution<float>(0, 1): the low 24 bits times 2**-24 (exact)."""
    return (words & np.uint32(0xFFFFFF)).astype(np.float32) * F32(2.0**-24)


def double_normals(words: np.ndarray, count: int) -> np.ndarray:
    """normal_distribution<double> one value at a time, cast to float32: each pair of values
    takes two 53-bit uniforms (u1 for the angle, u2 for the radius) and gives cos, then sin."""
    pairs = (count + 1) // 2
    w = words[: pairs * 4].astype(np.uint64).reshape(pairs, 2, 2)
    bits = ((w[..., 0] << np.uint64(32)) | w[..., 1]) & np.uint64((1 << 53) - 1)
    uniforms = bits.astype(np.float64) * 2.0**-53
    u1, u2 = uniforms[:, 0], uniforms[:, 1]
    radius = np.sqrt(-2.0 * np.log1p(-u2))
    theta = 2.0 * math.pi * u1
    values = np.stack([radius * np.cos(theta), radius * np.sin(theta)], axis=1).reshape(-1)
    return values[:count].astype(np.float32)


# ---------------------------------------------------------------- Box-Muller blocks


def scalar_blocks(u: np.ndarray) -> np.ndarray:
    """normal_fill_16 with libm's float functions, each rounded once from float64."""
    u1 = F32(1.0) - u[:, :HALF]
    u2 = u[:, HALF:]
    log_u1 = np.log(u1.astype(np.float64)).astype(np.float32)
    radius = np.sqrt(F32(-2.0) * log_u1)
    theta = (2.0 * math.pi * u2.astype(np.float64)).astype(np.float32)  # double, then float
    cos = np.cos(theta.astype(np.float64)).astype(np.float32)
    sin = np.sin(theta.astype(np.float64)).astype(np.float32)
    return np.concatenate([radius * cos, radius * sin], axis=1)


def vector_blocks(u: np.ndarray) -> np.ndarray:
    """normal_fill_16_AVX2: log256_ps and sincos256_ps in float32, as compiled (with FMAs)."""
    u1 = F32(1.0) - u[:, :HALF]
    theta = TWO_PI_F32 * u[:, HALF:]
    radius = np.sqrt(F32(-2.0) * log_ps(u1))
    sin, cos = sincos_ps(theta)
    return np.concatenate([radius * cos, radius * sin], axis=1)


def fma(a, b, c) -> np.ndarray:
    """float32 fused multiply-add a * b + c with one rounding.

    The float32 product is exact in float64; the float64 sum is made round-to-odd (the exact
    error from TwoSum decides), so its one rounding to float32 is the correctly rounded FMA.
    """
    product = np.asarray(a, np.float64) * np.asarray(b, np.float64)
    addend = np.asarray(c, np.float64)
    total = product + addend
    virtual = total - product
    error = (product - (total - virtual)) + (addend - virtual)
    even = (total.view(np.int64) & 1) == 0
    toward = np.where(error > 0, np.inf, -np.inf)
    total = np.where(even & (error != 0), np.nextafter(total, toward), total)
    return total.astype(np.float32)


def log_ps(x: np.ndarray) -> np.ndarray:
    """log256_ps for x in (0, 1]: cephes logf on the mantissa in [sqrt(1/2), sqrt(2))."""
    bits = x.view(np.uint32)
    exponent = (bits >> np.uint32(23)).astype(np.int32) - 0x7F
    m = ((bits & np.uint32(0x807FFFFF)) | F32(0.5).view(np.uint32)).view(np.float32)
    e = exponent.astype(np.float32) + F32(1.0)
    small = m < SQRT_HALF
    e = e - np.where(small, F32(1.0), F32(0.0))
    m = (m - F32(1.0)) + np.where(small, m, F32(0.0))
    z = m * m
    y = np.full_like(m, LOG_POLY[0])
    for coefficient in LOG_POLY[1:]:
        y = fma(y, m, coefficient)
    y = y * m
    y = fma(y, z, e * LOG_Q1)  # GCC fuses the first product of `y*z + e*q1`
    y = y - z * F32(0.5)  # exact product: fused or not, the same
    return fma(e, LOG_Q2, m + y)


def sincos_ps(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """sincos256_ps: cephes sinf/cosf with the octant reduction of avx_mathfun.h."""
    negative = x < 0
    x = np.abs(x)
    octant = (x * FOUR_OVER_PI).astype(np.int32)  # truncation, as cvttps
    octant = (octant + 1) & ~1
    y = octant.astype(np.float32)
    for part in MINUS_DP:  # extended-precision reduction, each step one FMA
        x = fma(y, part, x)
    sin_negative = negative ^ ((octant & 4) != 0)
    cos_negative = (~(octant - 2) & 4) != 0
    use_sin_poly_for_sin = (octant & 2) == 0
    z = x * x
    cos_poly = fma(np.full_like(x, COS_POLY[0]), z, COS_POLY[1])
    cos_poly = fma(cos_poly, z, COS_POLY[2])
    cos_poly = cos_poly * z
    cos_poly = fma(cos_poly, z, -(z * F32(0.5))) + F32(1.0)
    sin_poly = fma(np.full_like(x, SIN_POLY[0]), z, SIN_POLY[1])
    sin_poly = fma(sin_poly, z, SIN_POLY[2])
    sin_poly = fma(sin_poly * z, x, x)
    sin = np.where(use_sin_poly_for_sin, sin_poly, cos_poly)
    cos = np.where(use_sin_poly_for_sin, cos_poly, sin_poly)
    return np.where(sin_negative, -sin, sin), np.where(cos_negative, -cos, cos)
