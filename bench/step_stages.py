"""Where a step's transport goes, stage by stage: `gmlx image bench --via-steps` in this process,
with a timestamp taken on entry to (or exit from) the functions a step passes through, on the
client, Waitress' loop and task threads, the route and the image worker.

    .venv/bin/python bench/step_stages.py [--size 1024] [--stub none|sleep]

Prints, for each mark in the order of the last timed step, the median over the timed steps of
the time since the previous mark, and the thread it ran on; then each side of the forward whole
(the client's post to the forward's start, the forward's end to the answer read). The marks
wrap library internals (Waitress' channel and parser, Falcon's middleware hooks), so a new
Waitress or Falcon may move or drop some; the bench's own record
(`transport.overhead_ms_median`) comes out at the end.
Wrapping costs a few microseconds a mark: compare runs of this script with each other, not with
`gmlx image bench`.

`--stub` replaces the model's forward with an answer of x: `none` at once (the route hot, no
forward between steps), `sleep` after 650 ms idle (what a forward's idle alone costs).

Results go to docs/benchmarks.md ("Where a step's transport goes").
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

MARKS: list[tuple[float, str, str]] = []  # (perf_counter, mark, thread name)


def mark(name: str) -> None:
    MARKS.append((time.perf_counter(), name, threading.current_thread().name))


def wrap(owner, attr: str, before: str | None = None, after: str | None = None) -> None:
    """Replace owner.attr with a wrapper that marks `before` on entry and `after` on exit."""
    original = getattr(owner, attr)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if before:
            mark(before)
        try:
            return original(*args, **kwargs)
        finally:
            if after:
                mark(after)

    setattr(owner, attr, wrapper)


def instrument() -> None:
    import waitress.channel
    import waitress.server
    from gmlx_contract import client, step_http
    from gmlx_server import app, http_gate, memory, worker
    from gmlx_server.engine.families.qwen_image21 import family
    from gmlx_server.routes import step

    wrap(client.StepClient, "_post_step", "client: post", "client: answer read")
    wrap(step_http, "send_all", None, "client: request sent")
    wrap(step_http.AnswerReader, "head", None, "client: answer head")
    wrap(step_http.AnswerReader, "exact", None, "client: answer body")
    wrap(http_gate.GatedChannel, "handle_read", "loop: read", None)
    wrap(waitress.server.BaseWSGIServer, "add_task", "loop: request queued", None)
    wrap(waitress.channel.HTTPChannel, "service", "task: start", "task: done")
    wrap(app.FrontGate, "process_request", "task: Falcon, gate", "task: gate passed")
    wrap(step, "parse_request", None, "route: parsed")
    wrap(memory.MemoryPlanner, "check_step_quick", None, "route: quick plan")
    wrap(worker.ImageWorker, "submit", "route: submit", None)
    # the plan begins with the step's demand (its rows' plans and bytes, counted on the worker)
    wrap(memory.StepDemand, "__init__", "worker: plan", None)
    wrap(memory.MemoryPlanner, "check_step", None, "worker: planned")
    wrap(family.QwenImage21Model, "denoise_step", "worker: forward", "worker: forward done")
    wrap(step, "execute", None, "route: result back")
    wrap(step.Step, "on_post", None, "route: answer built")
    wrap(waitress.channel.HTTPChannel, "write_soon", "task: write", "task: written")


def stub_forward(mode: str) -> None:
    import numpy as np
    from gmlx_server.engine.base import StepResult
    from gmlx_server.engine.families.qwen_image21 import family

    def answer_x(dit, cache, x, timestep, rows, call=None, weights=None):
        started = time.perf_counter()
        if mode == "sleep":
            time.sleep(0.65)
        out = np.array(x, dtype=np.float32)
        ms = (time.perf_counter() - started) * 1000.0
        return StepResult(out=out, prefix_cache="hit", forward_ms=ms)

    family.denoise_step = answer_x


def step_marks(warmup_steps: int) -> list[list[tuple[float, str, str]]]:
    """The marks of each step request (client post to answer read), the timed ones only."""
    steps, current = [], None
    for entry in MARKS:
        if entry[1] == "client: post":
            current = []
            steps.append(current)
        if current is not None and (not current or current[-1][1] != "client: answer read"):
            current.append(entry)
    return steps[warmup_steps:]


def report(steps: list[list[tuple[float, str, str]]]) -> None:
    def keyed(step):
        seen: dict[str, int] = {}
        for when, name, thread in step:
            seen[name] = seen.get(name, 0) + 1
            yield when, name if seen[name] == 1 else f"{name} ({seen[name]})", thread

    deltas: dict[str, list[float]] = {}
    for step in steps:
        previous = step[0][0]
        for when, key, _ in keyed(step):
            deltas.setdefault(key, []).append((when - previous) * 1000.0)
            previous = when
    print(f"{'mark':<32} {'ms since previous':>18}  thread  (median of {len(steps)} steps)")
    for _, key, thread in keyed(steps[-1]):
        print(f"{key:<32} {statistics.median(deltas[key]):>18.3f}  {thread}")
    print(
        f"request side (post -> forward starts): {side(steps, 'client: post', 'worker: forward')}"
    )
    print(
        "answer side (forward ends -> answer read):"
        f" {side(steps, 'worker: forward done', 'client: answer read')}"
    )


def side(steps: list[list[tuple[float, str, str]]], start: str, end: str) -> str:
    """Median and range over the steps of the time from the first `start` mark to the first
    `end` mark (the medians of the stages above do not add up to it: stages overlap and
    vary from step to step)."""
    spans = []
    for step in steps:
        first: dict[str, float] = {}
        for when, name, _ in step:
            first.setdefault(name, when)
        spans.append((first[end] - first[start]) * 1000.0)
    return f"{statistics.median(spans):.3f} ms ({min(spans):.2f}-{max(spans):.2f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=1024, help="image side in pixels")
    parser.add_argument("--stub", choices=["none", "sleep"], help="replace the forward")
    args = parser.parse_args(argv)

    from gmlx_server import image_cli, process

    process.prepare_process()  # before MLX is imported, as the bench does
    instrument()
    if args.stub:
        stub_forward(args.stub)
    out = Path(tempfile.mkdtemp()) / "bench.json"
    size = str(args.size)
    bench = ["--via-steps", "--width", size, "--height", size, "--cfg", "4", "--json-out", str(out)]
    if image_cli.run_bench_command(image_cli.bench_parser().parse_args(bench)):
        return 1
    record = json.loads(out.read_text())
    steps_per_image = len(record["runs"][0]["transport_ms"])
    steps = step_marks(warmup_steps=steps_per_image)  # the warm-up image's steps
    report([s for s in steps if s[-1][1] == "client: answer read"][: 2 * steps_per_image])
    print("transport median (the bench's record):", record["transport"]["overhead_ms_median"])
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # MLX may abort at exit after work on a non-main thread (see gmlx_server.cli)
