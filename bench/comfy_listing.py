"""Listing ComfyUI's model folders: how long `comfy_sets` (engine/components.py) takes to read
every file's header and list the sets, cold (a fresh process's first listing) and warm (the
headers kept by file size and time).

The folder is written first under `--root`: `--dits` full-size Z-Image Turbo DiT files in
ComfyUI's names (sparse: a header over a hole, 12.3 GB of nominal bf16 data each), Qwen3-4B as
one safetensors file (sparse too), a llama.cpp GGUF text encoder carrying Qwen's whole
tokenizer metadata (151,936 tokens and 151,387 merges, the arrays the listing skips) and FLUX.1's
VAE.

    .venv/bin/python bench/comfy_listing.py --root /tmp/comfy-listing [--dits 196] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VOCAB = 151936
MERGES = 151387


def write_folder(root: Path, dits: int) -> Path:
    import gguf
    import numpy as np

    from tests.engine.test_components_full_size import (
        flux1_vae_file,
        qwen3,
        write_sparse,
        z_image_dit_files,
    )

    models = root / "models"
    for kind in ("diffusion_models", "text_encoders", "vae"):
        (models / kind).mkdir(parents=True, exist_ok=True)
    z_image_dit_files(
        models / "diffusion_models" / f"z_image_turbo_{i:03d}.safetensors" for i in range(dits)
    )
    write_sparse(
        models / "text_encoders" / "qwen_3_4b.safetensors", qwen3(2560, 36, 32, 8, 9728)[1]
    )
    writer = gguf.GGUFWriter(
        str(models / "text_encoders" / "Qwen3-4B-tokenizer.gguf"), arch="qwen3"
    )
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"tok{i}" for i in range(VOCAB)])
    writer.add_token_types([1] * VOCAB)
    writer.add_token_merges([f"t{i} o{i}" for i in range(MERGES)])
    writer.add_tensor("token_embd.weight", np.zeros((8, 16), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    flux1_vae_file(models / "vae" / "ae.safetensors")
    return models


LISTING = """
import json, sys, time
from pathlib import Path
from gmlx_server.engine import components
from gmlx_server.engine.spec import family_specs
models = Path(sys.argv[1])
folders = {key: [models / name for name in names] for key, names in components.COMFY_FOLDERS.items()}
specs = family_specs()
times = []
for _ in range(2):
    start = time.perf_counter()
    sets = components.comfy_sets(folders, specs)
    times.append(time.perf_counter() - start)
files = sum(1 for p in models.rglob("*") if p.is_file())
print(json.dumps({"files": files, "sets": len(sets), "cold_s": times[0], "warm_s": times[1]}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--dits", type=int, default=196)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()
    models = write_folder(args.root, args.dits)
    written = time.perf_counter() - started
    done = subprocess.run(
        [sys.executable, "-c", LISTING, str(models)], capture_output=True, text=True, check=True
    )
    record = {**json.loads(done.stdout), "written_s": round(written, 1)}
    if args.json:
        print(json.dumps(record))
    else:
        print(
            f"{record['files']} files, {record['sets']} sets: listed in {record['cold_s']:.3f} s"
            f" cold, {record['warm_s']:.3f} s warm"
        )


if __name__ == "__main__":
    main()
