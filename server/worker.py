"""The image worker: one thread that runs all model work in arrival order.

MLX state is touched by this thread only. HTTP threads parse and validate, then hand a job to
`submit` (or `call`) and wait on its future; a job's exception travels to the waiting request and
the worker goes on with the next job.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

log = logging.getLogger("gmlx.server")

_STOP = object()


class WorkerStopped(RuntimeError):
    """The worker is shutting down and takes no more work."""


class ImageWorker:
    def __init__(self, name: str = "gmlx-image") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._stopping = threading.Event()
        self._abandoned = threading.Event()
        self._lock = threading.Lock()
        self._started = False
        self._running: Future | None = None  # the job's future while it runs

    def start(self) -> None:
        with self._lock:
            if not self._started:
                self._started = True
                self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def depth(self) -> int:
        """The jobs queued and not started (about: the queue moves while it is read)."""
        return self._jobs.qsize()

    def on_worker_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Queue fn(*args, **kwargs) behind every job already queued."""
        future: Future = Future()
        with self._lock:
            if self._stopping.is_set():
                raise WorkerStopped("the image worker is stopping")
            self._jobs.put((future, fn, args, kwargs))
        return future

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run fn on the worker and wait for its result (or its exception). A job that is itself
        on the worker runs inline, so worker code may call helpers that use `call`."""
        if self.on_worker_thread():
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Finish the jobs already queued, then end the thread (waiting at most `timeout`; a
        worker already stopping is only waited for)."""
        with self._lock:
            if not self._stopping.is_set():
                self._stopping.set()
                self._jobs.put(_STOP)
        if self._started and not self.on_worker_thread():
            self._thread.join(timeout)

    def abandon(self) -> None:
        """Stop at once (a second stop signal): no new job is taken, and the callers of the job
        that runs and of every job queued get WorkerStopped now. The running job cannot be cut
        short: its end is dropped, and the thread ends after it."""
        stopped = WorkerStopped("the image worker stopped at once")
        with self._lock:
            self._stopping.set()
            self._abandoned.set()
            running = self._running
        if running is not None:
            _settle(running, exception=stopped)
        while True:  # the queued jobs (those the thread takes meanwhile, it fails itself)
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not _STOP:
                _settle(job[0], exception=stopped)
        self._jobs.put(_STOP)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            future, fn, args, kwargs = job
            with self._lock:  # taken whole, or left to `abandon` whole
                abandoned = self._abandoned.is_set()
                if not abandoned:
                    if not future.set_running_or_notify_cancel():
                        continue
                    self._running = future
            if abandoned:
                _settle(future, exception=WorkerStopped("the image worker stopped at once"))
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - the job's failure belongs to its caller
                _settle(future, exception=exc)
                if not isinstance(exc, Exception):
                    log.error("image job raised %s; the worker goes on", type(exc).__name__)
            else:
                _settle(future, result=result)
            finally:
                with self._lock:
                    self._running = None


def _settle(future: Future, result: Any = None, exception: BaseException | None = None) -> None:
    """Give a job's caller its result or exception, unless a stop at once answered it first."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass  # answered already (abandon)
