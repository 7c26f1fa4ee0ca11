"""bench/transport.py's route measurement runs on the embedded default as `gmlx image bench
--via-steps` drives it (a small image, a few steps): a bench the sampling API moved under
fails here rather than when its figures are next taken."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "transport.py"


def test_the_route_measurement_times_each_step(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    spec = importlib.util.spec_from_file_location("transport_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    transport, in_route = bench.measure_route(64, 64, 2, count=3, warmup=1)
    assert len(transport) == len(in_route) == 3
    assert all(ms > 0 for ms in transport) and all(ms >= 0 for ms in in_route)
