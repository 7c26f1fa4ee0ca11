"""`gmlx image sample` and `gmlx image bench`: sample in process, and time the step routes.

sample   encode the prompt (and references), sample with the in-process sampler, decode, write a
         PNG. With no model named or configured it uses the embedded default model.
bench    time whole images and print the record of docs/contract.md §6 (schema gmlx.image.bench/1).
         With --via-steps it serves the step routes on an ephemeral 127.0.0.1 port of its own
         process and drives them with the shared StepClient, one request per step; the last
         timed run's latents are compared with a direct run's (`equal_to_direct`).

Both commands call the same `denoise_step` through `gmlx_server.engine.sampling`, so a sample
and a bench at the same seed reach the same latents bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import __version__
from .config import ImageConfig
from .engine.sampling import (
    SAMPLERS,
    DirectTransport,
    ImageRequest,
    ImageTimings,
    SettingError,
    check_request,
    flow_map_schedule,
    generate,
    to_uint8,
)
from .imagefiles import mask_of, read_image_file
from .kernel_compiles import CompileWatch
from .lora_files import AdapterSpec, adapter_doc, adapter_spec, sampling_table
from .memory import MemoryPlanner, PlannedTransport
from .parsers import (
    CommandParser,
    add_group_arguments,
    add_model_arguments,
    flag_name,
    model_flags,
)
from .process import config_registry, prepare_process

SCHEMA = "gmlx.image.bench/1"
EXIT_USAGE = 2


# ---------------------------------------------------------------- choosing and loading a model


@dataclass
class ModelChoice:
    """A registry that knows the chosen model, and the chosen model's id."""

    registry: Any
    model_id: str
    prepare_s: float  # finding the folder (and generating the embedded default on first use)
    image: ImageConfig = field(default_factory=ImageConfig)  # the memory plan's settings
    group: Any = None  # the rank group the model loads over (server/distributed.py), or None

    def check(self, request: ImageRequest) -> None:
        """Refuse, before the model loads, what its status from the files says it cannot take
        (sampling.check_request: size, pixel limits, steps, sampler)."""
        status = self.registry.describe(self.model_id)
        if status is not None:
            check_request(status, request)

    def join(self, group: Any) -> None:
        """Load the model over a rank group from now on (None: in this process alone)."""
        if group is not None:
            from .distributed import attach

            attach(group, self.registry)
            self.group = group


def choose_model(
    model: str | None,
    config_path: Path | None = None,
    flags: dict | None = None,
) -> ModelChoice:
    """A folder (holding model_index.json), a model id of the configuration, or, with neither,
    the configured default model or else the embedded default; loaded with its model entry's
    settings and `flags` over them (a model entry's table from the command's flags:
    parsers.model_flags)."""
    from .config import load_config, model_settings_over
    from .engine.registry import MODEL_INDEX, ModelRegistry

    started = time.perf_counter()
    flags = flags or {}
    config = load_config(config_path)
    if model and (Path(model).expanduser() / MODEL_INDEX).is_file():
        folder = Path(model).expanduser().resolve()
        settings = model_settings_over(None, flags, Path.cwd(), flag_name).load_settings()
        registry = ModelRegistry(
            extra_models=[folder],
            default_model=folder.name,
            settings=lambda _model_id: settings,
        )
        return ModelChoice(registry, folder.name, time.perf_counter() - started, config.image)
    if model is None and "vae" in flags:  # --dit, --text-encoder and --vae: component files
        settings = model_settings_over(None, flags, Path.cwd(), flag_name)
        files = settings.component_files()
        model = " + ".join(Path(p).stem for p in (files.dit, files.text_encoder, files.vae))
        config.models[model] = settings
    registry, _ = config_registry(config, model)
    if model and model not in registry.folders():
        refused = registry.resolve_refusal(model)
        if refused is not None:
            raise ValueError(refused)
        raise ValueError(unknown_model(model, sorted(registry.folders())))
    model_id = registry.default_model
    if not model_id:
        raise ValueError("no model named, none configured and no embedded default available")
    entry = config.models.get(model_id)
    config.models[model_id] = model_settings_over(entry, flags, Path.cwd(), flag_name)
    return ModelChoice(registry, model_id, time.perf_counter() - started, config.image)


def unknown_model(model: str, known: list[str]) -> str:
    """Why `--model` names nothing this command can load: which folder lacks what, or which ids
    there are."""
    from .engine.registry import MODEL_INDEX

    folder = Path(model).expanduser()
    if folder.is_dir():
        if (folder.parent / MODEL_INDEX).is_file():
            return (
                f"{folder} is the {folder.name!r} part of the model folder {folder.parent}: "
                "name that folder"
            )
        inner = sorted(d.name for d in folder.iterdir() if (d / MODEL_INDEX).is_file())
        if inner:
            return (
                f"{folder} holds model folders ({', '.join(inner)}), not a model: name one of "
                "them, or list this folder in the config's model_dirs"
            )
        return (
            f"{folder} exists but is not a diffusers model folder: it has no {MODEL_INDEX}. A "
            f"model folder holds {MODEL_INDEX} beside one folder per component (transformer/, "
            "text_encoder/, vae/, ...); single checkpoint files are not read"
        )
    ids = ", ".join(known) or "none"
    if folder.exists():
        return f"{folder} is a file, not a model folder (model ids known here: {ids})"
    return f"no model folder {model!r} and no model of that id (model ids known here: {ids})"


@contextmanager
def loading_bar(model_id: str):
    """A progress bar over the two loading stages (folder, weights)."""
    from tqdm import tqdm

    with tqdm(total=2, desc=f"loading {model_id}", unit="stage", leave=False) as bar:
        yield bar


# ---------------------------------------------------------------- gmlx image sample


SAMPLE_HELP = "sample one image in process and write a PNG"
BENCH_HELP = "time whole images in process, or through the step routes (--via-steps)"
IMAGE_HELP = "sample and bench images in process (no server needed)"
BENCH_PROMPT = "a lighthouse on a cliff at dusk, oil painting"


def register(subparsers) -> None:
    """Add `image sample` and `image bench` to the `gmlx` command line (server/cli.py)."""
    image = subparsers.add_parser("image", help=IMAGE_HELP)
    commands = image.add_subparsers(dest="image_command", metavar="COMMAND")
    commands.required = True
    add_sample_arguments(commands.add_parser("sample", help=SAMPLE_HELP))
    add_bench_arguments(commands.add_parser("bench", help=BENCH_HELP))


def sample_parser() -> argparse.ArgumentParser:
    return add_sample_arguments(CommandParser(prog="gmlx image sample", description=SAMPLE_HELP))


def bench_parser() -> argparse.ArgumentParser:
    return add_bench_arguments(CommandParser(prog="gmlx image bench", description=BENCH_HELP))


def add_sample_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--prompt", required=True, help="what to draw")
    add_image_arguments(parser)
    add_adapter_argument(parser)
    parser.add_argument("--out", type=Path, required=True, help="PNG file to write")
    parser.add_argument(
        "--preview",
        type=Path,
        default=None,
        metavar="FILE",
        help="write a preview PNG of the image forming here after every step",
    )
    add_group_arguments(parser)
    parser.add_argument(
        "--via-steps",
        action="store_true",
        help="serve the step routes on a loopback port of this process and sample through them,"
        " one request per step, as a remote client does (the same image, bit for bit)",
    )
    parser.set_defaults(func=run_sample)
    return parser


def add_bench_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--prompt", default=BENCH_PROMPT, help="what to draw")
    add_image_arguments(parser)
    parser.add_argument("--runs", type=int, default=2, help="timed runs")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up runs, not counted")
    parser.add_argument("--label", default=None, help="a label for the record")
    add_adapter_argument(parser, " (refused with --via-steps: docs/contract.md §6)")
    add_group_arguments(parser)
    parser.add_argument(
        "--via-steps",
        action="store_true",
        help="serve the step routes on a loopback port and sample through them",
    )
    parser.add_argument("--json", action="store_true", help="print the JSON record")
    parser.add_argument("--json-out", type=Path, default=None, help="write the JSON record here")
    parser.set_defaults(func=run_bench_command)
    return parser


def add_image_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `sample` and `bench` that describe the image and the model."""
    parser.add_argument("--negative", default=None, help="negative prompt (with --cfg above 1)")
    parser.add_argument(
        "--ref",
        action="append",
        default=[],
        metavar="IMAGE",
        help="reference image for an edit (repeatable)",
    )
    parser.add_argument("--width", type=int, default=1024, help="image width in pixels")
    parser.add_argument("--height", type=int, default=1024, help="image height in pixels")
    parser.add_argument(
        "--steps", type=int, default=None, help="sampling steps (default: the model's own)"
    )
    parser.add_argument(
        "--cfg", type=float, default=None, help="guidance scale (default: the model's own)"
    )
    parser.add_argument("--seed", type=int, default=0, help="noise seed")
    parser.add_argument("--sampler", default="euler", choices=SAMPLERS, help="update rule")
    parser.add_argument(
        "--init-image",
        default=None,
        metavar="IMAGE",
        help="image to image: start from this picture (resized to --width x --height)",
    )
    parser.add_argument(
        "--strength",
        type=float,
        default=1.0,
        help="with --init-image: how much of it is drawn again, above 0 and at most 1 (the"
        " schedule's last strength x steps; ComfyUI's denoise)",
    )
    parser.add_argument(
        "--mask",
        default=None,
        metavar="IMAGE",
        help="with --init-image: inpaint where this mask is white (or, with alpha, transparent)",
    )
    parser.add_argument(
        "--mask-blur",
        type=float,
        default=0.0,
        metavar="PIXELS",
        help="feather the mask's edge by a Gaussian of this radius",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="model id or folder (default: the configured default_model, else the embedded"
        " default model)",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="server TOML config file, for its model_dirs and model entries"
        " (default: the config `gmlx serve` reads)",
    )
    add_model_arguments(parser)


def add_adapter_argument(parser: argparse.ArgumentParser, note: str = "") -> None:
    parser.add_argument(
        "--adapter",
        action="append",
        default=[],
        type=adapter_spec,
        metavar="LORA[:STRENGTH]",
        help="a LoRA safetensors file (diffusers, kohya or ComfyUI keys) at a strength, 1.0 by"
        f" default (repeatable: stacked){note}",
    )


def sample_main(argv: Sequence[str] | None = None) -> int:
    return run_sample(sample_parser().parse_args(argv))


@contextmanager
def rank_group(args: argparse.Namespace):
    """The rank group a command launched by mlx.launch runs over (None: one process); the
    other ranks follow inside (distributed.join) and end with the command."""
    from .distributed import join, stop_group

    group = join(args.shard, args.rank_timeout)
    try:
        yield group
    finally:
        if group is not None:
            stop_group(group)


def run_sample(args: argparse.Namespace) -> int:
    prepare_process()
    with rank_group(args) as group:
        return _sample(args, group)


def _sample(args: argparse.Namespace, group: Any) -> int:
    try:
        request = image_request(args, read_references(args.ref))
        flags = model_flags(args)
    except ValueError as exc:
        print(f"gmlx image sample: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        choice = choose_model(args.model, args.config, flags)
        choice.check(request)
        choice.join(group)
        with CompileWatch(note):
            if args.via_steps:
                pixels, steps = sample_via_steps(choice, request, args.adapter, args.preview)
            else:
                pixels, steps = sample_direct(choice, request, args.adapter, args.preview)
    except Exception as exc:  # noqa: BLE001 - one line for the user, not a traceback
        if os.environ.get("GMLX_DEBUG"):
            raise
        print(f"gmlx image sample: {_message(exc)}", file=sys.stderr)
        return 1
    write_png(pixels, args.out)
    print(
        f"wrote {args.out} ({request.width}x{request.height}, {steps} steps, "
        f"seed {request.seed}, model {choice.model_id}{', via the step routes' if args.via_steps else ''})"
    )
    return 0


def sample_direct(
    choice: ModelChoice,
    request: ImageRequest,
    adapters: Sequence[AdapterSpec] = (),
    preview: Path | None = None,
) -> tuple[np.ndarray, int]:
    """Load the model and sample in process, with a progress bar (and a preview file)."""
    with loading_bar(choice.model_id) as bar:
        bar.update()
        loaded = choice.registry.acquire(choice.model_id)
        bar.update()
    memory = MemoryPlanner(choice.registry, [], choice.image)
    transport = PlannedTransport(loaded, memory, table=sampling_table(loaded, adapters))
    status = loaded.model.status()
    transport.check_image(status, request)
    previews = preview_writer(transport, request, preview)
    latents, timings = generate(transport, status, request, progress=True, on_denoised=previews)
    return transport.decode(latents), len(timings.step_s)


def preview_writer(transport: Any, request: ImageRequest, path: Path | None):
    """`generate`'s `on_denoised` that writes each step's preview to `path` (None: no previews),
    whole files only (written beside it, then renamed over it)."""
    if path is None:
        return None
    from .engine.previews import preview_for

    def write(step: int, denoised: np.ndarray) -> None:
        fitted = preview_for(transport.model, transport.encode_image)
        partial = path.with_name(f".{path.name}.partial")
        write_png(fitted.picture(denoised, request.width, request.height), partial)
        os.replace(partial, path)

    return write


def note(text: str) -> None:
    """A line for the user on stderr, above any progress bar."""
    from tqdm import tqdm

    tqdm.write(text, file=sys.stderr)


def sample_via_steps(
    choice: ModelChoice,
    request: ImageRequest,
    adapters: Sequence[AdapterSpec] = (),
    preview: Path | None = None,
) -> tuple[np.ndarray, int]:
    """Serve the model's step routes on a loopback port and sample through them with the shared
    step client: the prompt is encoded in process and uploaded by hash, each step is a request;
    LoRA files become adapters and a patch table, defined as a client defines them."""
    from gmlx_contract.client import StepClient

    with StepServer(choice) as server:
        with loading_bar(choice.model_id) as bar:
            bar.update()
            loaded = server.load()
            bar.update()
        direct = server.direct()
        with StepClient(server.base_url) as client:
            table = None
            if adapters:
                doc, matrices = adapter_doc(
                    choice.model_id, loaded.model.manifest(), list(adapters), float32=True
                )
                arrays = {digest: tensor.array for digest, tensor in matrices.items()}
                table = client.put_patch_table(doc, choice.model_id, arrays)
            transport = ViaStepsTransport(client, direct, choice.model_id, table)
            previews = preview_writer(direct, request, preview)
            latents, timings = generate(
                transport, loaded.model.status(), request, progress=True, on_denoised=previews
            )
        return direct.decode(latents), len(timings.step_s)


def read_references(paths: Sequence[str]) -> tuple[np.ndarray, ...]:
    """The `--ref` images; a ValueError naming the flag and the file that failed."""
    return tuple(read_flag_image("--ref", path) for path in paths)


def read_flag_image(flag: str, path: str | None) -> np.ndarray | None:
    """The image a flag names (None: not given); a ValueError naming the flag and the file."""
    if path is None:
        return None
    try:
        return read_image_file(path)
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot be read: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"{flag} {path}: {exc}") from None


def image_request(args: argparse.Namespace, images: tuple[np.ndarray, ...]) -> ImageRequest:
    """The request that `sample` and `bench` arguments describe, with the reference `images`;
    a ValueError naming the flag of an init image or mask that cannot be read."""
    mask = read_flag_image("--mask", args.mask)
    return ImageRequest(
        prompt=args.prompt,
        negative=args.negative,
        images=images,
        width=args.width,
        height=args.height,
        steps=args.steps,
        cfg=args.cfg,
        seed=args.seed,
        sampler=args.sampler,
        init_image=read_flag_image("--init-image", args.init_image),
        strength=args.strength,
        mask=None if mask is None else mask_of(mask),
        mask_blur=args.mask_blur,
    )


def _message(exc: Exception) -> str:
    if isinstance(exc, SettingError):  # named by its flag: --steps, --width, --mask-blur
        return exc.naming(flag_name(exc.setting))
    body = getattr(exc, "body", None)
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return body["error"]
    return str(exc) or type(exc).__name__


def write_png(pixels: np.ndarray, path: Path) -> None:
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(to_uint8(pixels)).save(path, format="PNG")


# ---------------------------------------------------------------- the step server


class StepServer:
    """The server `gmlx serve` runs (registry, worker, service, step routes, http_gate's
    request-head gate) for one model, on an ephemeral 127.0.0.1 port of this process: what
    `gmlx image bench --via-steps` and `gmlx image sample --via-steps` drive."""

    def __init__(self, choice: ModelChoice) -> None:
        from .app import ServerThread, build_context, create_app, make_server
        from .config import ServerConfig

        self.choice = choice
        self.config = ServerConfig(
            host="127.0.0.1", port=0, default_model=choice.model_id, image=choice.image
        )
        self.ctx = build_context(self.config, choice.registry, choice.group)
        self.http = ServerThread(make_server(create_app(self.ctx), self.config))
        self.loaded = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http.port}"

    @property
    def service(self):
        return self.ctx.service

    def __enter__(self) -> StepServer:
        self.http.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.loaded is not None:
            self.service.release(self.loaded)
        self.http.stop()
        self.service.close()

    def load(self):
        """Load (and hold) the model on the worker: the loaded instance the routes use."""
        self.loaded = self.service.acquire(self.choice.model_id)
        return self.loaded

    def direct(self, table: Any = None) -> PlannedTransport:
        """The in-process transport on the same loaded model, through the same worker and memory
        plan (under patch table `table`, None for the plain model)."""
        return PlannedTransport(
            self.loaded, self.service.memory, call=self.service.worker.call, table=table
        )


class ViaStepsTransport:
    """Sampling through the step routes (docs/contract.md §6): encode and decode in process, the
    conditionings uploaded by hash (HEAD, then PUT), rows `{"cond": hash, "num_tokens": L}`,
    a run, one step request per step under convention `reference` (naming `patch_table`, a
    table the client defined, or none)."""

    convention = "reference"

    def __init__(
        self, client: Any, direct: DirectTransport, model_id: str, patch_table: str | None = None
    ) -> None:
        self.client = client
        self.direct = direct
        self.model_id = model_id
        self.patch_table = patch_table
        self.run: str | None = None
        self.sample_sigmas: np.ndarray | None = None
        self.transport_ms: list[float] = []  # wall - forward per step request
        self.server_ms: list[float] = []  # X-Gmlx-Server-Ms - forward: the route's own part
        self.uploads: dict[str, np.ndarray] = {}

    def encode(self, text: str, images: Sequence[np.ndarray]):
        return self.direct.encode(text, images)

    def encode_image(self, pixels: np.ndarray) -> np.ndarray:
        return self.direct.encode_image(pixels)

    def row(self, encoding) -> dict:
        cond = np.ascontiguousarray(encoding.cond, dtype=np.float32)
        row: dict[str, Any] = {"cond": self._upload(cond), "num_tokens": int(cond.shape[-2])}
        if encoding.ref_latents:
            refs = [np.ascontiguousarray(r, dtype=np.float32) for r in encoding.ref_latents]
            row["ref_latents"] = [self._upload(r) for r in refs]
            row["image_slots"] = list(encoding.image_slots[: len(refs)])
        return row

    def _upload(self, array: np.ndarray) -> str:
        from gmlx_contract.hashing import tensor_hash

        digest = tensor_hash(array)
        self.uploads[digest] = array
        if not self.client.has_tensor(digest):
            self.client.put_tensor(array)
        return digest

    def begin(self, sigmas: np.ndarray) -> None:
        self.run = self.client.begin_run(self.model_id)
        self.sample_sigmas = flow_map_schedule(self.direct.model, sigmas)

    def step(
        self, x: np.ndarray, timestep: np.ndarray, rows: Sequence[Any], skip: Sequence[int] = ()
    ) -> np.ndarray:
        answer = self.client.step(
            x,
            timestep,
            list(rows),
            model=self.model_id,
            run=self.run,
            convention=self.convention,
            patch_table=self.patch_table,
            skip=list(skip) or None,
            uploads=self.uploads,
            sample_sigmas=self.sample_sigmas,
        )
        forward = answer.forward_ms or 0.0
        self.transport_ms.append(answer.wall_ms - forward)
        self.server_ms.append((answer.server_ms or forward) - forward)
        return answer.out

    def end(self) -> None:
        if self.run is not None:
            self.client.end_run(self.run)
            self.run = None

    def decode(self, latents: np.ndarray) -> np.ndarray:
        return self.direct.decode(latents)


# ---------------------------------------------------------------- gmlx image bench


def bench_main(argv: Sequence[str] | None = None) -> int:
    return run_bench_command(bench_parser().parse_args(argv))


def run_bench_command(args: argparse.Namespace) -> int:
    if args.via_steps and (args.ref or args.adapter):
        print("gmlx image bench: --ref and --adapter are refused with --via-steps", file=sys.stderr)
        return EXIT_USAGE
    if args.runs < 1 or args.warmup < 0:
        print("gmlx image bench: --runs must be at least 1, --warmup at least 0", file=sys.stderr)
        return EXIT_USAGE
    prepare_process()
    with rank_group(args) as group:
        return _bench(args, group)


def _bench(args: argparse.Namespace, group: Any) -> int:
    try:
        request = image_request(args, read_references(args.ref))
        flags = model_flags(args)
    except ValueError as exc:
        print(f"gmlx image bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        choice = choose_model(args.model, args.config, flags)
        choice.check(request)
        choice.join(group)
        with CompileWatch(note):
            record = run_bench(
                choice, request, args.runs, args.warmup, args.via_steps, args.label, args.adapter
            )
    except Exception as exc:  # noqa: BLE001 - one line for the user, not a traceback
        if os.environ.get("GMLX_DEBUG"):
            raise
        print(f"gmlx image bench: {_message(exc)}", file=sys.stderr)
        return 1
    text = json.dumps(record, indent=2)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(text + "\n")
    if args.json:
        print(text)
    else:
        print(summary_text(record))
    return 0


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
    return bench_record(
        choice, loaded, status, request, timed, load_s, via_steps, equal, label, adapters
    )


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
    choice: ModelChoice,
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
    return {"chip": chip_name(), "ram_bytes": ram_bytes(), "os": platform.platform()}


def chip_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


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


def main(argv: Sequence[str] | None = None) -> int:
    """`gmlx image sample ...` / `gmlx image bench ...` when run as a module."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"sample": sample_main, "bench": bench_main}
    if not argv or argv[0] not in commands:
        print("usage: gmlx image {sample,bench} ...", file=sys.stderr)
        return EXIT_USAGE
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
