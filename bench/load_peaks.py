"""Peak memory while each component loads, against what it holds loaded: the DiT, the text
encoder and the VAE of a wide Qwen-Image 2.1 folder stored in bfloat16
(tests/families/qwen_image21/tiny/wide.py: 16 DiT blocks and 16 encoder layers at width 256),
at bf16 and float32 compute, float and quantized at 4 and 8 bits. The peak is MLX's
`get_peak_memory` over the load, less the active memory before it.

    .venv/bin/python bench/load_peaks.py [--json]

Results go to docs/benchmarks.md ("Load peaks"); tests/families/qwen_image21/test_load_peaks.py
bounds them at 1.15x.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def peak_of(load) -> tuple[int, int]:
    """(resident bytes, load peak) of load() -> an object with `weight_bytes`."""
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    loaded = load()
    peak = mx.get_peak_memory() - before
    resident = loaded.weight_bytes
    del loaded
    return resident, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON list")
    args = parser.parse_args()
    import mlx.core as mx
    from gmlx_server.engine.families.qwen_image21.dit import QwenImage21DiT
    from gmlx_server.engine.families.qwen_image21.prompt import QwenImage21PromptEncoder
    from gmlx_server.engine.precision import Quantization
    from gmlx_server.engine.vaes.qwen_image21 import QwenImage21VAE

    from tests.families.qwen_image21.tiny.wide import write_wide_folder

    folder = write_wide_folder(Path(tempfile.mkdtemp()) / "wide")
    loads = {
        "dit": lambda d, q: QwenImage21DiT.load(folder / "transformer", d, q),
        "encoder": lambda d, q: QwenImage21PromptEncoder.load(folder, d, q),
        "vae": lambda d, q: QwenImage21VAE.load(folder / "vae", d),
    }
    rows = []
    for dtype in (mx.bfloat16, mx.float32):
        for name, load in loads.items():
            for bits in (None, 4, 8) if name != "vae" else (None,):
                quantization = Quantization(bits) if bits else None
                resident, peak = peak_of(lambda load=load, d=dtype, q=quantization: load(d, q))
                row = {
                    "component": name,
                    "compute": "bf16" if dtype == mx.bfloat16 else "f32",
                    "weights": f"{bits}-bit" if bits else "float",
                    "resident_bytes": resident,
                    "peak_bytes": peak,
                    "ratio": round(peak / resident, 3),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
