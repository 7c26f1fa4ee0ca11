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
        assert (tmp_path / name).is_file()
        time.sleep(0.6)  # the sweeper removes it without a get
        assert not (tmp_path / name).exists()
        assert store.get(name) is None and store.held_bytes() == 0
    finally:
        store.close()


def test_the_oldest_images_go_first_past_the_bound(tmp_path):
    store = ImageStore(tmp_path, ttl_s=60, max_bytes=25)
    try:
        names = [store.put(bytes([i]) * 10, "webp") for i in range(3)]
        assert store.get(names[0]) is None and not (tmp_path / names[0]).exists()
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


def test_a_temporary_store_is_removed_at_close():
    store = ImageStore(None, ttl_s=60, max_bytes=1 << 20)
    store.put(b"x", "png")
    folder = store.folder
    assert folder.is_dir()
    store.close()
    assert not folder.exists()
