"""The figures README.md and docs/server.md quote agree with where they are measured or computed:
README's size table with itself, its 4-bit full-size figures with docs/benchmarks.md's
"Full-size memory" table, and server.md's `gmlx status` example with the embedded default it
shows, loaded at 4 bits."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SERVER = (ROOT / "docs" / "server.md").read_text()
BENCHMARKS = (ROOT / "docs" / "benchmarks.md").read_text()


def one(pattern: str, text: str, where: str) -> re.Match:
    found = list(re.finditer(pattern, text))
    assert len(found) == 1, f"{where}: {len(found)} matches of {pattern!r}"
    return found[0]


def size_table() -> str:
    """README's size table of the full Qwen-Image 2.1."""
    start = README.index("Sizes, by arithmetic")
    return README[start : README.index("| total |", start) + 200]


def size_rows() -> dict[str, float]:
    """README's size table: part -> GB on disk in bf16."""
    rows = {}
    for part in ("DiT", "prompt encoder", "VAE"):
        match = one(rf"\| {part} \(`[^|]*\| [\d.]+ B \| ([\d.]+) GB \|", size_table(), "README")
        rows[part] = float(match[1])
    return rows


def full_size(component: str, bits: int, dtype: str) -> float:
    """docs/benchmarks.md "Full-size memory": the weights GB of a row."""
    match = one(rf"\| {component} \| {bits} \| {dtype} \| ([\d.]+) \|", BENCHMARKS, "benchmarks")
    return float(match[1])


def test_readmes_total_is_its_parts_and_its_prose_quotes_it():
    rows = size_rows()
    total = float(one(r"\| total \| [\d.]+ B \| ([\d.]+) GB", size_table(), "README")[1])
    assert round(sum(rows.values()), 1) == total
    quoted = float(one(r"model's ≈ ([\d.]+) GB of weights in bf16", README, "README")[1])
    assert quoted == total


def test_readmes_4_bit_figures_are_the_measured_ones():
    match = one(
        r"at 4 bits the DiT holds ([\d.]+) GB\n\(float32 around it, the CPU backend\) or ([\d.]+)"
        r" GB \(bf16\), the prompt encoder ([\d.]+) GB \(float32\),\nthe VAE ([\d.]+) GB",
        README,
        "README",
    )
    dit_f32, dit_bf16, encoder, vae = (float(v) for v in match.groups())
    assert dit_f32 == pytest.approx(full_size("DiT", 4, "f32"), abs=0.05)
    assert dit_bf16 == pytest.approx(full_size("DiT", 4, "bf16"), abs=0.05)
    assert encoder == full_size("text encoder", 4, "f32")
    assert vae == pytest.approx(full_size(r"VAE \(never quantized\)", 16, "f32"), abs=0.05)


def test_server_mds_rank_0_figure_is_readmes_encoder_and_vae():
    rows = size_rows()
    match = one(
        r"in bf16 on Metal,\n([\d.]+) \+ ([\d.]+) GB: README\.md's table", SERVER, "server.md"
    )
    assert (float(match[1]), float(match[2])) == (rows["prompt encoder"], rows["VAE"])


def test_server_mds_status_example_is_the_embedded_default_at_4_bits(tmp_path):
    from gmlx_server.config import ImageConfig
    from gmlx_server.discovery import _residency_line
    from gmlx_server.engine.families.qwen_image21 import family
    from gmlx_server.engine.families.qwen_image21.embedded import ensure_embedded_model
    from gmlx_server.engine.precision import Quantization

    example = one(r"  qwen-image21-random-tiny: dit [^\n]*", SERVER, "server.md")[0]
    model = family.QWEN_IMAGE21.load(ensure_embedded_model(tmp_path), "tiny", Quantization(4))
    residency = model.status()["residency"]
    residency["encoder"]["resident"] = False  # as the example shows it: released by a step
    residency["encoder"]["policy"] = ImageConfig().encoder_residency  # the server's default
    line = _residency_line({"model": "qwen-image21-random-tiny", "residency": residency})
    assert line == example
