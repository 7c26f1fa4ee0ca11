"""The store of images answered by URL (server/image_store.py): bounded in time and space, its
own files only."""

from __future__ import annotations

import time

import pytest
from gmlx_server.image_store import ImageStore, StoreFull


def test_an_image_is_served_until_it_expires_and_then_removed_unasked(tmp_path):
    store = ImageStore(tmp_path, ttl_s=0.3, max_bytes=1 << 20)
    try:
        name = store.put(b"png bytes", "png")
        assert store.get(name) == (b"png bytes", "image/png")
        assert (store.folder / name).is_file()
        time.sleep(0.6)  # the sweeper removes it without a get
        assert not (store.folder / name).exists()
        assert store.get(name) is None and store.held_bytes() == 0
    finally:
        store.close()


def test_the_oldest_images_go_first_past_the_bound(tmp_path):
    store = ImageStore(tmp_path, ttl_s=60, max_bytes=25)
    try:
        names = [store.put(bytes([i]) * 10, "webp") for i in range(3)]
        assert store.get(names[0]) is None and not (store.folder / names[0]).exists()
        assert store.get(names[2]) == (bytes([2]) * 10, "image/webp")
        assert store.held_bytes() == 20
        with pytest.raises(StoreFull):
            store.put(b"x" * 26, "png")
    finally:
        store.close()


def test_only_its_own_names_are_served(tmp_path):
    (tmp_path / "secret.txt").write_text("not an image")
    planted = "0" * 32 + ".png"
    (tmp_path / planted).write_bytes(b"left by an earlier run")
    store = ImageStore(tmp_path, ttl_s=60, max_bytes=1 << 20)
    try:
        assert not (tmp_path / planted).exists()  # an earlier run's images are gone at start
        assert (tmp_path / "secret.txt").exists()  # other files are left alone
        for name in ("secret.txt", "../secret.txt", planted, "A" * 32 + ".png", ""):
            assert store.get(name) is None
    finally:
        store.close()


def test_servers_sharing_a_folder_keep_each_others_images(tmp_path):
    """Each server keeps its images in `server-<pid>`: a store made beside a running server's
    folder leaves it whole, removes the folder of a server that has gone, and its own at close."""
    import os
    import subprocess
    import sys

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    from gmlx_server.engine.processes import this_host

    host = this_host()
    running = tmp_path / f"server-{host}-{os.getppid()}"
    ended = tmp_path / f"server-{host}-{gone.stdout.strip()}"
    elsewhere = tmp_path / f"server-another.host-{gone.stdout.strip()}"  # its pids are not ours
    for folder in (running, ended, elsewhere):
        folder.mkdir()
        (folder / ("1" * 32 + ".png")).write_bytes(b"another server's image")
    store = ImageStore(tmp_path, ttl_s=60, max_bytes=1 << 20)
    try:
        assert store.folder == tmp_path / f"server-{host}-{os.getpid()}"
        assert (store.folder / store.put(b"mine", "png")).is_file()
        assert (running / ("1" * 32 + ".png")).is_file() and not ended.exists()
        assert elsewhere.is_dir()
    finally:
        store.close()
    assert not store.folder.exists() and running.is_dir()


def test_a_temporary_store_is_removed_at_close():
    store = ImageStore(None, ttl_s=60, max_bytes=1 << 20)
    store.put(b"x", "png")
    folder = store.folder
    assert folder.is_dir()
    store.close()
    assert not folder.exists()
