"""The notice of MLX compiling its CPU kernels: where MLX keeps them, and when the watch speaks."""

from __future__ import annotations

import shutil
import time

import pytest
from gmlx_server.kernel_compiles import CompileWatch, kernel_folder


def test_the_watch_speaks_when_kernels_compile_and_when_they_are_done(tmp_path):
    folder = tmp_path / "cpu"
    folder.mkdir()
    (folder / "old.cpp").write_text("")  # compiled before the watch: not news
    (folder / "libold.so").write_bytes(b"")
    (folder / "tmp_0dead.cpp").write_text("")  # left by an interrupted compile: not pending
    lines: list[str] = []
    watch = CompileWatch(lines.append, folder, poll_s=3600, quiet_s=0.2)
    with watch:
        watch.look()
        assert lines == []
        (folder / "k1.cpp").write_text("")  # the source, then g++ builds the library
        watch.look()
        assert len(lines) == 1 and lines[0].startswith("compiling MLX's CPU kernels")
        assert f"(once: they are kept in {folder}" in lines[0]
        (folder / "libk1.so").write_bytes(b"")
        (folder / "tmp_1a2b.cpp").write_text("")  # mlx 0.32: a temporary name first
        watch.look()
        time.sleep(0.3)
        watch.look()  # quiet long enough, but tmp_1a2b has no library yet
        assert len(lines) == 1
        (folder / "tmp_1a2b.so").write_bytes(b"")
        (folder / "tmp_1a2b.cpp").rename(folder / "k2.cpp")
        (folder / "tmp_1a2b.so").rename(folder / "libk2.so")
        watch.look()
        assert len(lines) == 1  # not quiet yet
        time.sleep(0.3)
        watch.look()
        assert len(lines) == 2 and lines[1].startswith("compiled 2 MLX CPU kernel(s) in ")
        watch.look()
    assert len(lines) == 2  # nothing more to say


def test_a_watch_stopped_while_compiling_says_how_far_it_got(tmp_path):
    lines: list[str] = []
    watch = CompileWatch(lines.append, tmp_path, poll_s=3600)
    with watch:
        (tmp_path / "k.cpp").write_text("")
        watch.look()
    assert len(lines) == 2 and lines[1].startswith("compiled 0 MLX CPU kernel(s)")


@pytest.mark.skipif(shutil.which("g++") is None, reason="MLX compiles CPU kernels with g++")
def test_mlx_compiles_its_kernels_where_the_watch_looks(tmp_path, monkeypatch):
    """A kernel this process has not built yet, in a temp dir of its own: MLX writes it where
    `kernel_folder` says, and the watch (on its own thread) reports it."""
    import mlx.core as mx

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    folder = kernel_folder()
    assert folder == tmp_path / "mlx" / mx.__version__ / "cpu"
    lines: list[str] = []
    with CompileWatch(lines.append, poll_s=0.05, quiet_s=0.2):
        kernel = mx.compile(lambda x: mx.cos(mx.sin(x) * 3.25) - mx.tanh(x) * 0.5)
        with mx.stream(mx.cpu):
            mx.eval(kernel(mx.arange(64, dtype=mx.float32)))
        deadline = time.monotonic() + 5
        while len(lines) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(lines) == 2, lines  # done was seen while the watch ran
    assert any(path.suffix == ".so" for path in folder.iterdir())
    assert lines[0].startswith("compiling MLX's CPU kernels"), lines
    assert lines[1].startswith("compiled ") and " MLX CPU kernel(s) in " in lines[1], lines
