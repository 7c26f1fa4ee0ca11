"""Run a server call on a worker thread while polling a cancel flag (docs/contract.md §7.8).

Pure: ComfyUI's own flag (`COMFY_INTERRUPT`) imports ComfyUI only when it is read."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import NoReturn, Protocol, TypeVar

T = TypeVar("T")

# How often a waiting call reads ComfyUI's interrupt flag: a read is a function call, and the
# user's interrupt is seen within this (docs/comfyui.md, "Runs and interrupts").
POLL_S = 0.01


class Cancelled(Exception):
    """The user cancelled while the call was in flight (the call itself may still finish)."""


def call_interruptible(
    work: Callable[[], T],
    cancelled: Callable[[], bool],
    on_cancel: Callable[[], None],
    *,
    lock: AbstractContextManager | None = None,
    poll_s: float = POLL_S,
) -> T:
    """Run `work()` on a daemon thread and wait, checking `cancelled()` every `poll_s`.

    On cancel, `on_cancel()` runs (e.g. POST interrupt) and Cancelled is raised at once; the
    abandoned call keeps `lock` until the server answers, so the next call on the same
    connection waits for it instead of sharing its socket.
    """
    outcome: dict[str, object] = {}
    done = threading.Event()
    guard = lock if lock is not None else nullcontext()

    def run() -> None:
        try:
            with guard:
                outcome["value"] = work()
        except BaseException as error:  # handed to the waiting thread
            outcome["error"] = error
        finally:
            done.set()

    threading.Thread(target=run, name="gmlx-step", daemon=True).start()
    while not done.wait(poll_s):
        if cancelled():
            on_cancel()
            raise Cancelled()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


class InterruptFlag(Protocol):
    def requested(self) -> bool:
        """Whether the user asked to stop."""

    def throw(self) -> NoReturn:
        """Raise the interrupt (and clear the flag)."""


class ComfyInterrupt:
    """ComfyUI's interrupt flag (`comfy.model_management`)."""

    def requested(self) -> bool:
        import comfy.model_management as mm

        return mm.processing_interrupted()

    def throw(self) -> NoReturn:
        import comfy.model_management as mm

        mm.throw_exception_if_processing_interrupted()  # raises, and clears the flag
        raise mm.InterruptProcessingException()


COMFY_INTERRUPT = ComfyInterrupt()


def call_or_interrupt(
    work: Callable[[], T],
    flag: InterruptFlag,
    on_cancel: Callable[[], None] = lambda: None,
    *,
    lock: AbstractContextManager | None = None,
) -> T:
    """`call_interruptible` that checks the flag before starting and raises its interrupt on
    cancel: a call the user cancelled is never sent, one in flight is abandoned at once."""
    if flag.requested():
        flag.throw()
    try:
        return call_interruptible(work, flag.requested, on_cancel, lock=lock)
    except Cancelled:
        flag.throw()
