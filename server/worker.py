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
from concurrent.futures import Future
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
        self._lock = threading.Lock()
        self._started = False

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
        """Finish the jobs already queued, then end the thread."""
        with self._lock:
            if self._stopping.is_set():
                return
            self._stopping.set()
            self._jobs.put(_STOP)
        if self._started and not self.on_worker_thread():
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            future, fn, args, kwargs = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - the job's failure belongs to its caller
                future.set_exception(exc)
                if not isinstance(exc, Exception):
                    log.error("image job raised %s; the worker goes on", type(exc).__name__)
            else:
                future.set_result(result)
