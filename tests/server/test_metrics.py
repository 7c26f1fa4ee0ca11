"""GET /metrics (prometheus-client's text format) and GET /health?ready=1, as an operator's
scraper and load balancer read them (docs/server.md, "Metrics and readiness")."""

from __future__ import annotations

import numpy as np
import pytest
import requests
from gmlx_server.config import ServerConfig
from gmlx_server.metrics import readiness
from prometheus_client.parser import text_string_to_metric_families

from .conftest import start_server
from .linear_family import CHANNELS, FAMILY, text_cond

STEP = "/internal/image-steps/v1/step"


def scrape(server) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics by (name, sorted labels)."""
    r = server.session.get(server.base + "/metrics", timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def step(server, model="alpha", rows=None):
    x = np.zeros((1, CHANNELS, 2, 2), np.float32)
    rows = rows or [{"cond": server.put_tensor(text_cond("a fox"))}]
    tensors = {"x": x, "timestep": np.float32([0.5])}
    return server.post_container("step", tensors, {"rows": rows, "model": model})


def test_steps_answers_caches_and_models_are_counted(fresh):
    before = scrape(fresh)
    assert before[("gmlx_models_resident", ())] == 0
    assert step(fresh).status_code == 200
    assert step(fresh, rows=[{"cond": "0" * 64}]).status_code == 409  # a cond never uploaded
    after = scrape(fresh)
    family = ("family", FAMILY)
    assert after[("gmlx_steps_total", (family, ("prefix_cache", "miss")))] == 1
    assert after[("gmlx_step_forward_seconds_count", (family,))] == 1
    assert after[("gmlx_step_route_seconds_count", (family,))] == 1
    answered = {(("method", "POST"), ("route", STEP), ("status", code)) for code in ("200", "409")}
    for labels in answered:
        assert after[("gmlx_http_responses_total", labels)] == 1, labels
    assert after[("gmlx_models_resident", ())] == 1
    assert after[("gmlx_model_loads_total", ())] == 1
    assert after[("gmlx_cache_bytes", (("cache", "tensors"),))] > 0
    assert after[("gmlx_cache_hits_total", (("cache", "tensors"),))] >= 1
    assert after[("gmlx_cache_misses_total", (("cache", "tensors"),))] >= 1
    assert after[("gmlx_memory_budget_bytes", ())] > 0
    assert after[("gmlx_worker_queue_depth", ())] == 0
    assert ("gmlx_rank_group_size", ()) not in after  # one process: no group
    assert not [name for name, _ in after if name.endswith("_created")]


def test_an_unknown_path_is_counted_as_unmatched(fresh):
    assert fresh.session.get(fresh.base + "/nowhere", timeout=30).status_code == 404
    labels = (("method", "GET"), ("route", "unmatched"), ("status", "404"))
    assert scrape(fresh)[("gmlx_http_responses_total", labels)] == 1


def test_ready_until_a_model_loads_and_the_reason_named(fresh):
    r = fresh.session.get(fresh.base + "/health", params={"ready": "1"}, timeout=30)
    assert r.status_code == 200 and r.json()["ready"] is True
    fresh.ctx.registry.loading.add("alpha")  # as _load marks a model while it loads
    try:
        r = fresh.session.get(fresh.base + "/health", params={"ready": "1"}, timeout=30)
        assert r.status_code == 503 and r.headers["Retry-After"] == "5"
        assert r.json() == {
            "status": "not_ready",
            "ready": False,
            "reason": "loading alpha",
            "gmlx_version": r.json()["gmlx_version"],
        }
        plain = fresh.session.get(fresh.base + "/health", timeout=30)
        assert plain.status_code == 200  # liveness is not readiness
        assert scrape(fresh)[("gmlx_models_loading", ())] == 1
    finally:
        fresh.ctx.registry.loading.discard("alpha")


class Group:
    def __init__(self, state: str):
        self.state = state

    def describe(self) -> dict:
        return {
            "world_size": 2,
            "mode": "pipeline",
            "state": self.state,
            "reason": "rank 1 went",
            "silent_ranks": [1],
        }


@pytest.mark.parametrize("state", ["stuck", "broken"])
def test_a_group_that_cannot_work_is_not_ready(fresh, state):
    assert readiness(fresh.ctx.service, Group("ok")) is None
    assert readiness(fresh.ctx.service, Group(state)) == f"the rank group is {state}: rank 1 went"


def test_metrics_need_the_api_key(tmp_path):
    server = start_server(tmp_path, config=ServerConfig(api_key="sesame"))
    try:
        bare = requests.get(server.base + "/metrics", timeout=30)
        assert bare.status_code == 401
        keyed = requests.get(
            server.base + "/metrics", headers={"Authorization": "Bearer sesame"}, timeout=30
        )
        assert keyed.status_code == 200 and "gmlx_worker_queue_depth" in keyed.text
        assert requests.get(server.base + "/health", timeout=30).status_code == 200
    finally:
        server.close()


def test_a_dry_run_step_answers_its_plan_and_runs_nothing(fresh):
    """`dry_run: true`: every check of the step, then the memory plan it would make (the step's
    and its image's decode) as JSON; no forward, nothing counted as a step."""
    cond = fresh.put_tensor(text_cond("a fox"))
    x = np.zeros((2, CHANNELS, 4, 4), np.float32)
    tensors = {"x": x, "timestep": np.float32([0.5, 0.5])}
    rows = [{"cond": cond}, {"cond": cond}]
    r = fresh.post_container("step", tensors, {"rows": rows, "model": "alpha", "dry_run": True})
    assert r.status_code == 200, r.text
    plan = r.json()
    model = fresh.model()
    assert plan["dry_run"] is True and plan["step"]["runs"] == "together"
    assert plan["step"]["need_bytes"] > 0 and plan["budget_bytes"] >= plan["free_bytes"] > 0
    assert plan["decode"] == {
        "need_bytes": model.vae_peak_bytes(32, 32, True),
        "tiled": False,
        "fits": True,
    }
    assert ("gmlx_steps_total", (("family", FAMILY), ("prefix_cache", "miss"))) not in scrape(fresh)
    missing = fresh.post_container(
        "step", tensors, {"rows": [{"cond": "0" * 64}] * 2, "model": "alpha", "dry_run": True}
    )
    assert missing.status_code == 409  # the checks run as for a real step
