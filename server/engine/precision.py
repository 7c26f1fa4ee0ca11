"""A model's configured precision: MLX affine quantization's bits and group size, and the
compute dtype of its text encoder and VAE (`encoder_vae_dtype`).

Plain Python, neither MLX nor numpy: the configuration and the command lines read it before the
process sets MLX up (server/process.py). engine/quantize.py applies it at load.
"""

from __future__ import annotations

from dataclasses import dataclass

# What MLX's affine quantization takes and the project offers (`mx.quantize`).
BITS = (3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 64
MODE = "affine"
# A model entry's `encoder_vae_dtype`: `auto` (nn.dtypes.encoder_vae_dtype's rule for the
# backend) or a dtype by its status name.
AUTO = "auto"
ENCODER_VAE_DTYPES = (AUTO, "f32", "bf16", "f16")


@dataclass(frozen=True)
class Quantization:
    """Quantize the family's chosen linear layers to `bits` per weight, one scale and bias per
    `group_size` input columns. A ValueError names a value outside BITS or GROUP_SIZES."""

    bits: int
    group_size: int = DEFAULT_GROUP_SIZE

    def __post_init__(self) -> None:
        if type(self.bits) is not int or self.bits not in BITS:
            raise ValueError(f"quantize must be one of {_listed(BITS)} bits, not {self.bits!r}")
        if type(self.group_size) is not int or self.group_size not in GROUP_SIZES:
            raise ValueError(
                f"group_size must be one of {_listed(GROUP_SIZES)}, not {self.group_size!r}"
            )

    def status(self) -> dict:
        """As a model's status reports it (docs/contract.md §2.3, an extension)."""
        return {"bits": self.bits, "group_size": self.group_size, "mode": MODE}


def _listed(values: tuple[int, ...]) -> str:
    return ", ".join(str(v) for v in values)
