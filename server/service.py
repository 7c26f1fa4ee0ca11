"""The steps service: the state the step routes share.

* two byte-bounded LRU caches of content-addressed tensors (conditionings etc., and adapter
  matrices), filled only with tensors whose hash was verified;
* patch tables, kept on the loaded model instance they were built for, the least recently used
  dropped beyond twice the adapter cache's bound;
* runs: ids, idle end, holds on their model, interrupt and end (docs/contract.md §3.1-3.2);
* the way into the image worker for model work.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from gmlx_contract import wire
from gmlx_contract.errors import ContractError
from gmlx_contract.hashing import hash_parts, table_id

from .config import ImageConfig
from .engine.registry import LoadedModel, ModelRegistry
from .memory import MemoryPlanner
from .worker import ImageWorker, WorkerStopped

log = logging.getLogger("gmlx.server")

MiB = 1 << 20
FLOAT_DTYPES = ("F32", "F16", "BF16")


# ---------------------------------------------------------------- cached tensors


@dataclass(frozen=True)
class CachedTensor:
    """A tensor as it travelled: numpy holds BF16 as uint16 bits, `dtype` is the wire name."""

    array: np.ndarray
    dtype: str

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    def float32(self) -> np.ndarray:
        """The values as float32 (BF16 bit-cast exactly, never reinterpreted as integers)."""
        if self.dtype == "BF16":
            return wire.bf16_bits_to_f32(self.array)
        return np.asarray(self.array, dtype=np.float32)


def tensor_of(container: wire.Container, name: str) -> CachedTensor:
    return CachedTensor(container.tensors[name], container.dtypes[name])


def verified(digest: str, container: wire.Container, name: str) -> CachedTensor:
    """The tensor `name` of a container, if it hashes to `digest` (else 400 with `got`)."""
    tensor = tensor_of(container, name)
    got = hash_parts(tensor.dtype, tensor.shape, container.raw(name))
    if got != digest:
        raise ContractError(
            400, f"the uploaded tensor hashes to {got}, not to {digest} named in the path", got=got
        )
    return tensor


def compact(tensor: CachedTensor) -> CachedTensor:
    """The tensor holding only its own bytes, for keeping in a cache. An upload's array is a
    view over the whole request body, which may carry unused bytes after the tensor: kept as
    is, a 4-byte tensor could pin a 1 GiB body while the cache counts 4 bytes."""
    array = tensor.array
    if array.base is None and array.flags.c_contiguous:
        return tensor
    return CachedTensor(np.array(array, copy=True, order="C"), tensor.dtype)


def hash_of(tensor: CachedTensor) -> str:
    data = np.ascontiguousarray(tensor.array)
    return hash_parts(tensor.dtype, data.shape, data.reshape(-1).view(np.uint8).data)


class ByteLRU:
    """Least-recently-used store bounded in bytes. The newest entry always stays, even alone
    over the bound; `has` (a HEAD) does not refresh an entry, `get` (a step's read) does."""

    def __init__(self, name: str, bound_bytes: int) -> None:
        self.name = name
        self._bound = int(bound_bytes)
        self._items: OrderedDict[str, CachedTensor] = OrderedDict()
        self._total = 0
        self._lock = threading.Lock()
        self.hits = 0  # `get`s that found their entry, and those that did not (server/metrics.py)
        self.misses = 0

    @property
    def bound(self) -> int:
        return self._bound

    @property
    def limit(self) -> int:
        """The largest single upload: min(1 GiB, the bound) (docs/contract.md §1.5)."""
        return min(wire.MAX_UPLOAD_BYTES, self._bound)

    @property
    def total(self) -> int:
        return self._total

    def __len__(self) -> int:
        return len(self._items)

    def has(self, digest: str) -> bool:
        with self._lock:
            return digest in self._items

    def get(self, digest: str) -> CachedTensor | None:
        with self._lock:
            tensor = self._items.get(digest)
            if tensor is None:
                self.misses += 1
            else:
                self.hits += 1
                self._items.move_to_end(digest)
            return tensor

    def put(self, digest: str, tensor: CachedTensor) -> None:
        tensor = compact(tensor)  # outside the lock: a copy of a large upload takes a while
        with self._lock:
            old = self._items.pop(digest, None)
            if old is not None:
                self._total -= old.nbytes
            self._items[digest] = tensor
            self._total += tensor.nbytes
            self._evict()

    def set_bound(self, bound_bytes: int) -> None:
        with self._lock:
            self._bound = int(bound_bytes)
            self._evict()

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._total = 0

    def _evict(self) -> None:
        while self._total > self._bound and len(self._items) > 1:
            _, dropped = self._items.popitem(last=False)
            self._total -= dropped.nbytes


# ---------------------------------------------------------------- patch tables

PATCH_MEMBERS = frozenset(("up", "down", "alpha", "strength", "strength_model", "kind", "adapter"))
KEY_PREFIXES = ("model.diffusion_model.", "diffusion_model.")


@dataclass(frozen=True)
class LoraPatch:
    up: np.ndarray  # (out, rank) float32
    down: np.ndarray  # (rank, in) float32
    scale: float  # alpha / rank, or 1.0 when alpha is null
    strength: float


@dataclass(frozen=True)
class PatchEntry:
    key: str  # as the client sent it
    layer: str  # the DiT weight it patches: the key without prefix and `.weight`
    band: tuple[int, int, int] | None  # (dim, start, length)
    patches: tuple[LoraPatch, ...]


@dataclass(frozen=True)
class PatchTable:
    table_id: str
    model_id: str
    entries: tuple[PatchEntry, ...]

    @cached_property  # memory plans ask every step
    def nbytes(self) -> int:
        """The float32 matrices the table holds (some may be views of adapter cache entries:
        counted anyway, as the table keeps them alive after the cache lets them go)."""
        return sum(p.up.nbytes + p.down.nbytes for e in self.entries for p in e.patches)


# A model instance's tables hold float32 matrices of adapters the cache held when each was
# defined (twice their bytes for 16-bit uploads), so twice the cache's bound fits any one table.
TABLES_BOUND_FACTOR = 2


def table_adapter_hashes(entries: list) -> list[str]:
    """Every up/down a table names, as strings (an absent or non-string field becomes its
    string form, e.g. "None", docs/contract.md §2.9 quirk). Parts that are not objects/lists are
    skipped here; `build_table` refuses them afterwards."""
    names: list[str] = []
    for entry in entries:
        patches = entry.get("patches") if isinstance(entry, dict) else None
        for patch in patches if isinstance(patches, list) else ():
            if isinstance(patch, dict):
                for side in ("up", "down"):
                    value = patch.get(side)
                    names.append(value if isinstance(value, str) else str(value))
    return names


def build_table(
    loaded: LoadedModel, digest: str, doc: dict, adapters: dict[str, CachedTensor]
) -> PatchTable:
    """Validate a table's schema (docs/contract.md §2.9) and build it from the adapter matrices.

    Runs on the image worker. Whether each key is a linear layer of the DiT and whether each
    pair's shapes fit that layer and band is the model's to say: its `check_patch_table(table)`
    raises EngineInputError when they do not.
    """
    entries = tuple(
        _build_entry(i, entry, adapters) for i, entry in enumerate(doc.get("entries", []))
    )
    table = PatchTable(table_id=digest, model_id=loaded.model_id, entries=entries)
    loaded.model.check_patch_table(table)
    return table


def _build_entry(index: int, entry: Any, adapters: dict[str, CachedTensor]) -> PatchEntry:
    where = f"entries[{index}]"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be an object")
    key = entry.get("key")
    if not isinstance(key, str) or not key:
        raise ValueError(f"{where}.key must be a non-empty string")
    layer = _layer_of(key, where)
    band = _band_of(entry.get("band"), where)
    patches = entry.get("patches")
    if not isinstance(patches, list):
        raise ValueError(f"{where}.patches must be a list")
    built = tuple(
        _build_patch(f"{where}.patches[{j}]", patch, adapters) for j, patch in enumerate(patches)
    )
    return PatchEntry(key=key, layer=layer, band=band, patches=built)


def _layer_of(key: str, where: str) -> str:
    if key.endswith(".bias"):
        raise ValueError(f"{where}.key {key!r} names a bias; only linear weights take patches")
    for prefix in KEY_PREFIXES:
        if key.startswith(prefix):
            key = key[len(prefix) :]
            break
    return key.removesuffix(".weight")


def _band_of(band: Any, where: str) -> tuple[int, int, int] | None:
    if band is None:
        return None
    if (
        not isinstance(band, list)
        or len(band) != 3
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in band)
        or band[1] < 0
        or band[2] <= 0
        or band[0] < 0
    ):
        raise ValueError(f"{where}.band must be null or [dim, start, length] of integers")
    return band[0], band[1], band[2]


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a finite number")
    try:
        number = float(value)
    except OverflowError:  # an integer past float's range
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{what} must be a finite number")
    return number


def _build_patch(where: str, patch: Any, adapters: dict[str, CachedTensor]) -> LoraPatch:
    if not isinstance(patch, dict):
        raise ValueError(f"{where} must be an object")
    unknown = sorted(set(patch) - PATCH_MEMBERS)
    if unknown:
        raise ValueError(f"{where} has unknown members {unknown}")
    if patch.get("kind", "lora") != "lora":
        raise ValueError(f"{where}.kind {patch['kind']!r} is not supported (only 'lora')")
    if _number(patch.get("strength_model", 1.0), f"{where}.strength_model") != 1.0:
        raise ValueError(f"{where}.strength_model other than 1.0 (scaling the weight) is refused")
    strength = _number(patch.get("strength", 1.0), f"{where}.strength")
    up = _matrix(adapters[patch["up"]], f"{where}.up")
    down = _matrix(adapters[patch["down"]], f"{where}.down")
    rank = down.shape[0]
    if up.shape[1] != rank:
        raise ValueError(f"{where}: up {up.shape} and down {down.shape} disagree on the rank")
    alpha = patch.get("alpha")
    scale = 1.0 if alpha is None else _number(alpha, f"{where}.alpha") / rank
    if not math.isfinite(scale * strength):
        raise ValueError(f"{where}: alpha / rank x strength ({scale} x {strength}) is not finite")
    return LoraPatch(up=up, down=down, scale=scale, strength=strength)


def _matrix(tensor: CachedTensor, what: str) -> np.ndarray:
    if tensor.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{what} is {tensor.dtype}; adapter matrices must be floating point")
    if tensor.array.ndim < 2 or tensor.array.shape[0] == 0:
        raise ValueError(f"{what} of shape {list(tensor.shape)} is not a matrix")
    values = tensor.float32()
    return values.reshape(values.shape[0], -1)


# ---------------------------------------------------------------- runs


@dataclass
class Run:
    run_id: str
    loaded: LoadedModel
    last_active: float
    interrupted: bool = False
    ended: bool = False
    in_flight: int = 0
    steps: int = 0
    rows: int = 0
    forward_ms: float = 0.0
    prefix: dict[str, int] = field(default_factory=dict)
    # x's shape at the run's last finished step: a step of the same shape skips the quick
    # memory plan (its detailed plan on the worker refuses whatever the quick one would).
    planned_shape: tuple[int, ...] | None = None

    @property
    def model_id(self) -> str:
        return self.loaded.model_id

    def record(self, shape: tuple[int, ...], forward_ms: float, prefix_cache: str) -> None:
        """Under the service's lock (StepsService.record_step)."""
        rows = shape[0]
        self.planned_shape = shape
        self.steps += 1
        self.rows += rows
        self.forward_ms += forward_ms
        self.prefix[prefix_cache] = self.prefix.get(prefix_cache, 0) + 1


def interrupted_error(run_id: str) -> ContractError:
    return ContractError(
        409, f"run {run_id} was interrupted or ended; its step was discarded", code="interrupted"
    )


# ---------------------------------------------------------------- the service


# How long a stop waits for the image worker to let the models go (behind the job it runs).
CLOSE_WAIT_S = 30.0


class StepsService:
    def __init__(
        self,
        registry: ModelRegistry,
        worker: ImageWorker,
        config: ImageConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        config = config or ImageConfig()
        self.registry = registry
        self.worker = worker
        self.idle_s = float(config.run_idle_s)
        self.sweep_s = float(config.run_sweep_s)
        self.tensors = ByteLRU("tensors", config.tensor_cache_mb * MiB)
        self.adapters = ByteLRU("adapters", config.adapter_cache_mb * MiB)
        self.memory = MemoryPlanner(registry, [self.tensors, self.adapters], config)
        self._bounds_for: frozenset = frozenset()  # the loaded models the bounds were fit to
        self._bounds_lock = threading.Lock()  # HTTP threads refit after their acquires
        self._tables_lock = threading.Lock()
        self.clock = clock
        self._runs: dict[str, Run] = {}
        self._reserved = 0  # begins between their count check and their model load
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="gmlx-sweeper", daemon=True)
        self.config = config
        self._image_store = None

    def start(self) -> None:
        self.worker.start()
        self._sweeper.start()

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """End every run, let the models go and stop the worker (shutdown), waiting at most
        `wait_s` for the job the worker runs. A second close does nothing."""
        if self._stop.is_set():
            return
        self._stop.set()
        with self._lock:
            run_ids = list(self._runs)
        for run_id in run_ids:
            self.end_run(run_id, reason="shutdown")
        busy = False
        try:
            self.worker.submit(self.registry.unload_all).result(timeout=wait_s)
        except WorkerStopped:  # stopped at once (abandoned): the process's end frees the models
            busy = True
        except (TimeoutError, futures.TimeoutError):  # a job that runs on: do not hang
            busy = True
            log.warning(
                "the image worker is still busy %g s into the stop; stopping without letting"
                " the models go first (the process's end frees them)",
                wait_s,
            )
        except Exception:  # noqa: BLE001 - shutting down regardless
            log.exception("unloading models at shutdown failed")
        self.worker.stop(timeout=0 if busy else wait_s)
        if self._sweeper.is_alive():
            self._sweeper.join(timeout=self.sweep_s + 1)
        with self._lock:
            store, self._image_store = self._image_store, None
        if store is not None:
            store.close()

    def image_store(self, create: bool = True):
        """The OpenAI routes' store of images answered by URL (server/image_store.py), made the
        first time one is put (None before that, when `create` is false)."""
        from .image_store import ImageStore

        with self._lock:
            if self._image_store is None and create:
                image = self.config
                folder = Path(image.image_url_dir) if image.image_url_dir else None
                self._image_store = ImageStore(
                    folder, image.image_url_ttl_s, image.image_url_store_mb * MiB
                )
            return self._image_store

    # ------------------------------------------------------------ models

    def acquire(self, model_id: Any) -> LoadedModel:
        """Load the model on the worker (if needed) and hold it; `release` when done."""
        loaded = self.worker.call(self.registry.acquire, model_id)
        self.fit_cache_bounds()
        return loaded

    def acquire_for_step(self, model_field: Any, run: Run | None) -> LoadedModel:
        """docs/contract.md §2.11 step 4. A step on a live run that names no other model takes a hold on
        the instance its run holds: no worker round trip, no resolving (the run's own hold keeps
        that instance loaded). A step naming another model resolves it as before: the step does
        not check its model against its run's (docs/step-routes.md)."""
        if run is not None and model_field in (None, run.model_id):
            with self._lock:  # end_run marks the run ended under this lock, then releases
                if not run.ended:
                    self.registry.hold(run.loaded)
                    return run.loaded
        return self.acquire(
            run.model_id if model_field is None and run is not None else model_field
        )

    def fit_cache_bounds(self) -> None:
        """Refit the upload caches' bounds to the loaded models' memory plans when the set of
        loaded models changed (docs/contract.md §2.1)."""
        with self._bounds_lock:  # the check and the refit as one, against a newer set
            current = frozenset(
                (m.model_id, m.generation)
                for m in map(self.registry.loaded, self.registry.resident_ids())
                if m is not None
            )
            if current != self._bounds_for:
                self._bounds_for = current
                self.memory.fit_cache_bounds()

    def release(self, loaded: LoadedModel) -> None:
        self.registry.release(loaded)

    def on_model(self, loaded: LoadedModel, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """Run fn(model, ...) on the worker."""
        return self.worker.call(fn, loaded.model, *args, **kw)

    def upsampled_prompt(
        self, loaded: LoadedModel, text: str, images: list, asked: bool | None
    ) -> str | None:
        """The prompt rewritten by the model entry's upsampler (docs/contract.md §2.6), on the
        worker, or None where it is not: the request forbids it (false), or leaves it to the
        entry (null) and the entry does not ask for it, or images are given, or the prompt is
        empty (nothing to expand: the pipelines' negative prompt is never rewritten). Asked for
        (true) where the entry names no upsampler: 400."""
        settings = self.registry.settings_for(loaded.entry)
        folder = getattr(settings, "prompt_upsampler", None)
        if asked is True and folder is None:
            raise ContractError(
                400,
                f"prompt_upsampling was asked for, but model {loaded.entry.model_id!r} has no"
                " prompt upsampler (its [models] entry names no prompt_upsampler)",
            )
        wanted = getattr(settings, "prompt_upsampling", False) if asked is None else asked
        if not wanted or folder is None or images or not text.strip():
            return None

        def rewrite() -> str:
            from .engine import upsampling
            from .engine.nn.dtypes import encoder_vae_dtype

            dtype = encoder_vae_dtype(settings.encoder_vae_dtype)
            self.memory.check_upsample(loaded, upsampling.need_bytes(folder, dtype))
            return upsampling.rewrite(folder, text, dtype, settings.quantization)

        return self.worker.call(rewrite)

    def encode(self, loaded: LoadedModel, text: str, images: list, refs: bool) -> Any:
        """The model's encode on the worker, between the memory plan's look at the text
        encoder's residency (a released encoder loads again) and its release after the encode
        where the residency says so."""

        def encode() -> Any:
            self.memory.check_encode(loaded)
            try:
                return loaded.model.encode(text, images, refs)
            finally:
                self.memory.after_encode(loaded)

        return self.worker.call(encode)

    # ------------------------------------------------------------ caches

    def store_tensor(self, tensor: CachedTensor) -> str:
        """Keep a tensor the server made itself (encode); 413 over the upload limit."""
        if tensor.nbytes > self.tensors.limit:
            raise ContractError(
                413,
                f"tensor of {tensor.nbytes} bytes is over the tensor cache limit of "
                f"{self.tensors.limit} bytes (server.image.tensor_cache_mb)",
            )
        digest = hash_of(tensor)
        self.tensors.put(digest, tensor)
        return digest

    # ------------------------------------------------------------ patch tables

    def put_table(self, digest: str, doc: Any, query_model: str | None) -> str:
        """PUT patch-tables/{digest} in the order of docs/contract.md §2.9."""
        got = table_id(doc)
        if got != digest:
            raise ContractError(
                400, f"the table's id is {got}, not {digest} named in the path", got=got
            )
        if not isinstance(doc, dict):
            raise ContractError(400, "a patch table must be a JSON object")
        model_id = query_model or doc.get("model") or None
        loaded = self.acquire(model_id)
        try:
            entries = doc.get("entries")
            if not isinstance(entries, list):
                raise ContractError(400, "the table's entries must be a list")
            adapters: dict[str, CachedTensor] = {}
            missing: set[str] = set()
            for name in table_adapter_hashes(entries):
                tensor = self.adapters.get(name)
                if tensor is None:
                    missing.add(name)
                else:
                    adapters[name] = tensor
            if missing:
                raise ContractError(
                    409,
                    f"{len(missing)} adapter matri{'x is' if len(missing) == 1 else 'ces are'} "
                    "not on the server; upload them (PUT adapters/{hash}) and retry",
                    missing=sorted(missing),
                )
            table = self.worker.call(build_table, loaded, digest, doc, adapters)
            self._keep_table(loaded, table)
            return digest
        finally:
            self.release(loaded)

    def table_for(self, loaded: LoadedModel, digest: str) -> PatchTable | None:
        """A table the instance holds (now the most recently used of its tables), or None."""
        with self._tables_lock:
            table = loaded.tables.pop(digest, None)
            if table is not None:
                loaded.tables[digest] = table
            return table

    def _keep_table(self, loaded: LoadedModel, table: PatchTable) -> None:
        """Keep the table as the instance's most recently used; drop the least recently used
        ones (the newest always stays) while they hold more than TABLES_BOUND_FACTOR times the
        adapter cache's bound. A step naming a dropped table gets 409 `missing`, as after a
        reload, and the clients define it again. Without a bound every new strength of a
        16-bit LoRA kept another float32 copy of it until the model was unloaded."""
        bound = TABLES_BOUND_FACTOR * self.adapters.bound
        with self._tables_lock:
            tables = loaded.tables
            tables.pop(table.table_id, None)
            tables[table.table_id] = table
            total = sum(kept.nbytes for kept in tables.values())
            while total > bound and len(tables) > 1:
                dropped = tables.pop(next(iter(tables)))
                total -= dropped.nbytes
                log.info(
                    "dropped patch table %s of %s (tables over their bound)",
                    dropped.table_id,
                    loaded.model_id,
                )

    # ------------------------------------------------------------ runs

    def begin_run(self, model_id: Any) -> Run:
        self.sweep()
        with self._lock:
            if len(self._runs) + self._reserved >= wire.MAX_RUNS:
                raise ContractError(
                    429,
                    f"the server already holds {wire.MAX_RUNS} runs; end one (POST "
                    "runs/{run}/end) or wait for idle runs to end",
                )
            self._reserved += 1
        try:
            loaded = self.acquire(model_id)
        except BaseException:
            with self._lock:
                self._reserved -= 1
            raise
        with self._lock:  # the reservation becomes the run in one step: no begin slips between
            self._reserved -= 1
            run_id = secrets.token_hex(8)
            while run_id in self._runs:
                run_id = secrets.token_hex(8)
            run = Run(run_id=run_id, loaded=loaded, last_active=self.clock())
            self._runs[run_id] = run
        log.info("run %s begins on %s", run_id, loaded.model_id)
        return run

    def end_run(self, run_id: Any, reason: str = "ended") -> bool:
        with self._lock:
            run = self._runs.pop(run_id, None) if isinstance(run_id, str) else None
            if run is None:
                return False
            run.ended = True
            counts = (run.steps, run.rows, run.forward_ms, dict(run.prefix))
        self.release(run.loaded)
        self._shed_states(run)
        steps, rows, forward_ms, prefix = counts
        log.info(
            "run %s %s: model %s, %d steps, %d rows, forward %.1f ms, prefix %s",
            run.run_id,
            reason,
            run.model_id,
            steps,
            rows,
            forward_ms,
            " ".join(f"{k}={v}" for k, v in sorted(prefix.items())) or "-",
        )
        return True

    def _shed_states(self, run: Run) -> None:
        """Queue the model's end_run behind the work already queued (never waits)."""

        def shed() -> None:
            if self.registry.loaded(run.model_id) is run.loaded:
                run.loaded.model.end_run(run.run_id)

        try:
            self.worker.submit(shed)
        except RuntimeError:
            pass  # the worker is stopping and the model goes with it

    def interrupt(self, run_id: Any) -> int:
        with self._lock:
            run = self._runs.get(run_id) if isinstance(run_id, str) else None
            if run is None:
                return 0
            run.interrupted = True
        log.info("run %s interrupted", run_id)
        return 1

    def run_count(self) -> int:
        with self._lock:
            return len(self._runs)

    def run_for_step(self, run_id: Any) -> Run | None:
        """The run a step names (None: no run), checked per step 2 of docs/contract.md §2.11."""
        if run_id is None:
            return None
        if not isinstance(run_id, str):
            raise ContractError(400, "run must be a run id string or null")
        with self._lock:
            run = self._runs.get(run_id)
            if run is None:
                raise ContractError(404, f"unknown or ended run {run_id!r}; begin a new run")
            if run.interrupted:
                raise interrupted_error(run_id)
            run.last_active = self.clock()
            run.in_flight += 1
        return run

    def step_done(self, run: Run | None) -> None:
        if run is None:
            return
        with self._lock:
            run.in_flight -= 1
            run.last_active = self.clock()

    def record_step(
        self, run: Run | None, shape: tuple[int, ...], forward_ms: float, prefix_cache: str
    ) -> None:
        """Count a finished step on its run, under the lock (steps of one run may finish on
        several HTTP threads at once, and end_run reads the counts)."""
        if run is None:
            return
        with self._lock:
            run.record(shape, forward_ms, prefix_cache)

    @staticmethod
    def check_live(run: Run | None) -> None:
        """409 interrupted when the step's run was interrupted or ended meanwhile."""
        if run is not None and (run.interrupted or run.ended):
            raise interrupted_error(run.run_id)

    def sweep(self) -> int:
        """End the runs idle for longer than the idle limit; returns how many."""
        now = self.clock()
        with self._lock:
            idle = [
                r.run_id
                for r in self._runs.values()
                if r.in_flight == 0 and now - r.last_active > self.idle_s
            ]
        return sum(self.end_run(run_id, reason="idle-ended") for run_id in idle)

    def _sweep_loop(self) -> None:
        while not self._stop.wait(self.sweep_s):
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 - the sweeper must outlive any one failure
                log.exception("sweeping idle runs failed")
