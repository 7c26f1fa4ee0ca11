"""How a model loads, as its model entry says (`[models."id"]` in the configuration, or the
flags of a command that loads a folder directly): its quantization, its text encoder's and
VAE's compute dtype, and the GGUF files its components' weights come from.

One object, `LoadSettings`, is what a load takes: the registry turns it into the family's
`load` keywords (`options`) on one process, and a rank group hands the same object to every
rank (server/distributed.py), each loading its part with it. Plain Python, neither MLX nor
numpy: the configuration and the command lines build it before the process sets MLX up.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from .precision import AUTO, Quantization

# How a GGUF file's quantized linear weights are held (`GMLX_GGUF_WEIGHTS`, engine/gguf.py):
# the file's own blocks (the default), or MLX's affine quantization.
GGUF_WEIGHTS_SETTING = "GMLX_GGUF_WEIGHTS"
GGUF_WEIGHTS = ("blocks", "affine")


def gguf_weights(value: str | None) -> str:
    """The setting's value (None: the default), checked."""
    held = (value or GGUF_WEIGHTS[0]).strip().lower()
    if held not in GGUF_WEIGHTS:
        raise ValueError(f"{GGUF_WEIGHTS_SETTING} must be blocks or affine, not {value!r}")
    return held


# `gmlx model quantize --kquant`'s presets, llama.cpp's names (engine/kquant_folder.py).
KQUANT_PRESETS = ("q4_k_m", "q5_k_m", "q6_k", "q8_0")

# The components whose weights a model entry may name a file for, by the family's `load`
# keyword: the DiT, the text encoder, and its vision tower (llama.cpp's mmproj).
FILE_KEYS = ("dit", "text_encoder", "mmproj")


@dataclass
class LoadSettings:
    """A model's load settings; the defaults load it as its folder stores it."""

    quantization: Quantization | None = None  # `quantize` and `group_size`
    encoder_vae_dtype: str = AUTO  # one of precision.ENCODER_VAE_DTYPES
    dit: Path | None = None  # a GGUF (or a single safetensors) file holding the DiT's weights
    text_encoder: Path | None = None  # a GGUF file holding the text encoder's weights
    mmproj: Path | None = None  # the GGUF file of its vision tower (llama.cpp's mmproj)

    def files(self) -> dict[str, Path]:
        """The weight files named, by component (`dit`, `text_encoder`, `mmproj`)."""
        named = {key: getattr(self, key) for key in FILE_KEYS}
        return {key: path for key, path in named.items() if path is not None}

    def options(self) -> dict:
        """The family `load` keywords of the settings that differ from the folder's own: the
        files named, the quantization and the dtype where set."""
        options: dict = dict(self.files())
        if self.quantization is not None:
            options["quantization"] = self.quantization
        if self.encoder_vae_dtype != AUTO:
            options["encoder_vae_dtype"] = self.encoder_vae_dtype
        return options

    def load_settings(self) -> LoadSettings:
        """These settings alone (a subclass's other fields, such as an entry's adapters, left
        out): what travels to the ranks of a group."""
        return LoadSettings(
            **{field.name: getattr(self, field.name) for field in dataclasses.fields(LoadSettings)}
        )

    def dit_part(self) -> LoadSettings:
        """What a rank that holds only a part of the DiT loads with (a rank other than 0 of a
        group): the DiT's file and the quantization; the text encoder's files and the encoder
        and VAE dtype are rank 0's."""
        return LoadSettings(quantization=self.quantization, dit=self.dit)
