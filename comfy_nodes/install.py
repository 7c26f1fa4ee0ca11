"""`gmlx comfyui install --comfy DIR`: link the pack into ComfyUI and install its needs.

The pack folder (this package's directory) is linked as `custom_nodes/gmlx_steps`; the
distribution that carries `gmlx_contract` (numpy, requests) is pip-installed into ComfyUI's own
Python, which ComfyUI already has torch in. The settings file records what was done.
Imports neither ComfyUI nor torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import GmlxError
from .settings import settings_path, write_settings

LINK_NAME = "gmlx_steps"
DISTRIBUTION = "gmlx-steps"
PACK_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class InstallResult:
    link: Path
    python: Path
    pip_command: list[str]
    replaced_link: bool


def check_comfy_dir(comfy_dir: Path) -> Path:
    """The ComfyUI checkout's custom_nodes folder; refuses a folder that is not ComfyUI."""
    comfy_dir = comfy_dir.expanduser().resolve()
    if not (comfy_dir / "main.py").is_file() or not (comfy_dir / "comfy").is_dir():
        raise GmlxError(f"gmlx: {comfy_dir} is not a ComfyUI folder (no main.py and comfy/)")
    nodes = comfy_dir / "custom_nodes"
    nodes.mkdir(exist_ok=True)
    return nodes


def comfy_python(comfy_dir: Path, python: Path | None = None) -> Path:
    """ComfyUI's interpreter: the one given, else a venv inside the checkout, else the
    portable build's embedded Python beside it, else the Python running this command."""
    if python is not None:
        return Path(python)
    comfy_dir = comfy_dir.expanduser().resolve()
    candidates = [
        comfy_dir / "venv" / "bin" / "python",
        comfy_dir / ".venv" / "bin" / "python",
        comfy_dir / "venv" / "Scripts" / "python.exe",
        comfy_dir / ".venv" / "Scripts" / "python.exe",
        comfy_dir.parent / "python_embeded" / "python.exe",
    ]
    for candidate in candidates:
        if candidate.exists():
            return candidate
    return Path(sys.executable)


def pip_target(pack_dir: Path = PACK_DIR, version: str | None = None) -> str:
    """What pip installs: the source tree holding the pack when there is one (an editable
    checkout), else the released distribution at this version."""
    root = pack_dir.parent
    if (root / "pyproject.toml").is_file() and (root / "shared").is_dir():
        return str(root)
    return f"{DISTRIBUTION}=={version}" if version else DISTRIBUTION


def link_pack(custom_nodes: Path, pack_dir: Path = PACK_DIR) -> bool:
    """Make custom_nodes/gmlx_steps a link to the pack; True when an old link was replaced.

    A real folder of that name is never touched: the user has to move it away.
    """
    link = custom_nodes / LINK_NAME
    replaced = False
    if link.is_symlink():
        if Path(os.readlink(link)) == pack_dir:
            return False
        link.unlink()
        replaced = True
    elif link.exists():
        raise GmlxError(f"gmlx: {link} exists and is not a link; move it away and rerun")
    link.symlink_to(pack_dir, target_is_directory=True)
    return replaced


def install(
    comfy_dir: Path,
    *,
    python: Path | None = None,
    pack_dir: Path = PACK_DIR,
    version: str | None = None,
    editable: bool = True,
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
    environ: dict[str, str] | None = None,
) -> InstallResult:
    """Link the pack into `comfy_dir` and pip-install its needs into ComfyUI's Python."""
    custom_nodes = check_comfy_dir(Path(comfy_dir))
    interpreter = comfy_python(Path(comfy_dir), python)
    target = pip_target(pack_dir, version)
    command = [str(interpreter), "-m", "pip", "install"]
    if editable and Path(target).is_dir():
        command.append("-e")
    command.append(target)
    done = run(command, check=False)
    if done.returncode != 0:
        raise GmlxError(f"gmlx: pip failed in ComfyUI's Python ({' '.join(command)})")
    replaced = link_pack(custom_nodes, pack_dir)
    link = custom_nodes / LINK_NAME
    write_settings(
        settings_path(environ),
        {
            "installed": {
                "comfy_dir": str(Path(comfy_dir).resolve()),
                "link": str(link),
                "python": str(interpreter),
            }
        },
    )
    return InstallResult(link=link, python=interpreter, pip_command=command, replaced_link=replaced)


def main(argv: list[str] | None = None) -> int:
    """`python -m gmlx_comfy.install --comfy DIR [--python PY]` (what `gmlx comfyui install`
    calls)."""
    import argparse

    parser = argparse.ArgumentParser(prog="gmlx comfyui install")
    parser.add_argument("--comfy", required=True, type=Path, help="the ComfyUI folder")
    parser.add_argument("--python", type=Path, default=None, help="ComfyUI's Python")
    args = parser.parse_args(argv)
    try:
        result = install(args.comfy, python=args.python)
    except GmlxError as err:
        print(err, file=sys.stderr)
        return 2
    print(f"linked {result.link} -> {PACK_DIR}")
    print(f"installed into {result.python}; restart ComfyUI to load the gmlx nodes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
