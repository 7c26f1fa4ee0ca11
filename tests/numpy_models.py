"""What the tests' numpy image models share of the ImageModel seam (tests only; the product
ships no fake model).

Each member is written out here, none inherited from the product, so a member the seam gains
and these models lack fails the registry's load. A model gives its family, its facts, its
status' `comfy` and `sampling`, its manifest's tensors and its own arithmetic (`step`: a
step's inputs and its StepCall).
"""

from __future__ import annotations

import numpy as np
from gmlx_server.engine.base import Capabilities, StepCall, StepResult
from gmlx_server.engine.spec import Family, FamilySpec


def numpy_family(name: str, title: str, identify, load) -> Family:
    """A family of these models as the registry takes it: its spec (the step and VAE routes'
    features every one of them has; no quantization, no encoder and VAE dtype, no weight
    files) and a Family that loads and says nothing from the files."""
    spec = FamilySpec(
        name=name,
        title=title,
        identify=identify,
        features=("prefix_cache", "noise_mask", "rgba_vae", "tiled_vae"),
        quantizes=False,
        encoder_vae_dtype=False,
    )
    return Family(spec, load)


class NumpyImageModel:
    capabilities = Capabilities()
    weight_bytes = 0  # status memory.dit_bytes
    # an encoder that is never released
    encoder_bytes = 0
    encoder_resident = True
    encoder_releasable = False
    comfy: dict = {}  # status `comfy`
    tensors: tuple[dict, ...] = ()  # the manifest's tensors

    def release_encoder(self) -> int:
        return 0

    def denoise_step(self, x, timestep, rows, **how) -> StepResult:
        """The seam's step, its keywords (StepCall's fields, its defaults theirs) handed to the
        model's own `step` as one StepCall."""
        return self.step(x, timestep, rows, StepCall(**how))

    def sampling(self) -> dict | None:
        """Status `sampling`."""
        return None

    def status(self) -> dict:
        return {
            "comfy": self.comfy,
            "latent": {
                "channels": self.facts.latent_channels,
                "stride": self.facts.latent_stride,
                "patch": 1,
            },
            # one space: the VAE routes' latents are the step's (no normalisation)
            "vae": {
                "channels_out": self.facts.vae_channels_out,
                "stride": self.facts.vae_stride,
                "space": "model",
            },
            "edit_capable": self.facts.edit_capable,
            "sampling": self.sampling(),
            "compute_dtype": "f32",
            "memory": {"dit_bytes": self.weight_bytes, "encoder_bytes": 0, "vae_bytes": 0},
        }

    def manifest(self) -> dict:
        return {
            "family": self.family,
            "naming": "diffusers",
            "arch": None,
            "count": len(self.tensors),
            "tensors": list(self.tensors),
            "inline": {},
        }

    # memory plan: x and the output in float32, one image's pixels; nothing held to shed
    def held_bytes(self) -> int:
        return 0

    def plan_step(self, x_shape, rows, table=None):
        return None

    def step_peak_bytes(self, x_shape, rows, table=None, plans=None) -> int:
        return 2 * 4 * int(np.prod(x_shape))

    def step_keys(self, x_shape, rows, table=None, plans=None) -> set:
        return set()

    def vae_peak_bytes(self, height: int, width: int, decode: bool, tiled: bool = False) -> int:
        return 4 * self.facts.vae_channels_out * height * width

    def vae_tileable(self, height: int, width: int, decode: bool) -> bool:
        return False

    def shed_states(self, need_bytes: int, keep: set) -> int:
        return 0

    def ref_cache_bytes(self, rows, table, run: str) -> int:
        return 0

    def state_keys(self) -> list:
        return []

    def keep_states(self, keys) -> None:
        """Nothing is held."""

    def vae_space(self, latents: np.ndarray) -> np.ndarray:
        """Status `vae.space` is "model": the VAE takes the step's latents."""
        return np.asarray(latents, np.float32)

    def model_space(self, latents: np.ndarray) -> np.ndarray:
        """Status `vae.space` is "model": the VAE gives the step's latents."""
        return np.asarray(latents, np.float32)
