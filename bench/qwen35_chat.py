"""Qwen3.5 as a chat model (encoders/qwen35/chat.py, greedy generation over cached layers)
against transformers' `generate(do_sample=False)` on the same random checkpoint, on the CPU:
the time to the first new token (the prompt's prefill) and per new token after it, and MLX's
peak memory. The checkpoint is the "small" preset of bench/qwen35.py (Qwen3.5-9B's proportions
at a quarter of its width and depth), float32; both sides must agree token for token, which the
run checks before it reports.

    .venv/bin/python bench/qwen35_chat.py [--prompt 512] [--new 64] [--repeats 3]

Results go to docs/benchmarks.md ("Prompt encoding").
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gmlx_server.engine.blas import ensure_fast_blas  # noqa: E402 - after the path insert

BLAS = ensure_fast_blas()  # before MLX loads: its CPU backend's GEMMs

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from gmlx_server.engine.encoders.qwen35.chat import ChatModel  # noqa: E402

from bench.qwen35 import QWEN35  # noqa: E402

TEMPLATE = "{{ messages[0].content }}"  # the prompt's tokens as they are


def build(folder: Path, threads: int):
    import torch
    from gmlx_server.engine.embedded import BPE_VOCAB_SIZE, TOKENIZER_CORPUS
    from gmlx_server.engine.encoders.qwen3.tiny_tokenizer import train_tokenizer, write_tokenizer
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    tokenizer = train_tokenizer(TOKENIZER_CORPUS, BPE_VOCAB_SIZE)
    write_tokenizer(folder, tokenizer)
    # no stop token: as many new tokens as asked, on both sides
    config = Qwen3_5TextConfig(
        **{**QWEN35, "vocab_size": tokenizer.get_vocab_size()}, eos_token_id=None
    )
    model = Qwen3_5ForCausalLM(config).eval()
    model.save_pretrained(str(folder))
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return model, ChatModel.load(folder)


def timed(run, repeats: int) -> tuple[float, list]:
    times, out = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - started)
    return float(np.median(times)) * 1000.0, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    parser.add_argument("--new", type=int, default=64, help="new tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch's CPU threads")
    args = parser.parse_args()
    import torch

    with tempfile.TemporaryDirectory() as scratch:
        reference, ours = build(Path(scratch), args.threads)
    vocab = ours.network.model.config.vocab_size
    ids = np.random.default_rng(0).integers(0, vocab, args.prompt).astype(np.int32)
    ours.stop_ids = frozenset()  # no stop token on either side (the checkpoint names none)
    rows = []
    for new in (1, args.new):
        mx.reset_peak_memory()
        ms, got = timed(lambda n=new: ours.greedy(ids, n), args.repeats)
        peak = mx.get_peak_memory() / 2**20
        with torch.no_grad():
            their_ms, theirs = timed(
                lambda n=new: reference.generate(
                    torch.from_numpy(ids.astype(np.int64))[None],
                    max_new_tokens=n,
                    do_sample=False,
                    pad_token_id=0,
                )[0, len(ids) :].tolist(),
                args.repeats,
            )
        if got.ids != theirs:
            raise SystemExit(f"the generations differ: {got.ids[:8]} ... against {theirs[:8]} ...")
        rows.append((new, ms, their_ms, peak))
    (_, first, their_first, _), (new, total, their_total, peak) = rows
    per, their_per = (total - first) / (new - 1), (their_total - their_first) / (new - 1)
    print(f"BLAS: {BLAS}; prompt {args.prompt} tokens, {new} new, median of {args.repeats}")
    print("| | ours ms | transformers ms | ratio |")
    print("|---|---|---|---|")
    print(
        f"| prompt (first token) | {first:,.0f} | {their_first:,.0f} | {first / their_first:.2f} |"
    )
    print(f"| each new token | {per:,.1f} | {their_per:,.1f} | {per / their_per:.2f} |")
    print(f"MLX peak: {peak:,.0f} MiB; weights {ours.weight_bytes / 2**20:,.0f} MiB")


if __name__ == "__main__":
    main()
