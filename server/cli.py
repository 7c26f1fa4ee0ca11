"""The `gmlx` command line.

Every parser is a `CommandParser`: its help shows each option's default, and a subcommand added
with only `help=` gets that text as its description too.

Subcommands are registered in two ways, so another part of the project adds one with one line:
  * `COMMANDS`: functions `register(subparsers)` (or their "module:function" paths) that add a
    parser and `set_defaults(func=...)`, where func(args) -> exit code (`serve` is one);
  * `DELEGATED`: (words, "module:function", help) for a command whose module parses its own
    arguments: `function(argv) -> exit code` gets everything after the words. A module that
    cannot be imported leaves its command out.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from . import __version__

log = logging.getLogger("gmlx.server")

DELEGATED: list[tuple[tuple[str, ...], str, str]] = [
    (("comfyui", "install"), "gmlx_comfy.install:main", "link the node pack into ComfyUI"),
    (("comfyui", "uninstall"), "gmlx_comfy.install:uninstall_main", "undo install for one ComfyUI"),
    (("comfyui", "status"), "gmlx_comfy.install:status_main", "each recorded install's state"),
]


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's help with each option's default, except where there is none to show (None, a
    flag's False, an empty list): there the help text says what happens."""

    def _get_help_string(self, action: argparse.Action) -> str:
        default = action.default
        if default is None or default is False or (isinstance(default, list) and not default):
            return action.help or ""
        return super()._get_help_string(action)


class Subcommands(argparse._SubParsersAction):
    """Subcommands whose description defaults to their one-line help."""

    def add_parser(self, name: str, **kwargs):
        if "help" in kwargs:
            kwargs.setdefault("description", kwargs["help"])
        return super().add_parser(name, **kwargs)


class CommandParser(argparse.ArgumentParser):
    """The parser of `gmlx` and of each of its subcommands (argparse makes a subcommand's parser
    of its parent's class)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", Subcommands)


SERVE_HELP = "serve the image step routes and the OpenAI image routes over HTTP"
SERVE_DESCRIPTION = (
    f"{SERVE_HELP[0].upper()}{SERVE_HELP[1:]} (/internal/image-steps/v1/..., "
    "/v1/images/generations, /v1/images/edits), with the models found in the configured "
    "model_dirs (or the embedded default model). Settings come from the config file, then the "
    "GMLX_* environment variables, then these flags; see docs/server.md."
)


def register_serve(subparsers) -> None:
    from .config import DEFAULT_CONFIG_PATH, ServerConfig

    defaults = ServerConfig()
    parser = subparsers.add_parser("serve", help=SERVE_HELP, description=SERVE_DESCRIPTION)
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help=f"TOML config file (default: {DEFAULT_CONFIG_PATH}, when it exists)",
    )
    parser.add_argument(
        "--host",
        default=None,
        help=f"address to listen on, over the config file and GMLX_HOST (default: {defaults.host})",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=None,
        help=f"port to listen on, over the config file and GMLX_PORT (default: {defaults.port})",
    )
    parser.set_defaults(func=serve)


def register_image(subparsers) -> None:
    from .image_cli import register  # `gmlx image sample` and `gmlx image bench`

    register(subparsers)


COMMANDS: list[Callable | str] = [
    register_serve,
    register_image,
    "gmlx_server.discovery:register",  # `gmlx status`, `gmlx list`
]


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="gmlx", description="gmlx image step server")
    parser.add_argument("--version", action="version", version=f"gmlx {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for register in COMMANDS:
        if isinstance(register, str):
            register = _resolve(register)
        if register is not None:
            register(subparsers)
    _add_delegated(subparsers)
    return parser


def _add_delegated(subparsers) -> None:
    groups: dict[str, argparse._SubParsersAction] = {}
    for words, target, help_text in DELEGATED:
        if _resolve(target) is None:
            continue
        parent = subparsers
        for depth, word in enumerate(words[:-1]):
            key = " ".join(words[: depth + 1])
            if key not in groups:
                group = parent.add_parser(word, help=f"{word} commands")
                groups[key] = group.add_subparsers(dest=f"sub_{depth}", metavar="COMMAND")
                groups[key].required = True
            parent = groups[key]
        leaf = parent.add_parser(words[-1], help=help_text, add_help=False)
        leaf.add_argument("rest", nargs=argparse.REMAINDER)
        leaf.set_defaults(func=lambda args, target=target: _resolve(target)(args.rest))


def _resolve(target: str) -> Callable | None:
    module_name, _, function = target.partition(":")
    try:
        return getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError):
        return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    delegated = _delegated_call(argv)
    if delegated is not None:
        return delegated
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


def entry() -> None:
    """The `gmlx` console script and `python -m gmlx_server`: run a command, then end the process
    without C++ static destructors. MLX arrays evaluated on a thread other than the main one (the
    image worker) make the process abort at exit ("terminate called without an active exception",
    status 134; reproduced with a plain 4096x4096 matmul in a joined thread, mlx 0.32.4 CPU).
    Every command has written and closed what it must by the time it returns."""
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _delegated_call(argv: list[str]) -> int | None:
    """A delegated command gets its arguments untouched: argparse's REMAINDER would not take
    ones that start with `-` (`gmlx comfyui install --comfy DIR`)."""
    for words, target, _ in DELEGATED:
        if tuple(argv[: len(words)]) == words:
            function = _resolve(target)
            if function is not None:
                return int(function(argv[len(words) :]) or 0)
    return None


# ---------------------------------------------------------------- serve


def serve(args: argparse.Namespace) -> int:
    from .config import ConfigError, load_config

    setup_logging()
    try:
        config = load_config(args.config, host=args.host, port=args.port)
        config.check_startable()
    except ConfigError as exc:
        print(f"gmlx serve: {exc}", file=sys.stderr)
        return 2
    tune_malloc()
    _fast_blas()  # before anything imports mlx

    from .app import build_context, create_app, make_server
    from .kernel_compiles import CompileWatch

    registry, extra = config_registry(config)
    default = registry.default_model
    ctx = build_context(config, registry)
    try:
        server = make_server(create_app(ctx), config)
    except OSError as exc:
        ctx.service.close()
        print(f"gmlx serve: cannot listen on {config.host}:{config.port}: {exc}", file=sys.stderr)
        return 1
    _stop_on_signals()
    log.info(
        "gmlx %s serving on http://%s:%s (models: %s; default: %s)",
        __version__,
        config.host,
        server.effective_port,
        ", ".join(str(d) for d in [*extra, *config.model_dirs]) or "none",
        default or "none",
    )
    try:
        with CompileWatch(log.info):
            server.run()  # returns after SIGINT/SIGTERM (waitress stops its threads)
    finally:
        log.info("stopping: ending runs and letting the models go")
        ctx.service.close()
        server.close()
    return 0


def setup_logging() -> None:
    logging.basicConfig(
        level=os.environ.get("GMLX_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _stop_on_signals() -> None:
    def stop(signum, frame):  # noqa: ARG001 - signal handler signature
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def _fast_blas() -> None:
    try:
        from .engine.blas import ensure_fast_blas
    except ImportError:
        return
    ensure_fast_blas()


def config_registry(config, model: str | None = None):
    """The model registry of a configuration, its default model `model` or else the configured
    one or else the embedded default (whose folder joins as an extra folder); models load with
    their entries' configured adapters. Returns (registry, extra folders)."""
    from .engine.registry import ModelRegistry
    from .lora_files import DefaultAdapters

    extra, default = _embedded_default(model or config.default_model)
    hooks = DefaultAdapters(config.models) if config.models else None
    registry = ModelRegistry(config.model_dirs, default, extra_models=extra, load_hooks=hooks)
    unknown = sorted(set(config.models) - set(registry.folders()))
    if unknown:  # a folder may still appear later: the model dirs are listed on each lookup
        log.warning("configured model entries with no model folder (yet): %s", ", ".join(unknown))
    return registry, extra


def _embedded_default(default_model: str | None) -> tuple[list[Path], str | None]:
    """With no default_model configured, the embedded default model is the default: its
    folder joins the registry as an extra model folder. Returns (extra folders, default id)."""
    if default_model:
        return [], default_model
    try:
        from .engine.families.qwen_image21.embedded import ensure_embedded_model
    except ImportError:
        log.warning("no default_model configured and no embedded default model available")
        return [], None
    folder = Path(ensure_embedded_model())
    return [folder], folder.name


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
# glibc's largest allowed mmap threshold on 64-bit systems.
_MMAP_THRESHOLD_BYTES = 32 << 20
_TRIM_THRESHOLD_BYTES = 256 << 20


def tune_malloc() -> bool:
    """Keep freed megabyte buffers in the process instead of returning them to the OS per
    request (about 1,500 page faults for a 2 MiB step each way otherwise: docs/benchmarks.md). This is
    what MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ would do at process start, set through
    mallopt so no re-exec is needed; variables the user set win. glibc only."""
    if not sys.platform.startswith("linux"):
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES) == 1 and ok
    if "MALLOC_ARENA_MAX" not in os.environ:
        # One arena for every thread. A thread's own arena lives in 64 MiB heaps that glibc
        # unmaps as soon as one is wholly free, whatever the trim threshold: measured, the
        # step's work (one thread) churned ~290 of them per step and every 2 MiB body buffer of
        # an HTTP thread came back as fresh pages (1,500 faults a step). Set before threads
        # allocate, which is why this runs first.
        ok = mallopt(_M_ARENA_MAX, 1) == 1 and ok
    return ok
