"""A component set in a ComfyUI `models/` folder, for the tests of models served from component
files (engine/components.py): its files by component (`ComfySet`: written, named, made into the
folder the server makes of it, listed, refused with a narrower Qwen3-VL), the configs that
folder is told against the model's own, and what a set's model serves against what its
diffusers folder serves."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

# The folders a set's files sit in, by component.
SET_FOLDERS = {"dit": "diffusion_models", "text_encoder": "text_encoders", "vae": "vae"}


@dataclass(frozen=True)
class ComfySet:
    """A set's file names, by component, in a ComfyUI `models/` folder."""

    dit: str
    text_encoder: str
    vae: str

    def path(self, models: Path, component: str) -> Path:
        """Where the component's file of the set sits in `models`."""
        return models / SET_FOLDERS[component] / asdict(self)[component]

    def write(self, root: Path, **states) -> Path:
        """root/ComfyUI/models, its set folders made and each of `states` (component ->
        tensors) written as that component's safetensors file; returns the models folder."""
        from safetensors.numpy import save_file

        models = Path(root) / "ComfyUI" / "models"
        for name in SET_FOLDERS.values():
            (models / name).mkdir(parents=True)
        for component, state in states.items():
            save_file(state, str(self.path(models, component)))
        return models

    def files(self, models: Path, **changes):
        """The set's ComponentFiles in `models`, `changes` (component -> path, or the entry's
        other fields) in their place."""
        from gmlx_server.engine.components import ComponentFiles

        named = {component: self.path(models, component) for component in SET_FOLDERS}
        return ComponentFiles(**{**named, **changes})

    def folder(self, models: Path, tmp_path: Path, **changes) -> Path:
        """The folder the server makes of the set (engine/components.py) under tmp_path,
        `changes` as `files` takes them."""
        return made_folder(self.files(models, **changes), tmp_path)

    def assert_refuses_a_narrow_qwen3_vl(self, folder: Path, models: Path, tmp_path: Path):
        """The set with its Qwen3-VL text encoder 32 wide (the model folder's, its token table
        narrowed) where the DiT reads 64 is refused, naming both widths."""
        import pytest
        from gmlx_server.engine.components import ComponentError
        from safetensors.numpy import save_file

        from tests.engine.comfy_files import float32_weights

        narrow = tmp_path / "narrow.safetensors"
        encoder = float32_weights(folder / "text_encoder")
        encoder["language_model.embed_tokens.weight"] = np.zeros((10, 32), np.float32)
        save_file(encoder, str(narrow))
        with pytest.raises(ComponentError, match="not a Qwen3-VL text encoder 64 wide.*32 wide"):
            self.folder(models, tmp_path, text_encoder=narrow)

    def listed_in(self, models: Path) -> bool:
        """Whether the ComfyUI `models/` folder lists the set (named by its files' names less
        their endings), as the server lists ComfyUI's folders."""
        from gmlx_server.engine import components
        from gmlx_server.engine.spec import family_specs

        folders = {
            key: [models / name for name in names]
            for key, names in components.COMFY_FOLDERS.items()
        }
        set_id = " + ".join(Path(name).stem for name in asdict(self).values())
        return set_id in components.comfy_sets(folders, family_specs())


def made_folder(files, tmp_path: Path) -> Path:
    """The folder the server makes of a set's ComponentFiles, under tmp_path."""
    from gmlx_server.engine import components
    from gmlx_server.engine.spec import family_specs

    return components.set_folder(files, family_specs(), tmp_path / "sets")


def differing_keys(made: Path, folder: Path, component: str, nested: str | None = None) -> set:
    """The keys of a component's config that a set's folder (`made`) writes with another value
    than the model's own `folder` (within `nested`, such as a text encoder's text_config); keys
    the model's folder lacks, and those starting with _, aside."""
    from gmlx_server.engine.spec import read_config

    told, written = read_config(made / component), read_config(folder / component)
    if nested is not None:
        told, written = told[nested], written[nested]
    return {k for k in told if k in written and told[k] != written[k] and not k.startswith("_")}


def differing_configs(made: Path, folder: Path) -> dict[str, set]:
    """differing_keys of the transformer's and the VAE's configs and of the text encoder's
    text_config (a Qwen3-VL or Qwen3.5 encoder's), for the components with any."""
    differing = {
        "transformer": differing_keys(made, folder, "transformer"),
        "vae": differing_keys(made, folder, "vae"),
        "text_encoder": differing_keys(made, folder, "text_encoder", "text_config"),
    }
    return {component: keys for component, keys in differing.items() if keys}


def outputs_of(model, prompt: str, latents: tuple, timestep: float, image=(48, 64), **step):
    """What a loaded model serves, for a set's model to equal its folder's: the prompt's
    conditioning, one step on it of latents of shape `latents` at `timestep` (`step`: the
    call's other keywords), a decode of latents of that shape and an encode of an image
    `image` (height, width) in size, all drawn from seed 0."""
    from gmlx_server.engine.base import EncodeResult
    from gmlx_server.engine.sampling import direct_row

    encoded = model.encode(prompt, [], refs=False)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, *latents)).astype(np.float32)
    row = direct_row(EncodeResult(cond=encoded.cond))
    out = model.denoise_step(x, np.array([timestep], np.float32), [row], **step).out
    decoded = model.vae_decode(rng.standard_normal(latents).astype(np.float32), alpha=False)
    pixels = rng.random((*image, 3)).astype(np.float32)
    return encoded.cond, out, decoded, model.vae_encode(pixels)


def assert_same_outputs(got: tuple, want: tuple) -> None:
    """Two models' outputs (outputs_of's, or a test's own) equal, bit for bit."""
    for ours, theirs in zip(got, want, strict=True):
        np.testing.assert_array_equal(ours, theirs)
