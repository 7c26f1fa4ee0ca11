"""`gmlx image sample` and `gmlx image bench`: sample in process, and time the step routes.

sample   encode the prompt (and references), sample with the in-process sampler, decode, write a
         PNG. With no model named or configured it uses the embedded default model.
bench    time whole images and print the record of docs/contract.md §6 (image_bench.py).

With --via-steps either serves the step routes on an ephemeral 127.0.0.1 port of its own process
and drives them with the shared StepClient, one request per step (step_server.py), as a remote
client does; the bench compares its last timed run's latents with a direct run's.

Both commands call the same `denoise_step` through `gmlx_server.engine.sampling`, so a sample
and a bench at the same seed reach the same latents bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from .config import ConfigError, unwritable_folder
from .engine.sampling import (
    SAMPLERS,
    ImageRequest,
    SettingError,
    check_image_start,
    generate,
    to_uint8,
)
from .image_bench import run_bench, summary_text
from .imagefiles import encode_picture, file_format, mask_of, read_image_file
from .kernel_compiles import CompileWatch
from .lora_files import AdapterSpec, adapter_doc, adapter_spec, sampling_table
from .memory import MemoryPlanner, PlannedTransport
from .model_choice import ModelChoice, choose_model, loading_bar
from .parsers import (
    CommandParser,
    add_group_arguments,
    add_model_arguments,
    file_to_write,
    flag_name,
    model_flags,
)
from .process import prepared_for
from .step_server import StepServer, ViaStepsTransport

EXIT_USAGE = 2


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
    parser.add_argument(
        "--out",
        type=file_to_write,
        required=True,
        help="the image to write: a .png, .jpg or .webp file",
    )
    parser.add_argument(
        "--preview",
        type=file_to_write,
        default=None,
        metavar="FILE",
        help="write a preview of the image forming here after every step (.png, .jpg, .webp)",
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
    parser.add_argument(
        "--json-out", type=file_to_write, default=None, help="write the JSON record here"
    )
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
    pictures = ((args.out, "--out", True), (args.preview, "--preview", True))
    return run_image_command(args, "sample", pictures, _sample)


def run_image_command(args: argparse.Namespace, command: str, outputs: tuple, work) -> int:
    """`work(args, group)` in a prepared process, over the rank group the arguments name, once
    the command's `outputs` (each its path, flag and whether it is a picture) are known to be
    writable (else exit 2)."""
    for path, flag, picture in outputs:
        refused = output_refusal(path, flag, picture)
        if refused:
            print(f"gmlx image {command}: {refused}", file=sys.stderr)
            return EXIT_USAGE
    if not prepared_for(f"image {command}"):
        return EXIT_USAGE
    with rank_group(args) as group:
        return work(args, group)


def _sample(args: argparse.Namespace, group: Any) -> int:
    def run(choice: ModelChoice, request: ImageRequest) -> tuple[np.ndarray, int]:
        return sample(choice, request, args.adapter, args.preview, args.via_steps)

    done = chosen_run(args, group, "sample", run)
    if isinstance(done, int):
        return done
    choice, request, (pixels, steps) = done
    refused = write_refusal(args.out, lambda: write_picture(pixels, args.out))
    if refused:
        print(f"gmlx image sample: {refused}", file=sys.stderr)
        return 1
    print(
        f"wrote {args.out} ({request.width}x{request.height}, {steps} steps, "
        f"seed {request.seed}, model {choice.model_id}{', via the step routes' if args.via_steps else ''})"
    )
    return 0


def chosen_run(args: argparse.Namespace, group: Any, command: str, run) -> int | tuple:
    """`run(choice, request)` on the model and request the command's arguments name, over the
    rank group `group`: (the choice, the request, what `run` gave), or the exit code of a
    refusal, printed on one line (2: the arguments or the configuration, as `gmlx serve`'s;
    1: the model or the run)."""
    try:
        request = image_request(args, read_references(args.ref))
        check_image_start(request)  # the image to image flags, whatever the model
        flags = model_flags(args)
    except ValueError as exc:
        print(f"gmlx image {command}: {_message(exc, args.ref)}", file=sys.stderr)
        return EXIT_USAGE
    try:
        choice = choose_model(args.model, args.config, flags)
        choice.check(request)
        choice.join(group)
        with CompileWatch(note):
            return choice, request, run(choice, request)
    except ConfigError as exc:
        print(f"gmlx image {command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # noqa: BLE001 - one line for the user, not a traceback
        if os.environ.get("GMLX_DEBUG"):
            raise
        print(f"gmlx image {command}: {_message(exc, args.ref)}{files_note(args)}", file=sys.stderr)
        return 1


def sample(
    choice: ModelChoice,
    request: ImageRequest,
    adapters: Sequence[AdapterSpec] = (),
    preview: Path | None = None,
    via_steps: bool = False,
) -> tuple[np.ndarray, int]:
    """Load the model and sample with a progress bar (and a preview file): in process, or
    `via_steps`, through the model's step routes served on a loopback port (`steps_transport`).
    Returns the image and its step count."""
    if via_steps:
        transports = steps_transport(choice, adapters)
    else:
        transports = direct_transport(choice, request, adapters)
    with transports as (transport, direct, status):
        previews = preview_writer(direct, request, preview)
        latents, timings = generate(transport, status, request, progress=True, on_denoised=previews)
        return direct.decode(latents), len(timings.step_s)


@contextmanager
def direct_transport(choice: ModelChoice, request: ImageRequest, adapters: Sequence[AdapterSpec]):
    """(transport, its in-process half, the model's status) of a model loaded in process under
    the memory plan, the `request`'s image checked against it first."""
    with loading_bar(choice.model_id) as bar:
        bar.update()
        loaded = choice.registry.acquire(choice.model_id)
        bar.update()
    memory = MemoryPlanner(choice.registry, [], choice.image)
    transport = PlannedTransport(loaded, memory, table=sampling_table(loaded, adapters))
    status = loaded.model.status()
    transport.check_image(status, request)
    yield transport, transport, status


@contextmanager
def steps_transport(choice: ModelChoice, adapters: Sequence[AdapterSpec]):
    """(transport, its in-process half, the model's status) through the step routes, served on a
    loopback port for the while, with the shared step client: the prompt is encoded in process
    and uploaded by hash, each step is a request; LoRA files become adapters and a patch table,
    defined as a client defines them."""
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
            yield transport, direct, loaded.model.status()


def preview_writer(transport: Any, request: ImageRequest, path: Path | None):
    """`generate`'s `on_denoised` that writes each step's preview to `path` (None: no previews),
    whole files only (written beside it, then renamed over it)."""
    if path is None:
        return None
    from .engine.previews import preview_for

    def write(step: int, denoised: np.ndarray) -> None:
        fitted = preview_for(transport.model, transport.encode_image)
        partial = path.with_name(f".{path.name}.partial")
        picture = fitted.picture(denoised, request.width, request.height)
        write_picture(picture, partial, file_format(path))
        os.replace(partial, path)

    return write


def note(text: str) -> None:
    """A line for the user on stderr, above any progress bar."""
    from tqdm import tqdm

    tqdm.write(text, file=sys.stderr)


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


def files_note(args: argparse.Namespace) -> str:
    """What `--dit` or `--text-encoder` did, for a failed run given one without `--vae` and
    `--model`: they stood for the default model's own files."""
    if args.model is None and args.vae is None and (args.dit or args.text_encoder):
        return (
            " (--dit and --text-encoder without --vae replace the default model's own files; a"
            " model from component files takes --dit, --text-encoder and --vae)"
        )
    return ""


def _message(exc: Exception, references: Sequence[str]) -> str:
    """One line for a failure; a refused reference image named by its `--ref` file."""
    if isinstance(exc, SettingError):  # named by its flag: --steps, --width, --mask-blur
        said = exc.naming(flag_name(exc.setting))
        if exc.setting == "ref" and exc.index is not None:
            return f"--ref {references[exc.index]}: {said}"
        return said
    body = getattr(exc, "body", None)
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return body["error"]
    return str(exc) or type(exc).__name__


def output_refusal(path: Path | None, flag: str, picture: bool = False) -> str | None:
    """Why `path` cannot take a command's output, told before any work (None: it may): a
    folder, a place under a file or where this user may not write, or for a `picture` a name
    whose suffix is no format's it is written in (imagefiles.FILE_SUFFIXES)."""
    if path is None:
        return None
    if path.is_dir():
        return f"{flag} {str(path)!r} is a folder; name a file"
    if picture and file_format(path) is None:
        return f"{flag} {path}: name a .png, .jpg or .webp file (the suffix says the format)"
    refused = unwritable_folder(path.parent)
    return f"{flag} {path}: {refused}" if refused else None


def write_refusal(path: Path, write) -> str | None:
    """Why `write()` could not write the command's output to `path` (None: it wrote it): the
    work is done, the answer lost, said in one line rather than a traceback."""
    try:
        write()
    except OSError as exc:
        return f"cannot write {path}: {exc.strerror or exc}"
    return None


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def write_picture(pixels: np.ndarray, path: Path, output_format: str | None = None) -> None:
    """Pixels written to `path` in `output_format`, else the format its suffix says."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_picture(to_uint8(pixels), output_format or file_format(path)))


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
    return run_image_command(args, "bench", ((args.json_out, "--json-out", False),), _bench)


def _bench(args: argparse.Namespace, group: Any) -> int:
    def bench(choice: ModelChoice, request: ImageRequest) -> dict:
        return run_bench(
            choice, request, args.runs, args.warmup, args.via_steps, args.label, args.adapter
        )

    done = chosen_run(args, group, "bench", bench)
    if isinstance(done, int):
        return done
    record = done[2]
    text = json.dumps(record, indent=2)
    refused = args.json_out and write_refusal(
        args.json_out, lambda: write_text(args.json_out, text)
    )
    if refused:
        print(f"gmlx image bench: {refused}", file=sys.stderr)
        return 1
    if args.json:
        print(text)
    else:
        print(summary_text(record))
    return 0


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
