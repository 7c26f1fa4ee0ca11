"""The DiT sharded over a rank group (server/distributed.py): bytes between ranks per step,
resident bytes per rank, step time on 1, 2 and 3 local ranks.

computed  the bytes each rank sends per step and the DiT bytes each rank holds, from the
          config alone, for the full-size Qwen-Image 2.1 (the family's default DiT config: 32
          blocks, 32 heads x 128 = 4096 wide, SwiGLU x3, text width 4096) at 1024x1024 (64x64
          latents, 4096 tokens), bf16, a guided step (2 rows) with 1024-row prompts, and the
          expected communication time per step over 10 GbE, Thunderbolt 4/5 and NVLink.
measured  the tiny test folder (tests/shard/folder.py: 6 blocks, 6 heads x 32) on 1, 2 and 3
          loopback ranks (ring backend) in each mode, in one run: a prefix miss and hits at
          `--size` latents, each rank's bytes written to its sockets (/proc/self/io wchar) and
          handed to the backend, against the same formula for the tiny config; the DiT's
          bytes and the peak resident set per rank; the step time (median of the hits).

load      a random DiT of 8 blocks, 16 heads x 64, float32, loaded in a fresh process whole, as
          rank 1 of 2 in pipeline mode and as rank 0 of 2 in tensor mode: the DiT bytes held,
          the peak resident set and MLX's peak memory.

    .venv/bin/python bench/shard.py [--ranks 1 2 3] [--size 16x16] [--text 32] [--repeats 5]
    .venv/bin/python bench/shard.py --computed-only
    .venv/bin/python bench/shard.py load

Results go to docs/benchmarks.md ("One model over several ranks").
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAUNCH = [sys.executable, "-c", "from mlx._distributed_utils.launch import main; main()"]
# Link rates, one direction, in bytes per second (nominal line rate x the usable share we
# assume: TCP over 10 GbE 94 %, Thunderbolt networking (IP over TB) about half its line rate,
# NVLink 4 per GPU 450 GB/s each way at 80 %).
LINKS = {
    "10 GbE": 10e9 / 8 * 0.94,
    "Thunderbolt 4 (40 Gb/s)": 40e9 / 8 * 0.5,
    "Thunderbolt 5 (80 Gb/s)": 80e9 / 8 * 0.5,
    "NVLink 4 (450 GB/s)": 450e9 * 0.8,
}
FULL = {  # the family's default DiT config (dit.DiTConfig.from_dict({}))
    "num_layers": 32,
    "num_attention_heads": 32,
    "attention_head_dim": 128,
    "mlp_ratio": 3,
    "in_channels": 64,
    "context_in_dim": 4096,
}


@dataclass(frozen=True)
class Traffic:
    """A step's traffic over a rank group: the DiT of `config` split in `mode` over `ranks`,
    `rows` rows of `tokens` image tokens, a text prefix of `prefix` rows built for `built` of
    them, activations of `act` bytes a value, and the step's `inputs` bytes."""

    config: dict
    mode: str
    ranks: int
    rows: int
    tokens: int
    prefix: int
    built: int
    act: int
    inputs: int

    @property
    def ring(self) -> float:
        """The share of its bytes a ring all_sum sends: 2 (N - 1) / N."""
        return 2 * (self.ranks - 1) / self.ranks

    def activations(self) -> tuple[float, float]:
        """The bytes of one block's output for the target pass, and for the prefixes built."""
        width = self.config["num_attention_heads"] * self.config["attention_head_dim"]
        target = self.rows * self.tokens * width * self.act
        return target, self.built * self.prefix * width * self.act

    def sent(self) -> dict[str, float]:
        """Bytes one rank sends in a step: the activations (pipeline: its stage's output once
        per step, and per prefix built, its stage's output when another stage follows; tensor:
        two all_sums per block, each a ring all_sum) and the step's inputs (broadcast as a ring
        all_sum)."""
        if self.ranks == 1:
            return {"activations": 0.0, "inputs": 0.0}
        layers = self.config["num_layers"]
        target, prefix_rows = self.activations()
        if self.mode == "pipeline":
            # each rank sends its target stage once; all but the last send each prefix built
            activations = target + prefix_rows * (self.ranks - 1) / self.ranks
        else:
            activations = self.ring * (2 * layers * target + 2 * (layers - 1) * prefix_rows)
        return {"activations": activations, "inputs": self.ring * self.inputs}

    def critical(self) -> float:
        """The bytes on a step's critical path, one link's worth after another: the inputs'
        ring all_sum, then pipeline: each of the N stage boundaries of the target pass (and
        N - 1 per prefix built) in turn; tensor: every all_sum in turn. Latency per message is
        left out (64 all_sums x 2 (N - 1) hops x tens of microseconds: milliseconds)."""
        if self.mode == "pipeline":
            target, prefix_rows = self.activations()
            return self.ring * self.inputs + self.ranks * target + (self.ranks - 1) * prefix_rows
        return sum(self.sent().values())


def dit_bytes(config: dict, mode: str, ranks: int, itemsize: int) -> list[int]:
    """The DiT bytes each rank holds: the layers outside the blocks on every rank; the blocks
    by stage (pipeline) or their linears split (tensor)."""
    from gmlx_server.engine.families.qwen_image21 import embedded
    from gmlx_server.engine.shard_plan import stage_bounds

    full = {**embedded.TRANSFORMER_CONFIG, **config}
    tensors = embedded.transformer_tensors(full)
    block = [
        shape for name, (shape, _) in tensors.items() if name.startswith("transformer_blocks.0.")
    ]
    top = sum(
        _count(shape)
        for name, (shape, _) in tensors.items()
        if not name.startswith("transformer_blocks.")
    )
    linears = sum(_count(s) for s in block if len(s) == 2)
    norms = sum(_count(s) for s in block if len(s) == 1)
    layers = full["num_layers"]
    if mode == "pipeline" or ranks == 1:
        bounds = stage_bounds(layers, ranks)
        return [(top + (stop - start) * (linears + norms)) * itemsize for start, stop in bounds]
    return [(top + layers * (linears // ranks + norms)) * itemsize] * ranks


def _count(shape) -> int:
    total = 1
    for n in shape:
        total *= n
    return total


def input_bytes(
    rows: int, channels: int, tokens: int, prefix: int, context: int, built: int
) -> int:
    """The step's arrays as they travel (float32): x, and the conditioning of each row built."""
    return 4 * (rows * channels * tokens + built * prefix * context)


# ---------------------------------------------------------------- one measured configuration


def run(folder: Path, mode: str, size: tuple[int, int], text: int, repeats: int) -> dict:
    """On every rank (or one process): the figures of one configuration, printed by rank 0."""
    from gmlx_server.process import prepare_process

    prepare_process()  # before mlx: the optimised BLAS
    import numpy as np
    from gmlx_server import distributed
    from gmlx_server.engine.base import StepRow
    from gmlx_server.engine.registry import ModelRegistry

    group = distributed.join(mode)
    registry = ModelRegistry(extra_models=[folder])
    if group is not None:
        distributed.attach(group, registry)
    model = registry.acquire(folder.name).model
    rng = np.random.default_rng(0)
    h, w = size
    x = rng.standard_normal((2, 64, h, w)).astype(np.float32)
    timestep = np.array([0.6, 0.6], np.float32)

    def rows(tag: str) -> list[StepRow]:
        return [
            StepRow(rng.standard_normal((text, 128)).astype(np.float32), f"wire:{tag}{i}")
            for i in range(2)
        ]

    def figures() -> list[dict]:
        if group is None:
            values = distributed.rank_figures([model])
            return [dict(zip(distributed.REPORT_FIGURES, values, strict=True))]
        return distributed.report(group, [model])

    def measured(step) -> tuple[dict, float]:
        """Per rank over one step: the bytes its TCP sockets sent (the kernel's count) and the
        bytes it handed to the collectives (the reports around the step included: a few
        hundred bytes)."""
        before = figures()
        pids = [f["pid"] for f in before]
        sockets = socket_bytes(pids)
        started = time.perf_counter()
        step()
        elapsed = time.perf_counter() - started
        after, sockets_after = figures(), socket_bytes(pids)
        handed = [
            a["collective_bytes"] - b["collective_bytes"]
            for a, b in zip(after, before, strict=True)
        ]
        return {"sent": [sockets_after[p] - sockets[p] for p in pids], "handed": handed}, elapsed

    model.denoise_step(x, timestep, rows("warm"), run="r")  # compiles, allocates
    hot = rows("hot")
    miss, miss_s = measured(lambda: model.denoise_step(x, timestep, hot, run="r"))
    times = []
    for _ in range(repeats):
        hit, elapsed = measured(lambda: model.denoise_step(x, timestep, hot, run="r"))
        times.append(elapsed)
    final = figures()
    result = {
        "ranks": 1 if group is None else group.size,
        "mode": mode,
        "miss": {**miss, "s": miss_s},
        "hit": {**hit, "median_s": statistics.median(times), "times_s": times},
        "weight_bytes": [f["weight_bytes"] for f in final],
        "dit_bytes_rank0": model.dit.weight_bytes,
        "peak_rss_bytes": [f["peak_rss_bytes"] for f in final],
    }
    registry.unload_all()
    if group is not None:
        distributed.stop_group(group)
    return result


def socket_bytes(pids: list[int]) -> dict[int, int]:
    """Bytes each process's TCP sockets have sent, less retransmissions (`ss -tinp`, Linux)."""
    counts = dict.fromkeys(pids, 0)
    done = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True)
    owner = None
    for line in done.stdout.splitlines():
        found = re.search(r"pid=(\d+),", line)
        if found:
            owner = int(found.group(1))
            continue
        sent = re.search(r"bytes_sent:(\d+)", line)
        if sent and owner in counts:
            retrans = re.search(r"bytes_retrans:(\d+)", line)
            counts[owner] += int(sent.group(1)) - (int(retrans.group(1)) if retrans else 0)
    return counts


def launch_run(folder: Path, ranks: int, mode: str, args) -> dict:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "run",
        str(folder),
        mode,
        "--size",
        args.size,
        "--text",
        str(args.text),
        "--repeats",
        str(args.repeats),
    ]
    if ranks > 1:
        port = 41000 + 10 * ranks + (0 if mode == "pipeline" else 5)
        command = [
            *LAUNCH,
            "-n",
            str(ranks),
            "--backend",
            "ring",
            "--starting-port",
            str(port),
            "--",
            *command,
        ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(
            f"{ranks} ranks, {mode}: no result\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    return json.loads(lines[-1][len("RESULT ") :])


def tiny_config() -> dict:
    from tests.shard.folder import TRANSFORMER_CONFIG

    return TRANSFORMER_CONFIG


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("load")
    load_one = sub.add_parser("load-one")
    load_one.add_argument("folder", type=Path)
    load_one.add_argument("mode")
    load_one.add_argument("rank", type=int)
    one = sub.add_parser("run")
    one.add_argument("folder", type=Path)
    one.add_argument("mode")
    for p in (parser, one):
        p.add_argument("--size", default="16x16")
        p.add_argument("--text", type=int, default=32)
        p.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--computed-only", action="store_true", help="the full-size figures alone")
    args = parser.parse_args(argv)
    size = tuple(int(v) for v in args.size.split("x"))
    if args.command == "load":
        return load_figures()
    if args.command == "load-one":
        print(json.dumps(load_one_figures(args.folder, args.mode, args.rank)))
        return 0
    if args.command == "run":
        result = run(args.folder, args.mode, size, args.text, args.repeats)
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    print(json.dumps({"computed": computed_tables()}, indent=1))
    if args.computed_only:
        return 0
    from tests.shard.folder import build_shard_folder

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_shard_folder(Path(tmp) / "tiny-shard")
        tokens = size[0] * size[1]
        for ranks in args.ranks:
            for mode in ("pipeline", "tensor") if ranks > 1 else ("pipeline",):
                result = launch_run(folder, ranks, mode, args)
                config = tiny_config()
                for kind, built in (("miss", 2), ("hit", 0)):
                    inputs = input_bytes(2, 64, tokens, args.text, 128, built)
                    traffic = Traffic(config, mode, ranks, 2, tokens, args.text, built, 4, inputs)
                    result[kind]["computed"] = traffic.sent()
                result["computed_dit_bytes"] = dit_bytes(config, mode, ranks, 4)
                print(json.dumps(result), flush=True)
    return 0


LOAD_CONFIG = {"num_layers": 8, "num_attention_heads": 16, "attention_head_dim": 64}


def load_figures() -> int:
    import numpy as np
    from gmlx_server.engine.embedded import DIFFUSERS_WEIGHTS, draw, write_component
    from gmlx_server.engine.families.qwen_image21 import embedded

    config = {**embedded.TRANSFORMER_CONFIG, **LOAD_CONFIG, "axes_dims_rope": [16, 24, 24]}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "transformer"
        tensors = embedded.transformer_tensors(config)
        weights = draw(tensors, np.random.default_rng(0), embedded.CONSTANT_NOISE)
        write_component(folder, config, weights, DIFFUSERS_WEIGHTS)
        del weights
        for mode, rank in (("whole", 0), ("pipeline", 1), ("tensor", 0)):
            command = [sys.executable, __file__, "load-one", str(folder), mode, str(rank)]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            print(done.stdout.strip(), flush=True)
    return 0


def load_one_figures(folder: Path, mode: str, rank: int) -> dict:
    import resource

    from gmlx_server.process import prepare_process

    prepare_process()
    import mlx.core as mx
    from gmlx_server.engine.families.qwen_image21.dit import QwenImage21DiT
    from gmlx_server.engine.shard import Shard

    shard = None if mode == "whole" else Shard(mode, rank, 2)
    dit = QwenImage21DiT.load(folder, shard=shard)
    return {
        "load": mode,
        "rank": rank,
        "dit_bytes": dit.weight_bytes,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "mlx_peak_bytes": mx.get_peak_memory(),
    }


def computed_tables() -> list[dict]:
    """The full-size figures at 1024x1024, bf16, guided, 1024-row prompts."""
    rows, tokens, prefix, act = 2, 64 * 64, 1024, 2
    table = []
    heads, mlp = (
        FULL["num_attention_heads"],
        FULL["num_attention_heads"] * FULL["attention_head_dim"] * FULL["mlp_ratio"],
    )
    for ranks in (2, 3, 4):
        for mode in ("pipeline", "tensor"):
            if mode == "tensor" and (heads % ranks or mlp % ranks):
                continue  # refused: every rank needs whole heads and an equal MLP share
            for kind, built in (("hit", 0), ("miss", 2)):
                inputs = input_bytes(rows, 64, tokens, prefix, FULL["context_in_dim"], built)
                traffic = Traffic(FULL, mode, ranks, rows, tokens, prefix, built, act, inputs)
                total, serial = sum(traffic.sent().values()), traffic.critical()
                table.append(
                    {
                        "ranks": ranks,
                        "mode": mode,
                        "step": kind,
                        "sent_per_rank_MiB": round(total / 2**20, 1),
                        "comm_ms": {
                            link: round(1000 * serial / rate, 1) for link, rate in LINKS.items()
                        },
                        "dit_GiB_per_rank": [
                            round(b / 2**30, 2) for b in dit_bytes(FULL, mode, ranks, 2)
                        ],
                    }
                )
    table.append({"ranks": 1, "dit_GiB": round(dit_bytes(FULL, "pipeline", 1, 2)[0] / 2**30, 2)})
    return table


if __name__ == "__main__":
    sys.exit(main())
