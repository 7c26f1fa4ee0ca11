"""ComfyUI's model folders, found by themselves: every set of component files they hold
(engine/components.py) is a model the server lists, by an id naming its parts
(`z_image_turbo_bf16 + qwen_3_4b + ae`).

The folders are the configuration's `comfyui_model_dirs` (each a ComfyUI `models/` folder)
and those of each ComfyUI install `gmlx comfyui install` recorded (the pack's settings file,
comfy_nodes/settings.py): its `models/` folder and the folders its `extra_model_paths.yaml`
adds, read as ComfyUI reads that file (utils/extra_config.py: per section an optional
`base_path`, then per folder kind one path or several on separate lines, relative to the
base path or else to the file's folder). Headers alone are read, without MLX.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("gmlx.server")

EXTRA_PATHS_FILE = "extra_model_paths.yaml"


def recorded_comfyui_dirs() -> list[Path]:
    """The ComfyUI folders the pack's installs recorded (none where the pack is absent)."""
    try:
        from gmlx_comfy.install import recorded_installs
    except ImportError:
        return []
    return [install.comfy_dir for install in recorded_installs()]


def extra_model_folders(path: Path) -> dict[str, list[Path]]:
    """The folders an extra_model_paths.yaml adds, by component (COMFY_FOLDERS' keys); {} for a
    file that cannot be read, which is logged."""
    try:
        import yaml

        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (ImportError, OSError, ValueError) as exc:
        log.warning("cannot read %s: %s", path, exc)
        return {}
    from .engine.components import COMFY_FOLDERS

    kinds = {name: key for key, names in COMFY_FOLDERS.items() for name in names}
    found: dict[str, list[Path]] = {}
    for section in doc.values() if isinstance(doc, dict) else ():
        if not isinstance(section, dict):
            continue
        base = section.get("base_path")
        base = Path(str(base)).expanduser() if base else None
        if base is not None and not base.is_absolute():
            base = Path(path).parent / base
        for name, value in section.items():
            if name not in kinds or not isinstance(value, str):
                continue
            for line in value.split("\n"):
                if line.strip():
                    folder = Path(line.strip()).expanduser()
                    if not folder.is_absolute():
                        folder = (base or Path(path).parent) / folder
                    found.setdefault(kinds[name], []).append(folder)
    return found


def comfyui_folders(
    models_dirs: list[Path], comfy_dirs: list[Path] | None = None
) -> dict[str, list[Path]]:
    """Every folder of each component: those under each `models/` folder (and each ComfyUI
    folder's own `models/`), then those its extra_model_paths.yaml adds."""
    from .engine.components import COMFY_FOLDERS

    comfy_dirs = recorded_comfyui_dirs() if comfy_dirs is None else comfy_dirs
    roots = [*models_dirs, *(Path(d) / "models" for d in comfy_dirs)]
    found: dict[str, list[Path]] = {key: [] for key in COMFY_FOLDERS}
    for root in roots:
        for key, names in COMFY_FOLDERS.items():
            found[key] += [Path(root).expanduser() / name for name in names]
    for comfy in comfy_dirs:
        extra = Path(comfy) / EXTRA_PATHS_FILE
        if extra.is_file():
            for key, folders in extra_model_folders(extra).items():
                found[key] += folders
    return {key: list(dict.fromkeys(folders)) for key, folders in found.items()}


def comfyui_sets(models_dirs: list[Path], comfy_dirs: list[Path] | None = None) -> dict:
    """The sets the folders make, by model id (components.comfy_sets); {} without the serving
    extras, whose readers listing needs."""
    try:
        from .engine.components import comfy_sets
        from .engine.spec import family_specs
    except ImportError:
        return {}
    comfy_dirs = recorded_comfyui_dirs() if comfy_dirs is None else comfy_dirs
    folders = comfyui_folders(models_dirs, comfy_dirs)
    if not any(folder.is_dir() for folders in folders.values() for folder in folders):
        return {}
    return comfy_sets(folders, family_specs(), comfy_dirs[0] if comfy_dirs else None)
