"""Memory plans of the image worker (docs/contract.md §3.5, 2.1).

The budget is the memory the image worker may use: `[server.image] memory_budget_mb` when set,
else the machine's memory less `memory_headroom_mb` (an MLX GPU backend's recommended working
set; on Linux MemAvailable plus what this process already holds; on macOS `hw.memsize`). What the
loaded models and the caches hold comes off it; the rest is free for a request's activations.

Every model answers the planning half of the seam (`base.MemoryPlanning`: `weight_bytes`,
`held_bytes`, `plan_step`, `step_peak_bytes`, `step_keys`, `vae_peak_bytes`, `shed_states`); the
estimates are its family's, pure functions of shapes and config. A step is planned twice: a
quick plan of `x` alone (HTTP thread, counting the prefix states as sheddable), then, on the
worker right before the forward, a detailed plan with the rows' prefixes, which sheds held
states when that makes room. The rows are planned once there (`plan_step`), and that plan goes
on to `step_peak_bytes`, `step_keys` and the forward. Work whose plan does not fit is refused
400 with what would fit.

When a step or a VAE pass does not fit even so, the plan makes room in this order: it releases
the text encoder (`[server.image] encoder_residency` "auto" or "release"; the next encode loads
it again, planned by `check_encode`), where that makes the work or one row of the step fit,
then runs the step's rows one at a time (`StepPlan`, each row planned again right before it
runs, `check_row`). Work that fits in neither way is refused with the encoder kept. With
"release" the encoder is released after every encode (`after_encode`), with "keep" never.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from .config import ImageConfig
from .engine.base import MemoryPlanError, StepResult
from .engine.registry import LoadedModel, ModelRegistry
from .engine.sampling import (
    DirectTransport,
    ImageRequest,
    call_inline,
    check_request,
    decode_latents,
    encode_pixels,
)

log = logging.getLogger("gmlx.server")

MiB = 1 << 20
# The caches' bounds are never lowered below this fraction of their configured bound: a large
# model on a machine with little room must still take a long conditioning (16 KiB a token at
# width 4096) and its LoRA matrices, or every client upload would be refused.
MIN_CACHE_FRACTION = 4
# MemAvailable is read at most this often (reading /proc/meminfo costs ~40 us, twice a step): a
# run's steps come faster than memory moves, and what this process holds counts either way.
LINUX_READ_MAX_AGE_S = 0.1


# ---------------------------------------------------------------- the machine


def machine_reader(max_age_s: float = LINUX_READ_MAX_AGE_S) -> Callable[[], int]:
    """A reader of the memory this process could use before any headroom (0 when it cannot be
    told), whose fixed facts are read now, once: an MLX GPU's working
    set (MLX is asked only here, on the thread that builds the planner before serving, never
    from an HTTP thread) and the host's total memory. Only Linux's MemAvailable changes; the
    reader reads it again when its last reading is older than `max_age_s`."""
    gpu = _mlx_gpu_bytes()
    if gpu:
        return lambda: gpu
    total = host_bytes()
    last = [-math.inf, 0]  # (when, bytes): one list, so a reading is swapped in whole

    def read() -> int:
        now = time.monotonic()
        when, value = last
        if now - when >= max_age_s:
            value = _linux_bytes() or total
            last[:] = now, value
        return value

    return read


def _mlx_gpu_bytes() -> int:
    try:
        import mlx.core as mx

        if mx.default_device() == mx.cpu:
            return 0
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    except Exception:  # noqa: BLE001 - no GPU backend: the host's memory applies
        return 0
    return int(info.get("max_recommended_working_set_size") or info.get("memory_size") or 0)


def _linux_bytes() -> int:
    """MemAvailable plus this process's resident set (what it holds is its own to reuse)."""
    try:
        meminfo = _PROC.read("/proc/meminfo")
        available = _meminfo_kib(meminfo, b"MemAvailable:") or _meminfo_kib(meminfo, b"MemTotal:")
        resident = int(_PROC.read("/proc/self/statm").split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
    return available * 1024 + resident


class _ProcFiles:
    """/proc files kept open and read again from their start (pread): a third of the cost
    of opening them per reading (6.5 against 20 us here, more right after a long forward),
    which the step's memory plans pay once per step. Reopened in a forked child, whose
    /proc/self is another process."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._pid = os.getpid()

    def read(self, path: str) -> bytes:
        if os.getpid() != self._pid:
            self._fds, self._pid = {}, os.getpid()
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        return os.pread(fd, 1 << 16, 0)


_PROC = _ProcFiles()


def _meminfo_kib(meminfo: bytes, name: bytes) -> int:
    """One field of /proc/meminfo in KiB (0 when absent); found, not the whole file parsed."""
    start = meminfo.find(name)
    if start < 0:
        return 0
    return int(meminfo[start + len(name) : meminfo.index(b"\n", start)].split()[0])


def host_bytes() -> int:
    """The host's total memory (0 when it cannot be told)."""
    return _macos_bytes() or _sysconf_bytes()


def _macos_bytes() -> int:
    if sys.platform != "darwin":
        return 0
    try:
        out = subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, timeout=5)
        return int(out.stdout.strip())
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0


def _sysconf_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return 0


# ---------------------------------------------------------------- plans


def _mib(n: int) -> str:
    return f"{max(0, n) / MiB:.0f} MiB"


class StepDemand:
    """What a step asks of memory (docs/contract.md §2.11 step 11): on `loaded`'s model, latents
    of `x_shape`, its `rows` under the patch `table`, for a `ref_cache` step the reference K/V
    it adds to its run (`ref_cache_run`, §3.4); counted once, on the worker (it asks the
    model): the model's plan of its rows (`plan_step`) and the bytes the whole step needs
    (`step_peak_bytes`, with the run's K/V)."""

    def __init__(
        self, loaded: LoadedModel, x_shape: tuple, rows: list, table: Any, ref_cache_run=None
    ):
        model = loaded.model
        self.loaded, self.x_shape, self.rows, self.table = loaded, tuple(x_shape), rows, table
        self.plans = model.plan_step(self.x_shape, rows, table)
        self.cached = (
            0 if ref_cache_run is None else model.ref_cache_bytes(rows, table, ref_cache_run)
        )
        self.need = model.step_peak_bytes(self.x_shape, rows, table, plans=self.plans) + self.cached

    def one_row(self) -> int:
        """The bytes of its largest row alone (how a step that does not fit runs), the run's
        K/V counted whole."""
        if len(self.rows) < 2:
            return self.need
        return (
            _largest_row_bytes(self.loaded.model, self.x_shape, self.rows, self.table, self.plans)
            + self.cached
        )


@dataclass
class StepPlan:
    """How a step runs: the model's plan of its rows (`plan_step`), whether the rows run one
    at a time (the batch does not fit; each row is planned again by `check_row`), and the
    planned peak of the forward beyond what is held (`step_peak_bytes`), which bounds MLX's
    allocations while it runs (`allocation_bound`)."""

    plans: Any
    peak_bytes: int
    one_row_at_a_time: bool = False


# The fraction of a work's planned peak at which MLX's limit is set (allocation_bound): past
# its limit MLX still queues the operations it dispatches before its next wait (up to ten),
# measured 10% of a full-size step's plan (docs/benchmarks.md, "Full-size memory").
LIMIT_FRACTION = 0.9


@contextmanager
def allocation_bound(peak_bytes: int) -> Iterator[None]:
    """MLX's memory limit, while the work inside runs, at what MLX holds now plus
    LIMIT_FRACTION of the work's planned peak; restored after. MLX allocates an operation's
    output when it queues the operation, up to about 100 operations ahead of the stream that
    computes them, so buffers wait allocated (on the CPU backend not yet written) while the
    work before them runs: at a full-size step's shapes that running ahead alone more than
    doubles the peak MLX counts (docs/benchmarks.md, "Full-size memory"). Past its limit MLX
    queues no more until queued work has finished and freed its inputs, so the work peaks at
    about its plan. The limit is soft: work over it waits rather than fails, and a limit below
    the work's own live set costs only the overlap of queueing and computing. On the worker
    thread (the one that evaluates)."""
    import mlx.core as mx

    limit = mx.get_active_memory() + int(LIMIT_FRACTION * max(0, peak_bytes))
    previous = mx.set_memory_limit(limit)
    try:
        yield
    finally:
        mx.set_memory_limit(previous)


class MemoryPlanner:
    def __init__(
        self,
        registry: ModelRegistry,
        caches: list[Any],
        config: ImageConfig,
        machine: Callable[[], int] | None = None,
    ) -> None:
        self.registry = registry
        self.caches = caches  # the byte-bounded upload caches (service.ByteLRU)
        self.configured_bounds = [cache.bound for cache in caches]
        self.budget_mb = config.memory_budget_mb
        self.headroom = config.memory_headroom_mb * MiB
        self.encoder_residency = config.encoder_residency
        self.machine = machine or machine_reader()

    def budget(self) -> int:
        """The image worker's memory: the configured budget, else the machine's less headroom."""
        if self.budget_mb:
            return self.budget_mb * MiB
        return max(0, self.machine() - self.headroom)

    def held(self, states: bool = True) -> int:
        """Bytes held beside the next piece of work: weights of the loaded models and their patch
        tables, the upload caches and (with `states`) what the models hold beyond these."""
        total = sum(cache.total for cache in self.caches)
        for model_id in self.registry.resident_ids():
            loaded = self.registry.loaded(model_id)
            if loaded is None:  # unloaded meanwhile
                continue
            total += loaded.model.weight_bytes
            # list(): one step, as HTTP threads may add tables meanwhile
            tables = [*loaded.tables.values(), loaded.default_table]
            total += sum(table.nbytes for table in tables if table is not None)
            if states:
                total += loaded.model.held_bytes()
        return total

    # ------------------------------------------------------------ the step

    def check_step_quick(self, loaded: LoadedModel, x_shape: tuple) -> None:
        """docs/contract.md §2.11 step 5: the target pass alone against the budget less weights and
        caches (held states could be shed and the text encoder released, so they do not count
        here), one row at a time when the batch does not fit."""
        model = loaded.model
        budget = self.budget()  # one look at the machine per plan
        free = budget - self.held(states=False) + self._releasable(loaded)
        need = model.step_peak_bytes(tuple(x_shape), None)
        if need > free:
            need = model.step_peak_bytes((1, *tuple(x_shape)[1:]), None)
        if need > free:
            hint = self._step_hint(
                lambda shape: model.step_peak_bytes(shape, None),
                x_shape,
                free,
                loaded.facts.latent_stride,
            )
            raise MemoryPlanError(self._refusal("step", need, free, budget, hint))

    def check_step(self, demand: StepDemand) -> StepPlan:
        """docs/contract.md §2.11 step 11, on the worker: the rows' prefixes, states not held counted as
        built; held states of other work are shed when that makes the plan fit, then the text
        encoder released (when the step, or its largest row, then fits), then the rows run one
        at a time. A `ref_cache` step also counts the reference K/V it would add to the run
        (StepDemand), the whole step's even for one row. Returns how the step runs, with the
        model's plan of its rows (made once, by the demand) for its forward."""
        loaded, model, need = demand.loaded, demand.loaded.model, demand.need
        rows, table = demand.rows, demand.table
        budget = self.budget()
        free = budget - self.held()
        if need > free:
            keep = model.step_keys(demand.x_shape, rows, table, plans=demand.plans)
            freed = model.shed_states(need - free, keep)
            log.info("memory plan shed %s of prefix states for a step", _mib(freed))
            free += freed
        one_row = demand.one_row() if need > free else need
        if need > free and min(need, one_row) <= free + self._releasable(loaded):
            free += self._release_encoder(loaded, "a step")
        if need > free and one_row <= free:
            log.info("memory plan runs the step's %d rows one at a time", len(rows))
            return StepPlan(demand.plans, one_row, one_row_at_a_time=True)
        if need > free:

            def estimate(shape: tuple) -> int:  # the first rows, at another size
                return model.step_peak_bytes(shape, rows[: shape[0]], table)

            hint = self._step_hint(estimate, demand.x_shape, free, loaded.facts.latent_stride)
            raise MemoryPlanError(self._refusal("step", need, free, budget, hint))
        return StepPlan(demand.plans, need)

    def dry_run(self, demand: StepDemand) -> dict:
        """A step's plan and its image's decode plan, as `check_step` and `check_vae` would make
        them, without shedding, releasing or running anything (a step's `dry_run`): held states
        count as sheddable and the text encoder as releasable, as the quick plan counts them."""
        loaded, model, x_shape = demand.loaded, demand.loaded.model, demand.x_shape
        budget = self.budget()
        held = self.held(states=False)
        releasable = self._releasable(loaded)
        free = budget - held + releasable
        need, one_row = demand.need, demand.one_row()
        runs = "together" if need <= free else "one_row_at_a_time" if one_row <= free else "refused"
        stride = loaded.facts.latent_stride
        height, width = x_shape[2] * stride, x_shape[3] * stride
        whole = model.vae_peak_bytes(height, width, True)
        tiled = model.vae_peak_bytes(height, width, True, tiled=True)
        tiles = whole > free and model.vae_tileable(height, width, True) and tiled <= free
        return {
            "dry_run": True,
            "budget_bytes": budget,
            "held_bytes": held,
            "held_states_bytes": self.held() - held,
            "releasable_bytes": releasable,
            "free_bytes": free,
            "step": {"need_bytes": need, "one_row_bytes": one_row, "runs": runs},
            "decode": {
                "need_bytes": tiled if tiles else whole,
                "tiled": tiles,
                "fits": whole <= free or tiles,
            },
        }

    def run_step(
        self,
        loaded: LoadedModel,
        x: np.ndarray,
        timestep: np.ndarray,
        rows: list,
        table: Any,
        denoise: Callable[..., StepResult],
        ref_cache_run: str | None = None,
    ) -> StepResult:
        """A step under its detailed plan (`check_step`), on the worker right before the work:
        `denoise(x, timestep, rows, plans)` within the plan's allocation bound, or once per row
        (each row planned again by `check_row`) when the rows run one at a time."""
        plan = self.check_step(StepDemand(loaded, x.shape, rows, table, ref_cache_run))
        if not plan.one_row_at_a_time:
            with allocation_bound(plan.peak_bytes):
                return denoise(x, timestep, rows, plan.plans)
        results = []
        for index, row in enumerate(rows):
            row_plan = self.check_row(loaded, x.shape, rows, index, table, plan)
            one = slice(index, index + 1)
            with allocation_bound(row_plan.peak_bytes):
                results.append(denoise(x[one], timestep[one], [row], row_plan.plans))
        return joined(results)

    def check_row(
        self, loaded: LoadedModel, x_shape: tuple, rows: list, index: int, table: Any, plan: Any
    ) -> StepPlan:
        """Row `index` of a step whose rows run one at a time, on the worker right before it
        runs: its plan against what is held now (the states the rows before it built
        included); held states other than the step's own are shed when that makes it fit.
        Returns the row's plan (a one-row StepPlan) for its forward."""
        model = loaded.model
        row_shape = (1, *tuple(x_shape)[1:])
        plans = _nth(plan.plans, index)
        need = model.step_peak_bytes(row_shape, [rows[index]], table, plans=plans)
        budget = self.budget()
        free = budget - self.held()
        if need > free:
            keep = model.step_keys(tuple(x_shape), rows, table, plans=plan.plans)
            free += model.shed_states(need - free, keep)
        if need > free:
            hint = f"row {index} of the step does not fit alone after the rows before it"
            raise MemoryPlanError(self._refusal("step", need, free, budget, hint))
        return StepPlan(plans, need)

    def check_image(self, loaded: LoadedModel, width: int, height: int, rows: int) -> None:
        """Before an image sampled in process is encoded: its steps' quick plan (`rows` rows of
        its latents) and its decode, so that work which cannot fit is refused before any of it
        runs."""
        facts = loaded.facts
        stride = facts.latent_stride
        x_shape = (rows, facts.latent_channels, height // stride, width // stride)
        self.check_step_quick(loaded, x_shape)
        self.check_vae(loaded, height, width, True)

    # ------------------------------------------------------------ the text encoder

    def _releasable(self, loaded: LoadedModel) -> int:
        """The bytes releasing the text encoder would free ("keep": none)."""
        model = loaded.model
        if self.encoder_residency == "keep" or not model.encoder_releasable:
            return 0
        return model.encoder_bytes

    def _release_encoder(self, loaded: LoadedModel, why: str) -> int:
        """Release the text encoder to make room for `why`, where the residency allows it."""
        if not self._releasable(loaded):
            return 0
        freed = loaded.model.release_encoder()
        log.info(
            "memory plan released the text encoder of %s (%s) for %s; the next encode loads it",
            loaded.model_id,
            _mib(freed),
            why,
        )
        return freed

    def check_encode(self, loaded: LoadedModel) -> None:
        """Before an encode, on the worker: a released text encoder loads again, its weights
        beside what is held (held states are shed when that makes them fit). The encode's own
        activations are not planned."""
        model = loaded.model
        if model.encoder_resident:
            return
        need = model.encoder_bytes
        budget = self.budget()
        free = budget - self.held()
        if need > free:
            free += model.shed_states(need - free, set())
        if need > free:
            hint = "the text encoder does not fit beside the DiT and the VAE"
            raise MemoryPlanError(self._refusal("encode", need, free, budget, hint))

    def check_upsample(self, loaded: LoadedModel, need: int) -> None:
        """Before a prompt upsampler loads (engine/upsampling.py), on the worker: it fits beside
        what is held, the text encoder released first where it may be (it loads again for the
        encode after) and held states shed."""
        model = loaded.model
        free = self.budget() - self.held()
        if need > free and model.encoder_releasable:
            free += model.release_encoder()
        if need > free:
            free += model.shed_states(need - free, set())
        if need > free:
            hint = "the prompt upsampler does not fit beside the image model; quantize it"
            raise MemoryPlanError(
                self._refusal("prompt upsampler", need, free, self.budget(), hint)
            )

    def after_encode(self, loaded: LoadedModel) -> None:
        """After an encode, on the worker: with encoder_residency "release", the encoder goes."""
        if self.encoder_residency == "release":
            loaded.model.release_encoder()

    @staticmethod
    def _step_hint(estimate: Callable, x_shape: tuple, free: int, stride: int) -> str:
        """What would fit: the rows at this size, or the largest square at these rows."""
        batch, channels, h, w = x_shape
        rows = max((b for b in range(1, batch) if estimate((b, channels, h, w)) <= free), default=0)
        side = _largest_side(lambda s: estimate((batch, channels, s, s)) <= free, max(h, w))
        parts = []
        if rows:
            parts.append(f"{rows} of the {batch} rows fit at {w * stride}x{h * stride} pixels")
        if side:
            parts.append(f"{batch} row(s) fit at up to {side * stride}x{side * stride} pixels")
        return (
            "; ".join(parts) or "no step of this model fits; unload other work or raise the budget"
        )

    # ------------------------------------------------------------ the VAE

    def check_vae(self, loaded: LoadedModel, height: int, width: int, decode: bool) -> bool:
        """docs/contract.md §2.12-2.13, on the worker: one image of height x width pixels (images
        go one at a time), whole where that fits, held states shed and the text encoder released
        when that makes it fit; else in tiles where the VAE can tile it (not the whole pass:
        ComfyUI's fallback on out-of-memory). Returns whether the pass tiles."""
        model = loaded.model
        budget = self.budget()
        tiling = (False, True) if model.vae_tileable(height, width, decode) else (False,)
        for tiled in tiling:
            need = model.vae_peak_bytes(height, width, decode, tiled)
            free = self._room(loaded, need, budget, "a VAE pass")
            if need <= free:
                return tiled
        stride = loaded.facts.vae_stride
        cells = _largest_side(
            lambda s: model.vae_peak_bytes(s * stride, s * stride, decode, tiling[-1]) <= free,
            max(height, width) // stride,
        )
        hint = (
            f"images of up to {cells * stride}x{cells * stride} pixels fit"
            if cells
            else "no image fits; unload other work or raise the budget"
        )
        what = "decode" if decode else "encode"
        raise MemoryPlanError(self._refusal(what, need, free, budget, hint))

    def _room(self, loaded: LoadedModel, need: int, budget: int, work: str) -> int:
        """The bytes of `budget` free for `need`, after shedding held states and releasing the
        text encoder where either makes it fit."""
        free = budget - self.held()
        if need > free:
            free += loaded.model.shed_states(need - free, set())
        if free < need <= free + self._releasable(loaded):
            free += self._release_encoder(loaded, work)
        return free

    @staticmethod
    def _refusal(what: str, need: int, free: int, budget: int, hint: str) -> str:
        return (
            f"the {what}'s memory plan does not fit beside the models loaded: it needs "
            f"{_mib(need)}, {_mib(free)} of the image worker's {_mib(budget)} are free "
            f"(server.image.memory_budget_mb, memory_headroom_mb); {hint}"
        )

    # ------------------------------------------------------------ cache bounds (docs/contract.md §2.1)

    def fit_cache_bounds(self) -> None:
        """Lower the upload caches' bounds when the loaded models' footprints leave less room
        than configured (shared in the configured proportion), restore them when room returns."""
        room = self.budget() - sum(
            self._footprint(self.registry.loaded(m)) for m in self.registry.resident_ids()
        )
        configured = sum(self.configured_bounds)
        for cache, bound in zip(self.caches, self.configured_bounds, strict=True):
            share = room * bound // configured if configured else 0
            cache.set_bound(max(bound // MIN_CACHE_FRACTION, min(bound, share)))

    @staticmethod
    def _footprint(loaded: LoadedModel | None) -> int:
        """A loaded model's planned footprint (its facts' `resident_bytes`, else its weights),
        and its configured adapters' table."""
        if loaded is None:
            return 0
        footprint = loaded.model.facts.resident_bytes or loaded.model.weight_bytes
        table = loaded.default_table
        return footprint + (table.nbytes if table is not None else 0)


def joined(results: list[StepResult]) -> StepResult:
    """The rows of a step run one at a time, as the step's answer: the outputs in row order,
    the forwards' time summed, and the prefix-cache header the batch would have had (§3.3)."""
    headers = {result.prefix_cache for result in results}
    if len(headers) == 1:
        header = headers.pop()
    else:
        header = "off" if "off" in headers else "miss"
    return StepResult(
        out=np.concatenate([result.out for result in results], axis=0),
        prefix_cache=header,
        forward_ms=sum(result.forward_ms for result in results),
    )


class PlannedTransport(DirectTransport):
    """Sampling in process under the memory plan, as the step and VAE routes plan it: each step
    through `run_step` (the rows one at a time where they do not fit together), the decode
    after `check_vae`. What `gmlx image sample` and the OpenAI routes sample through."""

    def __init__(
        self,
        loaded: LoadedModel,
        memory: MemoryPlanner,
        call: Callable[..., Any] = call_inline,
        table: Any = None,
    ):
        super().__init__(loaded.model, call=call, table=table)
        self.loaded = loaded
        self.memory = memory

    def step(self, x: np.ndarray, timestep: np.ndarray, rows, skip=()) -> np.ndarray:
        run_step = self.memory.run_step

        def denoise(x, timestep, rows, plans):
            return self.denoise(x, timestep, rows, plans, tuple(skip))

        return self.call(run_step, self.loaded, x, timestep, list(rows), self.table, denoise).out

    def decode(self, latents: np.ndarray) -> np.ndarray:
        _, _, h, w = np.shape(latents)
        stride = self.loaded.facts.latent_stride

        def planned() -> np.ndarray:
            tiled = self.memory.check_vae(self.loaded, h * stride, w * stride, True)
            return decode_latents(self.model, latents, tiled)

        return self.call(planned)

    def encode_image(self, pixels: np.ndarray) -> np.ndarray:
        height, width = np.shape(pixels)[:2]

        def planned() -> np.ndarray:
            tiled = self.memory.check_vae(self.loaded, height, width, False)
            return encode_pixels(self.model, pixels, tiled)

        return self.call(planned)

    def check_image(self, status: dict, request: ImageRequest) -> None:
        """Refuse, before anything of it runs, an image whose steps (one row, or two with
        guidance) or decode cannot fit (`MemoryPlanner.check_image`)."""
        _, cfg = check_request(status, request)
        rows = 1 if cfg == 1.0 else 2
        self.call(self.memory.check_image, self.loaded, request.width, request.height, rows)


def _largest_row_bytes(model, x_shape: tuple, rows: list, table: Any, plans: Any) -> int:
    """The step's peak for its largest row alone (how a step that does not fit runs)."""
    return max(
        model.step_peak_bytes((1, *x_shape[1:]), [row], table, plans=_nth(plans, index))
        for index, row in enumerate(rows)
    )


def _nth(plans: Any, index: int) -> Any:
    """The plan of one row, as a one-row step's plans (None for a model without row plans)."""
    return None if plans is None else [plans[index]]


def _largest_side(fits: Callable[[int], bool], upper: int) -> int:
    """The largest side in 1..upper for which fits(side) holds (fits shrinks with the side);
    0 when none does."""
    low, high = 0, max(0, upper)
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low
