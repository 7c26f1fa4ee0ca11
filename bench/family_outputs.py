"""What every family answers on the wire, digested, and the same digest of another revision.

For each family's tiny model (the embedded recipes of Qwen-Image 2.1, Z-Image, Krea 2, FLUX.3 klein
and MOSS-Image, FLUX.2 klein's and its 9B KV's tiny folders from the tests' builders), loaded as
its folder stores it, 4-bit quantized and with its DiT from a GGUF file of mixed types, this asks a
real server (Waitress on a loopback port) for: the status before and after the load, the manifest,
encodings (with reference images where the family takes them), steps under both conventions with
two rows, with reference latents and under a LoRA patch table, and the VAE routes both ways. Each
answer is kept whole (JSON) or as the sha256 of its tensors' bytes.

    python bench/family_outputs.py --against HEAD~3 [--keep DIR]

builds the folders once, runs the dump in a checkout of that revision (a git worktree) and in
the working tree, each in its own process over the same folders, and prints every answer that
differs (exit 1) or says that all are byte-for-byte equal. `--dump OUT` writes one tree's digest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the tests' tiny builders, run as a script from anywhere
    sys.path.append(str(ROOT))
PACKAGES = {"gmlx_server": "server", "gmlx_contract": "shared", "gmlx_comfy": "comfy_nodes"}
# How each folder is loaded: as it is, quantized to 4 bits at load, its DiT from its GGUF file.
VARIANTS = ("plain", "q4", "gguf")
# The families whose embedded recipe is the folder; FLUX.2 klein's come from the tests' builder.
EMBEDDED = ("qwen_image21", "z_image", "krea2", "flux3_klein", "moss_image")
FOLDERS = (*EMBEDDED, "flux2_klein", "flux2_klein_9b_kv")
TEXTS = ("a red fox in the snow", "")


# ------------------------------------------------------------------------------ the folders


def build_folders(root: Path) -> None:
    """The tiny folders and each DiT's GGUF file (a mix of F32, F16, Q8_0, Q4_0 and Q5_1)."""
    import importlib

    from tests.families.flux2_klein.tiny.folder import build_tiny_folder

    for name in EMBEDDED:
        embedded = importlib.import_module(f"gmlx_server.engine.families.{name}.embedded")
        embedded.RECIPE.write_folder(root / name)
    build_tiny_folder(root / "flux2_klein", "flux2_klein", seed=3)
    build_tiny_folder(root / "flux2_klein_9b_kv", "flux2_klein_9b_kv", seed=4)
    for name in FOLDERS:
        write_dit_gguf(root / name / "transformer", root / f"{name}.gguf")


def write_dit_gguf(transformer: Path, path: Path) -> None:
    from gguf import GGMLQuantizationType as T
    from safetensors.numpy import load_file

    from tests.engine.gguf_files import encoded, write_gguf

    weights = {}
    for file in sorted(transformer.glob("*.safetensors")):
        weights.update(load_file(file))
    rng = np.random.default_rng(0)
    kinds = (T.Q8_0, T.Q4_0, T.Q5_1)
    tensors = {}
    for index, (name, value) in enumerate(sorted(weights.items())):
        value = value.astype(np.float32)
        if value.ndim == 2 and value.shape[1] % 32 == 0:
            kind = kinds[index % len(kinds)]
        else:
            kind = T.F16 if index % 2 else T.F32
        tensors[name] = (kind, encoded(kind, value, rng))
    write_gguf(path, tensors, arch=None)


# ------------------------------------------------------------------------------ the dump


def digest(array: np.ndarray) -> str:
    array = np.ascontiguousarray(array)
    return f"{array.dtype}{list(array.shape)}:{hashlib.sha256(array.tobytes()).hexdigest()[:24]}"


def dump(root: Path) -> dict:
    from gmlx_server.config import ImageConfig, ServerConfig
    from gmlx_server.engine.load_settings import LoadSettings
    from gmlx_server.engine.precision import Quantization
    from gmlx_server.engine.registry import ModelRegistry

    from tests.server.conftest import serve

    models = root / "models"
    models.mkdir(exist_ok=True)
    settings = {}
    for name in FOLDERS:
        for variant in VARIANTS:
            link = models / f"{name}-{variant}"
            if not link.exists():
                link.symlink_to(root / name)
            settings[link.name] = {
                "plain": LoadSettings(),
                "q4": LoadSettings(quantization=Quantization(4)),
                "gguf": LoadSettings(dit=root / f"{name}.gguf"),
            }[variant]
    config = replace(ServerConfig(host="127.0.0.1", port=0), model_dirs=[models])
    config = replace(config, image=ImageConfig())
    registry = ModelRegistry([models], None, settings=lambda model_id: settings[model_id])
    live = serve(config, registry)
    try:
        out = {"models": live.call("GET", "models").json()}
        out["capabilities"] = {"answer": live.call("GET", "capabilities").json()}
        for model_id in sorted(settings):
            out[model_id] = answers(live, model_id)
            live.post_json("models/unload", {"model": model_id})
    finally:
        live.close()
    return out


def answers(live, model_id: str) -> dict:
    from gmlx_contract import wire

    def tensors(response) -> dict:
        if response.status_code != 200:
            return {"status": response.status_code, "body": response.text}
        return {k: digest(v) for k, v in wire.read_container(response.content).tensors.items()}

    def arrays(response) -> dict:
        assert response.status_code == 200, response.text
        return wire.read_container(response.content).tensors

    got = {"status_unloaded": live.call("GET", f"models/{model_id}/status").json()}
    got["manifest"] = live.call("GET", f"models/{model_id}/manifest").json()
    load = live.post_json("models/load", {"model": model_id})
    got["load"] = load.status_code
    got["status_loaded"] = live.call("GET", f"models/{model_id}/status").json()
    status = got["status_loaded"]
    family = status.get("family", "")
    conds = []
    for text in TEXTS:
        r = live.post_json("encode", {"model": model_id, "text": text})
        got[f"encode {text!r}"] = tensors(r)
        conds.append(arrays(r)["cond"])
    rng = np.random.default_rng(7)
    image = rng.random((1, 64, 96, 3)).astype(np.float32)
    r = live.post_container("vae/encode", {"image": image}, {"model": model_id})
    got["vae/encode"] = tensors(r)
    latents = arrays(r)["latents"]
    r = live.post_container("vae/decode", {"latents": latents}, {"model": model_id})
    got["vae/decode"] = tensors(r)
    channels = status["latent"]["channels"]
    x = rng.standard_normal((2, channels, 4, 6)).astype(np.float32)
    timestep = np.array([0.8, 0.35], np.float32)
    rows = [{"cond": live.put_tensor(cond)} for cond in conds]
    step = {"x": x, "timestep": timestep}
    if status["sampling"].get("flow_map"):  # a flow-map DiT's step takes the run's schedule
        step["sample_sigmas"] = np.linspace(1.0, 0.0, 5, dtype=np.float32)
    for convention in ("comfy", "reference"):
        fields = {"model": model_id, "rows": rows, "convention": convention}
        r = live.post_container("step", step, fields)
        got[f"step {convention}"] = tensors(r)
    if status.get("edit_capable"):
        got |= reference_answers(live, model_id, family, step, rows, rng, tensors)
    got["step lora"] = lora_step(live, model_id, got["manifest"], step, rows, tensors)
    return got


def reference_answers(live, model_id, family, step, rows, rng, tensors) -> dict:
    import base64
    import io

    from PIL import Image

    png = io.BytesIO()
    side = 256 if family == "qwen_image21" else 64  # each family's smallest reference
    pixels = (rng.random((side, side, 3)) * 255).astype(np.uint8)
    Image.fromarray(pixels).save(png, format="PNG")
    picture = base64.b64encode(png.getvalue()).decode()
    got = {}
    r = live.post_json(
        "encode", {"model": model_id, "text": "the fox", "images": [picture], "refs": True}
    )
    got["encode refs"] = tensors(r)
    if r.status_code != 200:
        return got
    from gmlx_contract import wire

    container = wire.read_container(r.content)
    refs = [k for k in container.tensors if k != "cond"]
    ref_hashes = [live.put_tensor(container.tensors[k]) for k in sorted(refs)]
    cond = live.put_tensor(container.tensors["cond"])
    with_refs = [{**rows[0], "ref_latents": ref_hashes}, {"cond": cond, "ref_latents": ref_hashes}]
    for convention in ("comfy", "reference"):
        run = live.post_json("runs/begin", {"model": model_id}).json()["run"]
        for ref_cache in (False, True) if convention == "comfy" else (False,):
            for repeat in ("miss", "hit"):
                fields = {"model": model_id, "rows": with_refs, "convention": convention}
                fields |= {"run": run, "ref_cache": ref_cache}
                r = live.post_container("step", step, fields)
                name = f"step refs {convention} ref_cache={ref_cache} {repeat}"
                got[name] = tensors(r)
                got[name + " header"] = r.headers.get("X-Gmlx-Prefix-Cache")
        live.post_json(f"runs/{run}/end")
    return got


def lora_step(live, model_id, manifest, step, rows, tensors) -> dict:
    """A table on the first three linear weights of the manifest (one as a band of rows)."""
    from tests.lora.over_http import lora_table, put_table

    matrices = [t for t in manifest["tensors"] if len(t["shape"]) == 2]
    linears = [t for t in matrices if t["name"].endswith(".weight")][:3]
    shapes = {t["name"].removesuffix(".weight"): tuple(t["shape"]) for t in linears}
    bands = {
        layer: [0, 0, shape[0] // 2] if index == 1 else None
        for index, (layer, shape) in enumerate(shapes.items())
    }
    entries, adapters, _ = lora_table(shapes, bands, seed=11, strength=0.7)
    r, table = put_table(live, model_id, entries, adapters)
    if r.status_code != 200:
        return {"status": r.status_code, "body": r.text}
    fields = {"model": model_id, "rows": rows, "patch_table": table}
    return tensors(live.post_container("step", step, fields))


# ------------------------------------------------------------------------------ before/after


def run_dump(tree: Path, root: Path, out: Path) -> None:
    """This script's --dump in a process importing the packages of `tree`."""
    shim = root / f"packages-{tree.name}"
    shim.mkdir(exist_ok=True)
    for name, folder in {**PACKAGES, "tests": "tests", "bench": "bench"}.items():
        if not (shim / name).exists():
            (shim / name).symlink_to(tree / folder)
    env = dict(os.environ)
    script = tree / "bench" / "family_outputs.py"
    if not script.is_file():  # a revision before this script: this one, on its packages
        script = Path(__file__).resolve()
    subprocess.run(
        [
            sys.executable,
            str(script),
            "--dump",
            str(out),
            "--root",
            str(root),
            "--packages",
            str(shim),
        ],
        env=env,
        check=True,
        cwd=tree,
    )


def use_packages(folder: Path) -> None:
    """Import gmlx_server, gmlx_contract, tests and bench from `folder`, not from the editable
    install (whose finder would answer first)."""
    sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in type(f).__module__]
    sys.path.insert(0, str(folder))
    for name in list(sys.modules):
        if name.split(".")[0] in (*PACKAGES, "tests", "bench"):
            del sys.modules[name]


def differences(before, after, path="") -> list[str]:
    if isinstance(before, dict) and isinstance(after, dict):
        found = []
        for key in sorted(set(before) | set(after), key=str):
            if key not in after:
                found.append(f"{path}/{key}: gone")
            elif key not in before:
                found.append(f"{path}/{key}: added {json.dumps(after[key])[:120]}")
            else:
                found += differences(before[key], after[key], f"{path}/{key}")
        return found
    if before != after:
        return [f"{path}: {json.dumps(before)[:120]} -> {json.dumps(after)[:120]}"]
    return []


def check_out(revision: str, where: Path) -> None:
    """A fresh git worktree of `revision` at `where`: one an earlier run left there (`--keep`),
    or whose folder was deleted, is replaced, so the tree compared is the revision asked for."""
    git = ["git", "-C", str(ROOT), "worktree"]
    listed = subprocess.run([*git, "list", "--porcelain"], check=True, capture_output=True)
    if f"worktree {where.resolve()}" in listed.stdout.decode().splitlines():
        subprocess.run([*git, "remove", "--force", str(where)], check=True)
    subprocess.run([*git, "add", "--detach", str(where), revision], check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", help="the revision to compare the working tree with")
    parser.add_argument("--dump", type=Path, help="write this tree's digest here")
    parser.add_argument("--root", type=Path, help="the folders (built here when absent)")
    parser.add_argument("--keep", type=Path, help="keep the folders and digests here")
    parser.add_argument("--packages", type=Path, help="import the packages from here")
    args = parser.parse_args()
    if not (args.against or args.dump):
        parser.error("give --against REV (compare with a revision) or --dump OUT")
    if args.packages:
        use_packages(args.packages)
    if args.dump:
        import gmlx_server

        print(f"dumping the answers of {Path(gmlx_server.__file__).parent}", file=sys.stderr)
        args.dump.write_text(json.dumps(dump(args.root), indent=1, sort_keys=True))
        return 0
    work = Path(args.keep or tempfile.mkdtemp(prefix="family-outputs-"))
    work.mkdir(parents=True, exist_ok=True)
    root = work / "folders"
    if not root.is_dir():
        root.mkdir()
        build_folders(root)
    old = work / "before-tree"
    check_out(args.against, old)
    run_dump(old, root, work / "before.json")
    run_dump(ROOT, root, work / "after.json")
    before = json.loads((work / "before.json").read_text())
    after = json.loads((work / "after.json").read_text())
    found = differences(before, after)
    for line in found:
        print(line)
    answers = sum(len(v) for k, v in after.items() if isinstance(v, dict) and k != "models")
    print(f"{len(found)} differences in {answers} answers; digests in {work}")
    if not args.keep:
        subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, check=False)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
