"""The model an in-process command runs (`gmlx image sample`, `gmlx image bench`, `gmlx model
...`): a folder, a configured model id or a set of component files, else the configured
default or the embedded default model, in a registry of its own with the model entry's
settings and the command's flags over them."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import ImageConfig
from .engine.sampling import ImageRequest, check_request
from .parsers import flag_name
from .process import config_registry


@dataclass
class ModelChoice:
    """A registry that knows the chosen model, and the chosen model's id."""

    registry: Any
    model_id: str
    prepare_s: float  # finding the folder (and generating the embedded default on first use)
    image: ImageConfig = field(default_factory=ImageConfig)  # the memory plan's settings
    group: Any = None  # the rank group the model loads over (server/distributed.py), or None

    def check(self, request: ImageRequest) -> None:
        """Refuse, before the model loads, what its status from the files says it cannot take
        (sampling.check_request: size, pixel limits, steps, sampler)."""
        status = self.registry.describe(self.model_id)
        if status is not None:
            check_request(status, request)

    def join(self, group: Any) -> None:
        """Load the model over a rank group from now on (None: in this process alone)."""
        if group is not None:
            from .distributed import attach

            attach(group, self.registry)
            self.group = group


def choose_model(
    model: str | None,
    config_path: Path | None = None,
    flags: dict | None = None,
) -> ModelChoice:
    """A folder (holding model_index.json), a model id of the configuration, or, with neither,
    the configured default model or else the embedded default; loaded with its model entry's
    settings and `flags` over them (a model entry's table from the command's flags:
    parsers.model_flags)."""
    from .config import load_config, model_settings_over
    from .engine.registry import MODEL_INDEX, ModelRegistry

    started = time.perf_counter()
    flags = flags or {}
    config = load_config(config_path)
    if model and (Path(model).expanduser() / MODEL_INDEX).is_file():
        folder = Path(model).expanduser().resolve()
        refuse_set_facts(flags, f"the folder {folder}")
        settings = model_settings_over(None, flags, Path.cwd(), flag_name).load_settings()
        registry = ModelRegistry(
            extra_models=[folder],
            default_model=folder.name,
            settings=lambda _model_id: settings,
        )
        return ModelChoice(registry, folder.name, time.perf_counter() - started, config.image)
    if model is None and "vae" in flags:  # --dit, --text-encoder and --vae: component files
        settings = model_settings_over(None, flags, Path.cwd(), flag_name)
        files = settings.component_files()
        model = " + ".join(Path(p).stem for p in (files.dit, files.text_encoder, files.vae))
        config.models[model] = settings
    registry, _ = config_registry(config, model)
    if model and model not in registry.folders():
        refused = registry.resolve_refusal(model)
        if refused is not None:
            raise ValueError(refused)
        raise ValueError(unknown_model(model, sorted(registry.folders()), registry.unknown_hint))
    model_id = registry.default_model
    if not model_id:
        raise ValueError("no model named, none configured and no embedded default available")
    if any(key in flags for key in SET_FACTS) and model_id not in config.component_sets():
        refuse_set_facts(flags, f"{model_id!r}, a model folder,")
    entry = config.models.get(model_id)
    config.models[model_id] = model_settings_over(entry, flags, Path.cwd(), flag_name)
    return ModelChoice(registry, model_id, time.perf_counter() - started, config.image)


# What a model of component files may be told that its files cannot tell (config.py's entries).
SET_FACTS = ("family", "variant", "tokenizer")


def refuse_set_facts(flags: dict, model: str) -> None:
    """Refuse (a ConfigError, the arguments' fault, naming the flag) a family, variant or
    tokenizer flag for a model that is no set of component files: a folder says its own, and
    the flag would be lost."""
    from .config import ConfigError

    given = [key for key in SET_FACTS if key in flags]
    if given:
        raise ConfigError(
            f"{flag_name(given[0])} is told to a model of component files (--dit,"
            f" --text-encoder and --vae, or a set of ComfyUI's folders); {model} says its own"
        )


def unknown_model(model: str, known: list[str], hint: Callable[[str], str]) -> str:
    """Why `--model` names nothing this command can load: which folder lacks what, or which ids
    there are and what may be meant (`hint`: the registry's `unknown_hint`)."""
    from .engine.registry import MODEL_INDEX

    folder = Path(model).expanduser()
    if folder.is_dir():
        if (folder.parent / MODEL_INDEX).is_file():
            return (
                f"{folder} is the {folder.name!r} part of the model folder {folder.parent}: "
                "name that folder"
            )
        inner = sorted(d.name for d in folder.iterdir() if (d / MODEL_INDEX).is_file())
        if inner:
            return (
                f"{folder} holds model folders ({', '.join(inner)}), not a model: name one of "
                "them, or list this folder in the config's model_dirs"
            )
        return (
            f"{folder} exists but is not a diffusers model folder: it has no {MODEL_INDEX}. A "
            f"model folder holds {MODEL_INDEX} beside one folder per component (transformer/, "
            "text_encoder/, vae/, ...); single checkpoint files are not read"
        )
    ids = ", ".join(known) or "none"
    if folder.exists():
        return f"{folder} is a file, not a model folder (model ids known here: {ids})"
    return (
        f"no model folder {model!r} and no model of that id (model ids known here: {ids})"
        + hint(model)
    )


@contextmanager
def loading_bar(model_id: str):
    """A progress bar over the two loading stages (folder, weights)."""
    from tqdm import tqdm

    with tqdm(total=2, desc=f"loading {model_id}", unit="stage", leave=False) as bar:
        yield bar
