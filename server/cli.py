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
import importlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import __version__
from .parsers import (
    CommandParser,
    add_group_arguments,
    add_quantize_arguments,
    quantization_argument,
)
from .process import config_registry, prepared_for

log = logging.getLogger("gmlx.server")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# How long a stop waits for the requests in flight (an image of many steps, a stream) to be
# answered before it lets the models go regardless.
STOP_GRACE_S = 60.0
INTERRUPTED_STATUS = 130  # a command's exit status after Ctrl-C, as a shell gives (128 + SIGINT)

DELEGATED: list[tuple[tuple[str, ...], str, str]] = [
    (("comfyui", "install"), "gmlx_comfy.install:main", "link the node pack into ComfyUI"),
    (("comfyui", "uninstall"), "gmlx_comfy.install:uninstall_main", "undo install for one ComfyUI"),
    (("comfyui", "status"), "gmlx_comfy.install:status_main", "each recorded install's state"),
]


SERVE_HELP = "serve the image step routes and the OpenAI image routes over HTTP"
SERVE_DESCRIPTION = (
    f"{SERVE_HELP[0].upper()}{SERVE_HELP[1:]} (/internal/image-steps/v1/..., "
    "/v1/images/generations, /v1/images/edits, /v1/images/variations), with the models found "
    "in the configured model_dirs (or the embedded models). Settings come from the "
    "config file, then the GMLX_* environment variables, then these flags; see docs/server.md."
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
    add_quantize_arguments(parser)
    add_group_arguments(parser)
    parser.add_argument(
        "--hostfile",
        type=Path,
        default=None,
        help="start `gmlx serve` on every host of this mlx.launch hostfile, the DiT sharded over"
        " them (runs `mlx.launch --hostfile HOSTFILE --backend BACKEND -- gmlx serve ...`)",
    )
    parser.add_argument(
        "--backend",
        choices=("ring", "mpi", "nccl", "jaccl"),
        default="ring",
        help="the mx.distributed backend of --hostfile",
    )
    parser.set_defaults(func=serve)


def register_image(subparsers) -> None:
    from .image_cli import register  # `gmlx image sample` and `gmlx image bench`

    register(subparsers)


COMMANDS: list[Callable | str] = [
    register_serve,
    register_image,
    "gmlx_server.discovery:register",  # `gmlx status`, `gmlx list`
    "gmlx_server.model_cli:register",  # `gmlx model quantize`
    "gmlx_server.pull:register",  # `gmlx pull`
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
    Every command has written and closed what it must by the time it returns. A reader of
    the output that leaves early (`gmlx list | head -1`) ends the command quietly, and Ctrl-C
    in a command that does not take it itself (`gmlx image sample`) in one line, status 130."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nobody reads the rest
        code = 1
    except KeyboardInterrupt:
        print("gmlx: interrupted", file=sys.stderr)
        code = INTERRUPTED_STATUS
    logging.shutdown()
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
    from .config import load_config

    setup_logging()
    if args.hostfile is not None:
        return _launch_group(args)
    try:
        quantization = quantization_argument(args)
        config = load_config(args.config, host=args.host, port=args.port, quantization=quantization)
        config.check_startable()
    except ValueError as exc:  # a ConfigError, or --group-size without --quantize
        print(f"gmlx serve: {exc}", file=sys.stderr)
        return 2
    if not prepared_for("serve"):  # before anything imports mlx
        return 2

    from . import distributed, server_records
    from .app import build_context, create_app, make_server
    from .discovery import client_url
    from .kernel_compiles import CompileWatch
    from .service import CLOSE_WAIT_S

    group = distributed.join(args.shard, args.rank_timeout)  # a rank > 0 follows, then ends
    registry, extra = config_registry(config)
    if group is not None:
        distributed.attach(group, registry)
    default = registry.default_model
    ctx = build_context(config, registry, group)
    try:
        server = make_server(create_app(ctx), config)
    except OSError as exc:
        ctx.service.close()
        print(f"gmlx serve: cannot listen on {config.host}:{config.port}: {exc}", file=sys.stderr)
        return 1
    stopping = _stop_on_signals(group, server, ctx.traffic, ctx.service.worker)
    log.info(
        "gmlx %s serving on http://%s:%s (models: %s; default: %s)",
        __version__,
        config.host,
        server.effective_port,
        ", ".join(model_sources(config, extra)) or "none",
        default or "none",
    )
    _warn_if_unservable(registry, default)
    _warn_of_model_folders(registry)
    _warn_of_no_memory(ctx.service.memory)
    if not config.loopback_bind and config.image.steps_api and not config.image.steps_remote:
        log.info(
            "the step routes answer loopback peers only (server.image.steps_remote is false);"
            " the OpenAI routes answer every peer that sends the API key"
        )
    url = client_url(config.host, server.effective_port)
    try:  # recorded for `gmlx status` (and the ComfyUI pack) while it serves
        with server_records.serving(url, config.source), CompileWatch(log.info):
            _run_until_stopped(server, stopping.loop_ended)
    finally:
        for signum in STOP_SIGNALS:  # a signal now would only cut the cleanup short
            signal.signal(signum, signal.SIG_IGN)
        if stopping.cut_short.is_set():
            log.info("stopping at once: ending runs; the models go with the process")
            ctx.service.close(0)
        else:
            log.info("stopping: ending runs and letting the models go")
            ctx.service.close(CLOSE_WAIT_S)
        server.close()
        if group is not None:
            distributed.stop_group(group)
    return 1 if group is not None and group.broken else 0


def _run_until_stopped(server, loop_ended: threading.Event) -> None:
    """The server's loop, until a stop interrupts it (waitress then stops its threads). A
    stop's interrupt that lands as the loop ends on another (the graceful stop's, just after a
    stop at once) ends it the same; once `loop_ended` is set, a stop raises nothing."""
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        loop_ended.set()


def _warn_if_unservable(registry, default: str | None) -> None:
    """Say at start, not at the first request, when the configured default model cannot be
    served (no such folder yet, or not of a family the server loads), and why."""
    from gmlx_contract.errors import ContractError

    if default is None:
        return
    try:
        registry.resolve(default)
    except ContractError as exc:
        log.warning("the default model cannot be served: %s", exc.message)


def _warn_of_model_folders(registry) -> None:
    """Say at start which `model_dirs` are no folder (a mistyped path, a disk not mounted):
    they give no models until they are one; and which model folders another of the same name
    hides."""
    for folder in registry.model_dirs:
        if not folder.is_dir():
            log.warning("model_dirs names %s, which is no folder: no models come from it", folder)
    for hidden, served in registry.shadowed():
        log.warning(
            "model %r is served from %s; %s, of the same name, is not", served.name, served, hidden
        )


def _warn_of_no_memory(memory) -> None:
    """Say at start when the image worker has no memory to plan work in (a headroom as large
    as what this process could use): the server answers, and refuses every image and step."""
    from .memory import MiB

    if memory.budget() > 0:
        return
    if memory.machine() == 0:
        log.warning(
            "the image worker has no memory to work in: this process's memory cannot be read"
            " here, so every image and step will be refused; set server.image.memory_budget_mb"
        )
        return
    log.warning(
        "the image worker has no memory to work in: server.image.memory_headroom_mb (%d MiB)"
        " leaves nothing of the %d MiB this process could use, so every image and step will be"
        " refused; lower it, or set server.image.memory_budget_mb",
        memory.headroom // MiB,
        memory.machine() // MiB,
    )


def _launch_group(args: argparse.Namespace) -> int:
    """`gmlx serve --hostfile`: the same command on every host, through mlx.launch, in a
    process group of its own; SIGINT or SIGTERM reach it as SIGINT, which stops rank 0, and rank
    0 stops the others."""
    import subprocess

    from .distributed import launch_command

    launcher = subprocess.Popen(
        launch_command(args.hostfile, args.backend, sys.argv[1:]), start_new_session=True
    )

    def forward(signum, frame):  # noqa: ARG001 - signal handler signature
        os.killpg(launcher.pid, signal.SIGINT)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return launcher.wait()


def setup_logging() -> None:
    """The log at GMLX_LOG_LEVEL (INFO where it names no level: the configuration then
    refuses it, naming the levels)."""
    from .config import LOG_LEVELS

    level = os.environ.get("GMLX_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=level if level in LOG_LEVELS else "INFO",
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def model_sources(config, extra) -> list[str]:
    """Where the served models come from, as the start's log line says it: the model folders,
    ComfyUI's model folders and the configured entries."""
    sources = [str(folder) for folder in [*extra, *config.model_dirs]]
    sources += [f"ComfyUI's {folder}" for folder in config.comfyui_model_dirs]
    if config.models:
        sources.append(f"{len(config.models)} model entries")
    return sources


@dataclass(frozen=True)
class Stopping:
    """What the stop signals decide, for the server's loop and its cleanup: `cut_short`, set
    when the stop is one at once (the cleanup then waits for no job); `loop_ended`, set by the
    loop's end (a signal after that raises nothing into the cleanup)."""

    cut_short: threading.Event
    loop_ended: threading.Event


def _stop_on_signals(group=None, server=None, traffic=None, worker=None) -> Stopping:
    """SIGINT and SIGTERM stop the server, the requests in flight answered first: new ones are
    refused 503 (`/health?ready=1` says the server is stopping) while those finish, for at most
    STOP_GRACE_S; a second signal stops it at once. On rank 0 of a rank group, the group's end
    (a broken group, its launcher gone: distributed.Group.on_end) stops it at once too. A stop
    at once abandons the image worker's jobs (`worker`: the requests waiting on them end now,
    not when the job does)."""
    import _thread

    at_once = threading.Event()  # the interrupt to come stops the loop without a word
    stopping = Stopping(threading.Event(), threading.Event())
    cut_short = stopping.cut_short
    # A signal that lands while the first one's handling runs (in the main thread, between two
    # of its bytecodes) waits for it to end: raised there, its interrupt would tear a lock
    # that handling holds (a thread's start, the log's). Plain lists, not Events: a handler
    # runs on the main thread alone, and one that took an Event's lock could land inside it.
    handling: list[bool] = []
    landed: list[int] = []  # the signals that waited

    def interrupt() -> None:
        at_once.set()
        _thread.interrupt_main()
        if server is not None:
            server.pull_trigger()  # wake the loop from its poll, where the interrupt is taken

    def answered() -> None:  # the graceful stop's end, unless a stop at once ended the loop
        if not cut_short.is_set():
            interrupt()

    def stop(signum, frame):  # noqa: ARG001 - signal handler signature
        if stopping.loop_ended.is_set():
            return  # the cleanup runs: nothing to interrupt
        if handling:
            landed.append(signum)
            return
        handling.append(True)
        try:
            begin_stop(signal.Signals(signum).name)
        finally:
            handling.clear()
        if landed:
            stop(landed.pop(), frame)

    def begin_stop(name: str) -> None:
        """The stop a signal asks for: at once when one began already, else the graceful one
        (raising KeyboardInterrupt is what ends the server's loop)."""
        if at_once.is_set():
            raise KeyboardInterrupt
        if traffic is None or traffic.stopping.is_set():
            log.info("stopping at once on %s", name)
            stop_at_once()
            raise KeyboardInterrupt
        traffic.stopping.set()
        in_flight = traffic.count
        log.info(
            "stopping on %s: new requests are refused while %s finish (at most %g s; %s again"
            " stops at once)",
            name,
            f"the {in_flight} in flight" if in_flight else "the last answers",
            STOP_GRACE_S,
            name,
        )
        threading.Thread(
            target=_stop_when_answered,
            args=(server, traffic, answered),
            name="gmlx-stop",
            daemon=True,
        ).start()

    def stop_at_once() -> None:
        cut_short.set()
        if worker is not None:
            worker.abandon()

    def group_ended() -> None:
        stop_at_once()
        interrupt()

    for signum in STOP_SIGNALS:
        signal.signal(signum, stop)
    if group is not None:
        group.on_end = group_ended
    return stopping


def _stop_when_answered(server, traffic, interrupt: Callable[[], None]) -> None:
    """Interrupt the server's loop once no request is in flight and Waitress has sent every
    answer (its threads idle, no output waiting), or STOP_GRACE_S after the stop began."""

    deadline = time.monotonic() + STOP_GRACE_S
    while not _answered(server, traffic) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not _answered(server, traffic):
        log.warning(
            "stopping with %d requests still in flight after %g s", traffic.count, STOP_GRACE_S
        )
    interrupt()


def _answered(server, traffic) -> bool:
    dispatcher = server.task_dispatcher
    sending = any(getattr(c, "total_outbufs_len", 0) for c in list(server._map.values()))
    idle = dispatcher.active_count == 0 and not dispatcher.queue
    return traffic.count == 0 and idle and not sending
