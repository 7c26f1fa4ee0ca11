"""`gmlx serve` over several processes: one model's DiT sharded over an `mx.distributed` group.

Started by `mlx.launch --hostfile HOSTS --backend ring|mpi|nccl|jaccl -- gmlx serve ...` (or
`gmlx serve --hostfile HOSTS`, which runs that command), every process runs `gmlx serve`:

- **rank 0** serves HTTP and runs the image worker, as one process does. Each model it loads is
  loaded by every rank (the family's `load(..., shard=)` with the model's LoadSettings, which
  the load message carries: a rank holds its part of the DiT only, read from the same GGUF file
  where the settings name one, rank 0 the text encoder and the VAE besides, at the settings'
  dtype); on every step the worker hands the call's inputs
  to every rank (`broadcast`, an `all_sum` of the pickled call: the group's own collectives),
  then runs its own part, and answers.
- **the other ranks** run a `Follower`: it waits for rank 0's next message (load, step,
  unload, report, stop) and does its part of it; they serve no HTTP.

Held state stays in step: rank 0's prefix cache decides (its keys travel with each step and the
others drop what rank 0 dropped); a patch table travels once, with the first step that names it.

Failure. Collectives block, so rank 0 watches the group (`Group`): every other rank sends a UDP
heartbeat to rank 0 twice a second. A step while a rank is silent is refused 503 naming it; a
step under way when a rank falls silent (killed, stopped, its machine gone) or that outlasts the
rank timeout is answered 503 naming the rank, within that bound, by the HTTP thread waiting on it
(`GroupWorker`), and every model call is refused 503 while the step stays stuck. A step that
comes back (a stopped rank resumed) clears the state; a collective that failed (a rank's
connection lost) leaves the group broken: model calls are refused 503, and rank 0 ends
BROKEN_END_S later (a broken group cannot recover: start it again, all its processes:
docs/server.md). No rank outlives its launcher: each watches its parent (`watch_launcher`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import signal
import socket
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from gmlx_contract.errors import ContractError

from .engine.load_settings import LoadSettings
from .worker import ImageWorker

log = logging.getLogger("gmlx.server")

HEARTBEAT_S = 0.5  # how often a rank tells rank 0 it is alive
SILENT_S = 3.0  # a rank silent this long is named lost
RANK_TIMEOUT_S = 300.0  # the longest a step may take while every rank is heard
POLL_S = 0.2  # how often a waiting HTTP thread and the watchdog look at the group
BROKEN_END_S = 2.0  # how long rank 0 answers 503 after its group broke, before it ends
TABLES_SENT = 8  # patch tables the other ranks keep, least recently used dropped first
LAUNCH_RANK_VARIABLES = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def launched() -> bool:
    """Whether this process was started as a rank of a group (mlx.launch or mpirun)."""
    return any(name in os.environ for name in LAUNCH_RANK_VARIABLES)


# ---------------------------------------------------------------- messages


def broadcast(message: Any = None) -> Any:
    """Rank 0's `message` on every rank, pickled and summed over the group (the others add
    zeros): its length first, then its bytes."""
    import mlx.core as mx

    from .engine.shard import TRAFFIC

    group = mx.distributed.init()
    rank = group.rank()
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL) if rank == 0 else b""
    length = mx.distributed.all_sum(mx.array([len(data)], mx.int32), group=group)
    size = int(length.item())
    payload = np.frombuffer(data, np.uint8) if rank == 0 else np.zeros(size, np.uint8)
    TRAFFIC["inputs"] += size * 2 * (group.size() - 1) // group.size()
    summed = mx.distributed.all_sum(mx.array(payload), group=group)
    return pickle.loads(np.array(summed).tobytes())


def gather_ints(value: int) -> list[int]:
    """Each rank's `value`, in rank order, on every rank."""
    import mlx.core as mx

    group = mx.distributed.init()
    mine = np.zeros(group.size(), np.int64)
    mine[group.rank()] = value
    return [int(v) for v in np.array(mx.distributed.all_sum(mx.array(mine), group=group))]


def gather_texts(text: str) -> list[str]:
    """Each rank's `text`, in rank order, on every rank: each rank's bytes at its own offset of
    one buffer, summed over the group."""
    import mlx.core as mx

    group = mx.distributed.init()
    data = text.encode()
    lengths = gather_ints(len(data))
    if not sum(lengths):
        return [""] * group.size()
    start = sum(lengths[: group.rank()])
    buffer = np.zeros(sum(lengths), np.uint8)
    buffer[start : start + len(data)] = np.frombuffer(data, np.uint8)
    summed = np.array(mx.distributed.all_sum(mx.array(buffer), group=group)).astype(np.uint8)
    offsets = np.cumsum([0, *lengths])
    return [summed[a:b].tobytes().decode() for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


# ---------------------------------------------------------------- heartbeats


def heartbeat_address() -> tuple[str, int] | None:
    """Where rank 0 hears the heartbeats: GMLX_HEARTBEAT (host:port), else beside the group's
    own address of rank 0 (the ring's first port less one; NCCL's and JACCL's coordinator port
    less one); None when neither is known."""
    named = os.environ.get("GMLX_HEARTBEAT")
    if named:
        host, _, port = named.rpartition(":")
        return host, int(port)
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile and Path(hostfile).is_file() and Path(hostfile).read_text().strip():
        first = json.loads(Path(hostfile).read_text())[0][0]
        host, _, port = first.rpartition(":")
        return host, int(port) - 1
    if os.environ.get("MLX_JACCL_COORDINATOR"):
        host, _, port = os.environ["MLX_JACCL_COORDINATOR"].rpartition(":")
        return host, int(port) - 1
    if os.environ.get("NCCL_HOST_IP") and os.environ.get("NCCL_PORT"):
        return os.environ["NCCL_HOST_IP"], int(os.environ["NCCL_PORT"]) - 1
    return None


def start_heartbeat(rank: int, address: tuple[str, int]) -> threading.Thread:
    """A daemon thread sending this rank's number to rank 0 every HEARTBEAT_S."""

    def beat() -> None:
        sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        while True:
            try:
                sender.sendto(str(rank).encode(), address)
            except OSError as exc:
                log.debug("heartbeat to %s failed: %s", address, exc)
            time.sleep(HEARTBEAT_S)

    thread = threading.Thread(target=beat, name="gmlx-heartbeat", daemon=True)
    thread.start()
    return thread


def heartbeat_port_taken(address: tuple[str, int], exc: OSError) -> str:
    """Why rank 0 cannot hear heartbeats on `address`, naming the process that holds the port
    where the system says (an earlier rank 0 still running, typically)."""
    host, port = address
    holders = []
    try:
        import psutil

        for connection in psutil.net_connections(kind="udp"):
            if connection.laddr and connection.laddr.port == port and connection.pid:
                process = psutil.Process(connection.pid)
                holders.append(f"pid {connection.pid} ({' '.join(process.cmdline())[:120]})")
    except Exception:  # noqa: BLE001 - naming the holder is a courtesy; the refusal stands
        pass
    held = f", held by {', '.join(holders)}" if holders else ""
    return (
        f"the rank group's heartbeat port {host}:{port} is taken{held}: {exc.strerror}; stop"
        " that process, or start the group on other ports (mlx.launch --starting-port, or"
        " GMLX_HEARTBEAT=host:port)"
    )


def watch_launcher(on_gone, parent: int | None = None) -> threading.Thread:
    """A daemon thread calling `on_gone()` once this process's parent (its launcher:
    mlx.launch, or the shell that started the rank) has gone, so no rank outlives it."""
    parent = os.getppid() if parent is None else parent

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_S)
        log.error("the launcher (pid %d) has gone: this rank ends", parent)
        on_gone()

    thread = threading.Thread(target=watch, name="gmlx-launcher-watch", daemon=True)
    thread.start()
    return thread


class Heartbeats:
    """Rank 0's record of when each other rank was last heard."""

    def __init__(self, size: int, address: tuple[str, int] | None, clock=time.monotonic):
        self.clock = clock
        self.size = size
        self.heard = dict.fromkeys(range(1, size), clock())
        self.address = address
        if address is not None:
            self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                self._socket.bind(address)
            except OSError as exc:
                self._socket.close()
                raise OSError(exc.errno, heartbeat_port_taken(address, exc)) from exc
            threading.Thread(target=self._listen, name="gmlx-heartbeats", daemon=True).start()

    def _listen(self) -> None:
        while True:
            data, _ = self._socket.recvfrom(64)
            try:
                rank = int(data)
            except ValueError:
                continue
            if rank in self.heard:
                self.heard[rank] = self.clock()

    def silent(self) -> dict[int, float]:
        """The ranks not heard for SILENT_S, with how long they have been silent."""
        if self.address is None:
            return {}
        now = self.clock()
        return {r: now - t for r, t in self.heard.items() if now - t > SILENT_S}


# ---------------------------------------------------------------- rank 0


class Group:
    """Rank 0's view of the group: the shard mode, the heartbeats, the step under way, and
    whether the group can take model work (`check`)."""

    def __init__(self, mode: str, size: int, rank_timeout_s: float = RANK_TIMEOUT_S):
        self.mode = mode
        self.size = size
        self.rank_timeout_s = rank_timeout_s
        self.heartbeats = Heartbeats(size, heartbeat_address())
        self.broken: str | None = None  # why the group takes no more work (it then ends)
        self.stuck: str | None = None  # why the call under way is abandoned (while it lasts)
        self.on_end = None  # how rank 0 stops when the group cannot go on (set by `gmlx serve`)
        self._pending: tuple[str, float] | None = None
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, name="gmlx-watchdog", daemon=True).start()

    def shard(self, rank: int = 0):
        from .engine.shard import Shard

        return Shard(self.mode, rank, self.size)

    def describe(self) -> dict:
        """What capabilities and status report (an extension of docs/contract.md §2.1, §2.3)."""
        silent = self.heartbeats.silent()
        return {
            "world_size": self.size,
            "mode": self.mode,
            "state": "broken" if self.broken else "stuck" if self.stuck else "ok",
            "reason": self.broken or self.stuck,
            "silent_ranks": sorted(silent),
        }

    def failure(self) -> str | None:
        """Why model work is refused now, or None."""
        return self.broken or self.stuck

    def check(self) -> None:
        """503 when the group cannot take a call now: broken, stuck, or a rank silent."""
        reason = self.failure()
        if reason is None:
            silent = self.heartbeats.silent()
            if silent:
                rank, quiet = max(silent.items(), key=lambda item: item[1])
                reason = f"rank {rank} of {self.size} has not been heard for {quiet:.1f} s"
        if reason is not None:
            raise ContractError(503, f"the rank group cannot take model work: {reason}")

    def in_call(self) -> bool:
        """Whether a group call is under way."""
        with self._lock:
            return self._pending is not None

    @contextmanager
    def call(self, what: str):
        """Run a group call (the broadcast and this rank's part): watched while under way; a
        collective that fails leaves the group broken."""
        self.check()
        with self._lock:
            self._pending = (what, time.monotonic())
        try:
            yield
        except RuntimeError as exc:
            self.broken = f"{what} failed on the group ({exc}); {self._named_loss()}"
            log.error("rank group broken: %s; rank 0 ends in %.0f s", self.broken, BROKEN_END_S)
            self.end_soon()
            raise ContractError(503, f"the rank group failed: {self.broken}") from exc
        finally:
            with self._lock:
                self._pending = None
            if self.stuck:
                log.warning("the abandoned %s came back; the group takes work again", what)
                self.stuck = None

    def _named_loss(self) -> str:
        """The rank that went silent (waiting up to SILENT_S for its heartbeats to stop)."""
        deadline = time.monotonic() + SILENT_S + 2 * HEARTBEAT_S
        while time.monotonic() < deadline:
            silent = self.heartbeats.silent()
            if silent:
                return f"rank {max(silent, key=silent.get)} of {self.size} is lost"
            time.sleep(POLL_S)
        return "every rank is still heard; restart the group"

    def launcher_gone(self) -> None:
        """The launcher has gone: the other ranks end with it, so the group cannot go on."""
        self.broken = self.broken or "the launcher has gone, and the other ranks with it"
        if self.on_end is not None:
            self.on_end()

    def end_soon(self) -> None:
        """Stop rank 0 (`on_end`) after BROKEN_END_S, so the requests under way are answered
        503 first: a broken group cannot recover, and rank 0 must not outlive it."""

        def end() -> None:
            time.sleep(BROKEN_END_S)
            if self.on_end is not None:
                self.on_end()

        threading.Thread(target=end, name="gmlx-group-end", daemon=True).start()

    def _watch(self) -> None:
        while True:
            time.sleep(POLL_S)
            with self._lock:
                pending = self._pending
            if pending is None or self.stuck:
                continue
            what, since = pending
            silent = self.heartbeats.silent()
            elapsed = time.monotonic() - since
            if silent:
                rank = max(silent, key=silent.get)
                self.stuck = (
                    f"rank {rank} of {self.size} went silent during a {what}"
                    f" ({silent[rank]:.1f} s unheard)"
                )
            elif elapsed > self.rank_timeout_s:
                self.stuck = (
                    f"a {what} outlasted the rank timeout of {self.rank_timeout_s:.0f} s"
                    " with every rank heard"
                )
            if self.stuck:
                log.error("rank group stuck: %s", self.stuck)


class GroupWorker(ImageWorker):
    """The image worker of rank 0: a caller waits for its job only while the group can work; a
    stuck or broken group turns every wait into a 503 within POLL_S."""

    def __init__(self, group: Group, name: str = "gmlx-image") -> None:
        super().__init__(name)
        self.group = group

    def call(self, fn, *args, **kwargs):
        if self.on_worker_thread():
            return fn(*args, **kwargs)
        self._refuse_if_failed()
        future = self.submit(fn, *args, **kwargs)
        while True:
            try:
                return future.result(timeout=POLL_S)
            except TimeoutError:
                self._refuse_if_failed()

    def _refuse_if_failed(self) -> None:
        reason = self.group.failure()
        if reason is not None:
            raise ContractError(503, f"the rank group cannot take model work: {reason}")


class GroupFamily:
    """A family as rank 0's registry sees it: `load` loads the model on every rank (the
    others after rank 0's `load` message, which carries the model's LoadSettings whole) and
    wraps rank 0's in a `GroupModel`; the rest is the family's own (engine.spec.Family)."""

    def __init__(self, spec: Any, family: Any, group: Group):
        self._spec, self._family, self._group = spec, family, group

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._family, attribute)

    def load(self, model_dir: Path, model_id: str, **options) -> GroupModel:
        if not self._spec.shards:
            raise ContractError(
                400,
                f"model {model_id!r}: family {self._spec.name} has no shard plan; it cannot load over"
                f" a group of {self._group.size} ranks (serve it from one process)",
            )
        group = self._group
        settings = LoadSettings(**options)
        body = {"family": self._spec.name, "path": str(model_dir), "model_id": model_id}
        with group.call("load"):
            broadcast(("load", {**body, "settings": settings}))
            failure, model = None, None
            try:
                model = load_shard(self._family, model_dir, model_id, settings, group.shard(0))
            except Exception as exc:  # noqa: BLE001 - every rank reports before anyone raises
                failure = exc
            weights, refusals = gather_loads(model, None)
            if refusals or failure is not None:  # the ranks that did load let their shard go
                broadcast(("unload", {"model_id": model_id}))
        if failure is not None:
            raise failure
        if refusals:
            model.close()
            status = max(code for code, _ in refusals.values())
            said = "; ".join(text for _, text in refusals.values())
            raise ContractError(
                status, f"model {model_id!r} failed to load on rank(s) {sorted(refusals)}: {said}"
            )
        return GroupModel(model, group, weights)


def gather_loads(model: Any, refusal: tuple[int, str] | None):
    """Every rank's outcome of a load, on every rank: each rank's weight bytes (-1 where it
    failed) and the other ranks' refusals by rank, (status, why)."""
    weights = gather_ints(-1 if model is None else model.weight_bytes)
    statuses = gather_ints(0 if refusal is None else refusal[0])
    texts = gather_texts("" if refusal is None else refusal[1])
    refusals = {
        rank: (status, text)
        for rank, (status, text) in enumerate(zip(statuses, texts, strict=True))
        if status and rank != 0
    }
    return weights, refusals


@dataclasses.dataclass(frozen=True)
class Absent:
    """An array a rank does not need (its state is held): only its shape travels; the rank
    reads it as zeros of that shape that take no memory (`present`)."""

    shape: tuple[int, ...]


def present(value):
    return np.broadcast_to(np.float32(0), value.shape) if isinstance(value, Absent) else value


def load_shard(module: Any, model_dir: Path, model_id: str, settings: LoadSettings, shard) -> Any:
    """A rank's part of a model: the family's load with its `shard` and the model's settings,
    rank 0's whole, another rank's those of its DiT part (LoadSettings.dit_part). A file the
    settings name that is not on this rank is refused naming the rank and the file."""
    mine = settings if shard.rank == 0 else settings.dit_part()
    for key, path in mine.files().items():
        if not Path(path).is_file():
            raise FileNotFoundError(
                f"rank {shard.rank} of {shard.size} has no file {str(path)!r} (the model's {key})"
            )
    return module.load(model_dir, model_id, shard=shard, **mine.options())


class GroupModel:
    """Rank 0's loaded model in a group: every step goes to every rank first."""

    def __init__(self, model: Any, group: Group, rank_weight_bytes: list[int]):
        self._model = model
        self._group = group
        self.rank_weight_bytes = rank_weight_bytes
        self._tables_sent: OrderedDict[str, None] = OrderedDict()

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._model, attribute)

    def status(self) -> dict:
        status = self._model.status()
        status["distributed"] = {
            **self._group.describe(),
            "rank_weight_bytes": self.rank_weight_bytes,
        }
        return status

    def denoise_step(self, x, timestep, rows, *, table=None, plans=None, **options):
        group = self._group
        with group.call("step"):
            broadcast(("step", self._step_message(x, timestep, rows, table, options)))
            return self._model.denoise_step(x, timestep, rows, table=table, plans=plans, **options)

    def _step_message(self, x, timestep, rows, table, options) -> dict:
        """What every rank needs to run the step: its inputs, the patch table when the ranks
        do not hold it yet, and the states rank 0 holds (the others drop the rest). Rows the
        model refuses raise here, before anything is recorded as sent."""
        held = set(self._model.state_keys())
        light_rows = [self._light(row, held, x, table) for row in rows]
        send_table = None
        if table is not None:
            if table.table_id not in self._tables_sent:
                send_table = table
            self._tables_sent[table.table_id] = None
            self._tables_sent.move_to_end(table.table_id)
            while len(self._tables_sent) > TABLES_SENT:
                self._tables_sent.popitem(last=False)
        return {
            "model_id": self._model.model_id,
            "x": x,
            "timestep": timestep,
            "rows": light_rows,
            "options": options,
            "table_id": None if table is None else table.table_id,
            "table": send_table,
            "tables": list(self._tables_sent),
            "states": list(held),
        }

    def _light(self, row, held: set, x, table):
        """The row as the other ranks need it: a row that uses the prefix cache and whose
        states rank 0 holds (a prefix hit, which the others hold too) travels without its
        conditioning and references, `Absent` in their place; the rest whole."""
        keys = self._model.step_keys(np.shape(x), [row], table)
        if not row.prefix_cache or not keys or not keys <= held:  # its state is built now
            return row
        return dataclasses.replace(
            row,
            cond=Absent(np.shape(row.cond)),
            ref_latents=tuple(Absent(np.shape(ref)) for ref in row.ref_latents),
        )

    def close(self) -> None:
        try:
            with self._group.call("unload"):
                broadcast(("unload", {"model_id": self._model.model_id}))
        except ContractError as exc:
            log.warning("the other ranks did not hear the unload: %s", exc.message)
        finally:
            self._model.close()


def attach(group: Group, registry: Any) -> None:
    """Make rank 0's registry load every model over the group."""
    registry.wrap_families(lambda spec, family: GroupFamily(spec, family, group))


REPORT_FIGURES = ("weight_bytes", "peak_rss_bytes", "collective_bytes", "pid")


def rank_figures(models) -> list[int]:
    """This process's REPORT_FIGURES: its models' weights, its peak resident set, the bytes it
    has handed to the group's collectives (engine.shard.TRAFFIC) and its process id."""
    import resource
    import sys

    from .engine.shard import TRAFFIC

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return [
        sum(model.weight_bytes for model in models),
        rss if sys.platform == "darwin" else rss * 1024,
        sum(TRAFFIC.values()),
        os.getpid(),
    ]


def report(group: Group, models) -> list[dict]:
    """Each rank's REPORT_FIGURES (rank 0's for `models`), asked of every rank."""
    with group.call("report"):
        broadcast(("report", {}))
        columns = [gather_ints(value) for value in rank_figures(models)]
    return [dict(zip(REPORT_FIGURES, row, strict=True)) for row in zip(*columns, strict=True)]


def stop_group(group: Group) -> None:
    """Tell the other ranks to end (rank 0 shutting down). Not while the image worker is still
    in a group call (a stop at once that did not wait for it): a broadcast from here would
    mix into that call's; the other ranks then end as rank 0's connections close."""
    if group.in_call():
        log.warning(
            "the rank group is still in a group call: the stop is not sent; the other ranks"
            " end as this rank's connections close"
        )
        return
    try:
        with group.call("stop"):
            broadcast(("stop", {}))
    except ContractError as exc:
        log.warning("the other ranks did not hear the stop: %s", exc.message)


# ---------------------------------------------------------------- the other ranks


class Follower:
    """A rank other than 0: its models' shards, the patch tables rank 0 sent, by model."""

    def __init__(self, mode: str, rank: int, size: int):
        from .engine.shard import Shard

        self.shard = Shard(mode, rank, size)
        self.models: dict[str, Any] = {}
        self.tables: dict[str, dict[str, Any]] = {}

    def run(self) -> int:
        address = heartbeat_address()
        if address is not None:
            start_heartbeat(self.shard.rank, address)
        while True:
            kind, body = broadcast()
            if kind == "stop":
                return 0
            getattr(self, "on_" + kind)(body)

    def on_load(self, body: dict) -> None:
        from .engine.registry import ModelEntry, implementation, load_refusal
        from .engine.spec import family_specs

        model, refusal = None, None
        path, model_id = Path(body["path"]), body["model_id"]
        try:
            family = implementation(family_specs()[body["family"]])
            model = load_shard(family, path, model_id, body["settings"], self.shard)
        except Exception as exc:  # noqa: BLE001 - reported to rank 0 through the gather
            log.exception("rank %d could not load %s", self.shard.rank, model_id)
            entry = ModelEntry(model_id, path, body["family"], None)
            refusal = (load_refusal(entry, exc).status, f"{type(exc).__name__}: {exc}")
        gather_loads(model, refusal)
        if model is not None:
            self.models[model_id] = model
            self.tables[model_id] = {}
            log.info("rank %d holds its shard of %s", self.shard.rank, model_id)

    def on_unload(self, body: dict) -> None:
        model = self.models.pop(body["model_id"], None)
        self.tables.pop(body["model_id"], None)
        if model is not None:
            model.close()

    def on_step(self, body: dict) -> None:
        """This rank's part of a step. Input the model refuses is refused by rank 0 as well,
        before any collective (answered 400 there): both go on with the next message."""
        from .engine.base import EngineInputError

        try:
            self._step(body)
        except EngineInputError as exc:
            log.info("rank %d: the step was refused: %s", self.shard.rank, exc)

    def _step(self, body: dict) -> None:
        model = self.models[body["model_id"]]
        tables = self.tables[body["model_id"]]
        if body["table"] is not None:
            tables[body["table_id"]] = body["table"]
        for table_id in [t for t in tables if t not in body["tables"]]:
            del tables[table_id]
        model.keep_states(body["states"])
        table = None if body["table_id"] is None else tables[body["table_id"]]
        rows = [
            dataclasses.replace(
                row,
                cond=present(row.cond),
                ref_latents=tuple(present(ref) for ref in row.ref_latents),
            )
            for row in body["rows"]
        ]
        model.denoise_step(body["x"], body["timestep"], rows, table=table, **body["options"])

    def on_report(self, body: dict) -> None:
        for value in rank_figures(self.models.values()):
            gather_ints(value)


# ---------------------------------------------------------------- joining


BACKEND_VARIABLES = (
    ("MLX_IBV_DEVICES", "jaccl"),
    ("NCCL_HOST_IP", "nccl"),
    ("MLX_HOSTFILE", "ring"),
    ("OMPI_COMM_WORLD_RANK", "mpi"),
    ("PMI_RANK", "mpi"),
)


def launched_backend() -> str:
    """The backend mlx.launch (or mpirun) started this process for, from its environment."""
    for variable, backend in BACKEND_VARIABLES:
        if variable in os.environ:
            return backend
    return "ring"


def join(mode: str, rank_timeout_s: float = RANK_TIMEOUT_S) -> Group | None:
    """This process's place in its group: None when it was not launched as a rank (one
    process); on rank 0 the `Group`; on any other rank the follower runs until rank 0 stops it,
    and the process then ends."""
    if not launched():
        return None
    import mlx.core as mx

    world = mx.distributed.init(strict=True, backend=launched_backend())
    if world.size() == 1:
        return None
    if world.rank() != 0:
        log.info("rank %d of %d: following rank 0 (%s)", world.rank(), world.size(), mode)
        # Ctrl-C reaches every rank of a launched group at once. A rank other than 0 ends on
        # rank 0's stop, which it cannot hear once dead: rank 0 would then wait on it for ever.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        watch_launcher(lambda: os._exit(1))
        code = Follower(mode, world.rank(), world.size()).run()
        logging.shutdown()
        os._exit(code)
    log.info("rank 0 of %d: serving, the DiT sharded in %s mode", world.size(), mode)
    group = Group(mode, world.size(), rank_timeout_s)
    watch_launcher(group.launcher_gone)
    return group


LAUNCH_FLAGS = ("--hostfile", "--backend")  # `gmlx serve`'s, for mlx.launch, not the ranks


def launch_command(hostfile: Path, backend: str, argv: list[str]) -> list[str]:
    """The mlx.launch command that starts `gmlx <argv>` (less --hostfile and --backend) on
    every host of `hostfile`."""
    import sys

    kept, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word in LAUNCH_FLAGS:
            skip = True
        elif not word.startswith(tuple(flag + "=" for flag in LAUNCH_FLAGS)):
            kept.append(word)
    return [
        sys.executable,
        "-c",
        "from mlx._distributed_utils.launch import main; main()",
        "--hostfile",
        str(hostfile),
        "--backend",
        backend,
        "--",
        sys.executable,
        "-m",
        "gmlx_server",
        *kept,
    ]
