"""The bench record of docs/contract.md §6 (schema gmlx.image.bench/1): whole images timed in
process, or through the step routes served in process (`--via-steps`), whose last timed run's
latents are compared with a direct run's (`equal_to_direct`); `summary_text` is its lines for
a terminal."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import __version__
from .engine.sampling import ImageRequest, ImageTimings, generate
from .lora_files import AdapterSpec, sampling_table
from .memory import host_bytes
from .model_choice import ModelChoice
from .step_server import StepServer, ViaStepsTransport

SCHEMA = "gmlx.image.bench/1"


@dataclass
class BenchRun:
    timings: ImageTimings
    decode_s: float
    peak_bytes: int
    latents: np.ndarray
    transport_ms: list[float] = field(default_factory=list)

    def record(self, via_steps: bool) -> dict:
        doc = {
            "encode_s": round(self.timings.encode_s, 6),
            "step_s": [round(s, 6) for s in self.timings.step_s],
            "decode_s": round(self.decode_s, 6),
            "image_s": round(self.timings.image_s + self.decode_s, 6),
            "peak_bytes": self.peak_bytes,
        }
        if via_steps:
            doc["transport_ms"] = [round(ms, 3) for ms in self.transport_ms]
        return doc


def run_bench(
    choice: ModelChoice,
    request: ImageRequest,
    runs: int,
    warmup: int,
    via_steps: bool,
    label: str | None = None,
    adapters: Sequence[AdapterSpec] = (),
) -> dict:
    """The bench record of docs/contract.md §6 for one size (`adapters`: direct mode only)."""
    from gmlx_contract.client import StepClient

    with StepServer(choice) as server:
        started = time.perf_counter()
        loaded = server.load()
        weights_s = time.perf_counter() - started
        status = loaded.model.status()
        table = server.service.worker.call(sampling_table, loaded, adapters)
        direct = server.direct(table)
        adapters = adapters or loaded.default_adapters
        timed: list[BenchRun] = []
        client = StepClient(server.base_url) if via_steps else None
        try:
            for i in range(warmup + runs):
                if via_steps:
                    server.service.tensors.clear()  # each run uploads its conditionings
                    client.forget_known()
                    transport = ViaStepsTransport(client, direct, choice.model_id)
                else:
                    transport = direct
                run = one_image(transport, status, request)
                if i >= warmup:
                    timed.append(run)
            equal = None
            if via_steps:
                reference = one_image(direct, status, request)
                equal = bool(np.array_equal(timed[-1].latents, reference.latents, equal_nan=True))
        finally:
            if client is not None:
                client.close()
    load_s = {"prepare": round(choice.prepare_s, 6), "weights": round(weights_s, 6)}
    load_s["total"] = round(choice.prepare_s + weights_s, 6)
    return bench_record(loaded, status, request, timed, load_s, via_steps, equal, label, adapters)


def one_image(transport: Any, status: dict, request: ImageRequest) -> BenchRun:
    import mlx.core as mx

    mx.reset_peak_memory()
    latents, timings = generate(transport, status, request)
    started = time.perf_counter()
    transport.decode(latents)
    decode_s = time.perf_counter() - started
    return BenchRun(
        timings=timings,
        decode_s=decode_s,
        peak_bytes=int(mx.get_peak_memory()),
        latents=latents,
        transport_ms=list(getattr(transport, "transport_ms", [])),
    )


def bench_record(
    loaded: Any,
    status: dict,
    request: ImageRequest,
    runs: list[BenchRun],
    load_s: dict,
    via_steps: bool,
    equal_to_direct: bool | None,
    label: str | None,
    adapters: Sequence[AdapterSpec] = (),
) -> dict:
    import mlx.core as mx

    steps_per_run = [run.timings.step_s for run in runs]
    all_steps = [s for steps in steps_per_run for s in steps]
    sampling = status.get("sampling") or {}
    settings = {
        "width": request.width,
        "height": request.height,
        "steps": len(steps_per_run[0]),
        "sampler": request.sampler,
        "scheduler": None,
        "guidance": float(request.cfg if request.cfg is not None else sampling.get("cfg") or 1.0),
        "batch": 1,
        "adapters": [spec.record() for spec in adapters],
        "seed": request.seed,
        "prompt": request.prompt,
    }
    if request.images and not via_steps:
        settings["refs"] = [list(image.shape) for image in request.images]
    if via_steps:
        transport_all = [ms for run in runs for ms in run.transport_ms]
        transport = {
            "mode": "steps",
            "overhead_ms_median": round(statistics.median(transport_all), 3),
            "equal_to_direct": equal_to_direct,
        }
    else:
        transport = {"mode": "direct", "overhead_ms_median": None}
    return {
        "schema": SCHEMA,
        "gmlx_version": __version__,
        "mlx_version": mx.__version__,
        "label": label,
        "machine": machine(),
        "model": model_record(loaded, status),
        "settings": settings,
        "runs": [run.record(via_steps) for run in runs],
        "summary": {
            "load_s": load_s,
            "encode_s": round(statistics.median(r.timings.encode_s for r in runs), 6),
            "s_per_step": {
                "first": round(statistics.median(steps[0] for steps in steps_per_run), 6),
                "median": round(statistics.median(all_steps), 6),
                "mean": round(statistics.fmean(all_steps), 6),
            },
            "decode_s": round(statistics.median(r.decode_s for r in runs), 6),
            "s_per_image": round(
                statistics.median(r.timings.image_s + r.decode_s for r in runs), 6
            ),
            "peak_bytes": max(r.peak_bytes for r in runs),
        },
        "transport": transport,
    }


def model_record(loaded: Any, status: dict) -> dict:
    folder = Path(loaded.entry.path)
    memory = status.get("memory", {})
    # the resident precision (status `quantization`, an extension): null as the files store it
    quantization = status.get("quantization") or {}
    residency = status.get("residency") or {}  # an extension too: each component's dtype
    dtypes = sorted({t["dtype"] for t in loaded.model.manifest().get("tensors", [])})
    return {
        "id": loaded.model_id,
        "family": loaded.entry.family,
        "variant": loaded.entry.variant,
        "dit": {
            "file": str(folder / "transformer"),
            "bytes": int(memory.get("dit_bytes", 0)),
            "quant": "+".join(dtypes) or None,
            "quantization": quantization.get("dit"),
        },
        "encoder": {
            "file": str(folder / "text_encoder"),
            "bytes": int(memory.get("encoder_bytes", 0)),
            "shared": False,
            "quantization": quantization.get("encoder"),
        },
        "vae": {
            "file": str(folder / "vae"),
            "bytes": int(memory.get("vae_bytes", 0)),
            "dtype": residency.get("vae", {}).get("dtype", "f32"),
        },
    }


def machine() -> dict:
    return {"chip": chip_name(), "ram_bytes": host_bytes(), "os": platform.platform()}


def chip_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def summary_text(record: dict) -> str:
    s, t = record["summary"], record["transport"]
    settings = record["settings"]
    lines = [
        f"{record['model']['id']} {settings['width']}x{settings['height']}, "
        f"{settings['steps']} steps, cfg {settings['guidance']}, {record['machine']['chip']}",
        f"  load {s['load_s']['total']:.2f} s, encode {s['encode_s']:.3f} s, "
        f"step median {s['s_per_step']['median'] * 1000:.1f} ms (first "
        f"{s['s_per_step']['first'] * 1000:.1f} ms), decode {s['decode_s']:.3f} s, "
        f"image {s['s_per_image']:.2f} s",
    ]
    if t["mode"] == "steps":
        lines.append(
            f"  via steps: transport {t['overhead_ms_median']:.2f} ms per step (median), "
            f"equal_to_direct {t['equal_to_direct']}"
        )
    return "\n".join(lines)
