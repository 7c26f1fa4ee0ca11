"""Calls on a worker thread with the cancel flag polled (docs/contract.md §7.8)."""

import threading
import time

import pytest
from gmlx_comfy.interrupts import Cancelled, call_interruptible

from tests.comfy.interrupt_flag import Flag, Interrupted


def test_result_and_error_come_back():
    assert call_interruptible(lambda: 42, lambda: False, lambda: None) == 42

    def fail():
        raise KeyError("boom")

    with pytest.raises(KeyError):
        call_interruptible(fail, lambda: False, lambda: None)


def test_a_cancel_is_seen_within_20_ms_at_the_default_poll():
    """The median over five calls of the time from the flag rising to Cancelled."""
    delays = []
    for _ in range(5):
        release, raised = threading.Event(), {}

        def rise(raised=raised):
            raised["at"] = time.monotonic()

        threading.Timer(0.05, rise).start()
        with pytest.raises(Cancelled):
            call_interruptible(release.wait, lambda raised=raised: "at" in raised, lambda: None)
        delays.append(time.monotonic() - raised["at"])
        release.set()
    assert sorted(delays)[2] < 0.02, delays


def test_cancel_is_seen_within_a_poll_and_calls_on_cancel():
    release = threading.Event()
    flag = {"cancel": False, "sent": 0}
    threading.Timer(0.2, lambda: flag.update(cancel=True)).start()
    lock = threading.Lock()
    start = time.monotonic()
    with pytest.raises(Cancelled):
        call_interruptible(
            release.wait,
            lambda: flag["cancel"],
            lambda: flag.update(sent=flag["sent"] + 1),
            lock=lock,
            poll_s=0.05,
        )
    assert time.monotonic() - start < 1.0 and flag["sent"] == 1
    # the abandoned call still holds the connection lock until it ends
    assert lock.locked()
    release.set()
    assert lock.acquire(timeout=2.0)


def test_an_encode_the_user_cancels_ends_at_once():
    """A prompt's encode (the first one loads the text encoder on the server) is abandoned
    within a poll of the cancel, as a step is."""
    from types import SimpleNamespace

    from gmlx_comfy.clip import GmlxCLIP

    release, flag = threading.Event(), Flag()
    client = SimpleNamespace(encode=lambda *args, **kwargs: release.wait(10.0))
    conn = SimpleNamespace(client=client, lock=threading.RLock(), ensure_reachable=lambda: None)
    clip = GmlxCLIP(conn, "tiny", {"family": "z_image"})
    clip.interrupt = flag
    threading.Timer(0.1, lambda: setattr(flag, "raised", True)).start()
    start = time.monotonic()
    with pytest.raises(Interrupted):
        clip.encode("a lighthouse")
    assert time.monotonic() - start < 1.0
    release.set()
