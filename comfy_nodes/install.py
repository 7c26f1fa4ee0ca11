"""`gmlx comfyui install|uninstall|status`: link the pack into ComfyUI and install its needs,
undo that, and show what was done.

The pack folder (this package's directory) is linked as `custom_nodes/gmlx_steps`; the
distribution that carries `gmlx_contract` (numpy, requests) is pip-installed into ComfyUI's own
Python, which ComfyUI already has torch in. The settings file records each install (one per
ComfyUI folder). Imports neither ComfyUI nor torch.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import GmlxError
from .settings import read_settings, replace_settings, settings_path

LINK_NAME = "gmlx_steps"
DISTRIBUTION = "gmlx-steps"
PACK_DIR = Path(__file__).resolve().parent
# The settings file's `gmlx` command (the pack starts the server with it).
COMMAND_KEY = "gmlx_command"
# The settings file's list of installs, and the single record older versions kept.
INSTALLS_KEY = "installs"
LEGACY_INSTALL_KEY = "installed"
# What `gmlx comfyui status` runs in ComfyUI's Python: the pack's modules that ComfyUI loads
# first, without torch (the package resolves its nodes lazily).
IMPORT_CHECK = (
    "import os, gmlx_comfy.connection as c; print(os.path.dirname(os.path.abspath(c.__file__)))"
)
IMPORT_CHECK_TIMEOUT_S = 60.0


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
    """Link the pack into `comfy_dir` and pip-install its needs into ComfyUI's Python; the
    install joins the settings file's list of installs (one per ComfyUI folder)."""
    custom_nodes = check_comfy_dir(Path(comfy_dir))
    interpreter = comfy_python(Path(comfy_dir), python)
    target = pip_target(pack_dir, version)
    command = [str(interpreter), "-m", "pip", "install"]
    if editable and Path(target).is_dir():
        command.append("-e")
    command.append(target)
    try:
        done = run(command, check=False)
    except OSError as error:  # not a program: a folder, a missing file, no permission
        raise GmlxError(
            f"gmlx: cannot run {interpreter} ({error.strerror or error}); name ComfyUI's Python"
            " with --python"
        ) from None
    if done.returncode != 0:
        raise GmlxError(f"gmlx: pip failed in ComfyUI's Python ({' '.join(command)})")
    replaced = link_pack(custom_nodes, pack_dir)
    link = custom_nodes / LINK_NAME
    record = Install(comfy_dir=custom_nodes.parent, link=link, python=interpreter)
    others = [i for i in recorded_installs(environ) if i.comfy_dir != record.comfy_dir]
    _record_installs([*others, record], environ)
    _record_server_command(environ)
    return InstallResult(link=link, python=interpreter, pip_command=command, replaced_link=replaced)


@dataclass(frozen=True)
class Install:
    """One recorded install: the ComfyUI folder, the link made in it, the Python pip ran in."""

    comfy_dir: Path
    link: Path
    python: Path

    def record(self) -> dict[str, str]:
        return {
            "comfy_dir": str(self.comfy_dir),
            "link": str(self.link),
            "python": str(self.python),
        }

    @classmethod
    def from_record(cls, doc: Any) -> Install | None:
        if not isinstance(doc, dict) or not all(
            isinstance(doc.get(key), str) for key in ("comfy_dir", "link", "python")
        ):
            return None
        return cls(Path(doc["comfy_dir"]), Path(doc["link"]), Path(doc["python"]))

    def link_state(self, pack_dir: Path = PACK_DIR) -> str:
        """ "linked", "missing", "not a link" or "links to OTHER"."""
        if self.link.is_symlink():
            target = Path(os.readlink(self.link))
            return "linked" if target == pack_dir else f"links to {target}"
        return "not a link" if self.link.exists() else "missing"


def recorded_installs(environ: dict[str, str] | None = None) -> list[Install]:
    """Every install the settings file records (`installs`; an older file's single
    `installed` counts as one)."""
    doc = read_settings(settings_path(environ))
    entries = doc.get(INSTALLS_KEY)
    if not isinstance(entries, list):
        entries = [doc.get(LEGACY_INSTALL_KEY)]
    found = [Install.from_record(entry) for entry in entries]
    return [i for i in found if i is not None]


def _record_installs(installs: list[Install], environ: dict[str, str] | None) -> None:
    path = settings_path(environ)
    doc = read_settings(path)
    doc.pop(LEGACY_INSTALL_KEY, None)
    doc[INSTALLS_KEY] = [i.record() for i in installs]
    replace_settings(path, doc)


def server_command() -> list[str] | None:
    """The `gmlx` that serves: this Python's, when it has the server's packages (the project's
    own environment, which runs `gmlx comfyui install`); None otherwise."""
    from .settings import server_installed_here

    if not server_installed_here():
        return None
    return [sys.executable, "-m", "gmlx_server"]


def _record_server_command(environ: dict[str, str] | None) -> None:
    """Record `server_command` as the settings file's `gmlx_command` (ComfyUI's own Python gets
    the pack's needs alone, so its `gmlx` cannot serve), unless one is recorded already."""
    command = server_command()
    path = settings_path(environ)
    doc = read_settings(path)
    if command is not None and not doc.get(COMMAND_KEY):
        doc[COMMAND_KEY] = command
        replace_settings(path, doc)


@dataclass(frozen=True)
class UninstallResult:
    removed_link: bool  # False when there was no link to remove
    python: Path
    pip_command: list[str] | None  # None: the distribution was left in `python`


def uninstall(
    comfy_dir: Path,
    *,
    pip: bool = False,
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
    environ: dict[str, str] | None = None,
) -> UninstallResult:
    """Undo `install` for one ComfyUI folder: remove its custom_nodes link and its record.

    With `pip`, also pip-uninstall the distribution from that ComfyUI's Python, refused when
    another recorded install uses the same Python or it is the Python running this command.
    """
    comfy_dir = Path(comfy_dir).expanduser().resolve()
    installs = recorded_installs(environ)
    mine = next((i for i in installs if i.comfy_dir == comfy_dir), None)
    if mine is None:
        listed = ", ".join(str(i.comfy_dir) for i in installs) or "none"
        raise GmlxError(
            f"gmlx: no install into {comfy_dir} is recorded in {settings_path(environ)} "
            f"(recorded: {listed})"
        )
    if mine.link.exists() and not mine.link.is_symlink():
        raise GmlxError(f"gmlx: {mine.link} is not a link (not made by install); left as is")
    others = [i for i in installs if i != mine]
    command = None
    if pip:
        command = _pip_uninstall_command(mine, others)
        if run(command, check=False).returncode != 0:
            raise GmlxError(f"gmlx: pip failed in ComfyUI's Python ({' '.join(command)})")
    removed = mine.link.is_symlink()
    if removed:
        mine.link.unlink()
    _record_installs(others, environ)
    return UninstallResult(removed_link=removed, python=mine.python, pip_command=command)


def _pip_uninstall_command(mine: Install, others: list[Install]) -> list[str]:
    sharing = [str(i.comfy_dir) for i in others if _same_environment(i.python, mine.python)]
    if sharing:
        raise GmlxError(
            f"gmlx: {mine.python} also serves the install in {', '.join(sharing)}; "
            "uninstall without --pip, or uninstall that one first"
        )
    if _same_environment(mine.python, Path(sys.executable)):
        raise GmlxError(
            f"gmlx: {mine.python} is the Python running this command: pip uninstall would "
            "remove this gmlx; uninstall without --pip"
        )
    return [str(mine.python), "-m", "pip", "uninstall", "--yes", DISTRIBUTION]


def _same_environment(a: Path, b: Path) -> bool:
    """Whether two Pythons install into one environment (pip in one uninstalls from both)."""
    try:
        return _environment(a) == _environment(b)
    except OSError:
        return False


def _environment(python: Path) -> Path:
    """Where `python` installs: a virtual environment's folder (the one holding its
    pyvenv.cfg; its python is a link to the base interpreter, which any other environment made
    from that base links too), else the interpreter itself."""
    folder = python.absolute().parent.resolve().parent
    if (folder / "pyvenv.cfg").is_file():
        return folder
    return python.resolve()


def pack_import_check(
    python: Path, run: Callable[..., subprocess.CompletedProcess] = subprocess.run
) -> str:
    """Whether the pack imports in `python`: "imports from FOLDER", or why it does not."""
    if not python.exists():
        return "Python not found"
    try:
        done = run(
            [str(python), "-c", IMPORT_CHECK],
            capture_output=True,
            text=True,
            timeout=IMPORT_CHECK_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as error:
        return f"does not run ({error})"
    if done.returncode != 0:
        lines = (done.stderr or "").strip().splitlines()
        return f"does not import ({lines[-1] if lines else f'status {done.returncode}'})"
    return f"imports from {done.stdout.strip()}"


def install_status(
    environ: dict[str, str] | None = None,
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
) -> list[str]:
    """One line per recorded install: ComfyUI folder, link state, Python, import check."""
    return [
        f"{i.comfy_dir}: link {i.link} {i.link_state()}; Python {i.python}: "
        f"{pack_import_check(i.python, run)}"
        for i in recorded_installs(environ)
    ]


def main(argv: list[str] | None = None) -> int:
    """`python -m gmlx_comfy.install --comfy DIR [--python PY]` (what `gmlx comfyui install`
    calls)."""
    parser = argparse.ArgumentParser(prog="gmlx comfyui install")
    parser.add_argument("--comfy", required=True, type=Path, help="the ComfyUI folder")
    parser.add_argument("--python", type=Path, default=None, help="ComfyUI's Python")
    return _run(parser.parse_args(argv), _install, parser.prog)


def _install(args: argparse.Namespace) -> None:
    result = install(args.comfy, python=args.python)
    print(f"linked {result.link} -> {PACK_DIR}")
    print(f"installed into {result.python}; restart ComfyUI to load the gmlx nodes")
    if args.python is None and _same_environment(result.python, Path(sys.executable)):
        print(
            f"note: {args.comfy} holds no Python of its own (venv/, .venv/ or a portable build's"
            " python_embeded/), so gmlx's own Python was used; if ComfyUI runs in another,"
            " install again with --python naming it"
        )


def uninstall_main(argv: list[str] | None = None) -> int:
    """`gmlx comfyui uninstall --comfy DIR [--pip]`."""
    parser = argparse.ArgumentParser(prog="gmlx comfyui uninstall")
    parser.add_argument("--comfy", required=True, type=Path, help="the ComfyUI folder")
    parser.add_argument(
        "--pip", action="store_true", help=f"also pip-uninstall {DISTRIBUTION} from its Python"
    )
    return _run(parser.parse_args(argv), _uninstall, parser.prog)


def _uninstall(args: argparse.Namespace) -> None:
    result = uninstall(args.comfy, pip=args.pip)
    link = Path(args.comfy).expanduser().resolve() / "custom_nodes" / LINK_NAME
    print(f"removed {link}" if result.removed_link else f"no link at {link} to remove")
    if result.pip_command is None:
        print(
            f"{DISTRIBUTION} stays installed in {result.python} (remove it with "
            f"`{result.python} -m pip uninstall {DISTRIBUTION}`, or rerun with --pip)"
        )
    else:
        print(f"uninstalled {DISTRIBUTION} from {result.python}")
    print("restart ComfyUI to drop the gmlx nodes")


def _run(args: argparse.Namespace, command: Callable[[argparse.Namespace], None], prog: str) -> int:
    """A command's exit status: 0, or 2 with the GmlxError it raised on stderr, told as the
    command's (`prog`: `gmlx comfyui install: ...`, as the other gmlx commands tell theirs)."""
    try:
        command(args)
    except GmlxError as err:
        print(f"{prog}: {str(err).removeprefix('gmlx: ')}", file=sys.stderr)
        return 2
    return 0


def status_main(argv: list[str] | None = None) -> int:
    """`gmlx comfyui status`: each recorded install and whether the pack imports there."""
    argparse.ArgumentParser(prog="gmlx comfyui status").parse_args(argv)
    lines = install_status()
    print("\n".join(lines) or f"no install recorded in {settings_path()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
