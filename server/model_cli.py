"""`gmlx model quantize SOURCE DESTINATION --bits N [--group-size N]`: write a copy of a model
folder (SOURCE: the folder, or a model id of the configuration, as `gmlx image sample --model`
takes it) whose DiT and text encoder hold quantized weights (the layers the family quantizes at
load: engine/quantize.py), in safetensors as MLX stores them (`X.weight` packed, `X.scales`,
`X.biases`) with the `quantization` in each component's config.json. The copy loads directly,
never through float weights (engine/weights.py). `--kquant PRESET` instead writes the DiT as one
GGUF file of llama.cpp's K-quants (engine/kquant_folder.py, through mlx-kquant)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .config import ConfigError, check_writable_folder
from .engine.load_settings import KQUANT_PRESETS
from .engine.precision import BITS, DEFAULT_GROUP_SIZE, GROUP_SIZES, Quantization
from .parsers import folder_to_write
from .process import prepared_for

QUANTIZE_HELP = "write a copy of a model folder with quantized weights, to load directly"


def register(subparsers) -> None:
    model = subparsers.add_parser("model", help="model folder commands")
    commands = model.add_subparsers(dest="model_command", metavar="COMMAND")
    commands.required = True
    parser = commands.add_parser("quantize", help=QUANTIZE_HELP)
    parser.add_argument(
        "source", help="a model folder (holding model_index.json) or a model id of the config"
    )
    parser.add_argument(
        "destination", type=folder_to_write, help="the folder to write (must not exist)"
    )
    precision = parser.add_mutually_exclusive_group(required=True)
    precision.add_argument("--bits", type=int, choices=BITS, help="bits per weight (MLX affine)")
    precision.add_argument(
        "--kquant",
        choices=KQUANT_PRESETS,
        help="the DiT as one GGUF file of llama.cpp's K-quant preset (needs mlx-kquant)",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        choices=GROUP_SIZES,
        default=DEFAULT_GROUP_SIZE,
        help="weights per scale and bias",
    )
    parser.add_argument(
        "--config", type=Path, default=None, help="config file (the default one when left out)"
    )
    parser.set_defaults(func=run_quantize)


def run_quantize(args: argparse.Namespace) -> int:
    try:  # the new folder: before any work
        if args.destination.exists():
            raise ConfigError(f"{args.destination} exists; name a new folder")
        check_writable_folder(args.destination, "destination")
    except ConfigError as exc:
        print(f"gmlx model quantize: {exc}", file=sys.stderr)
        return 2
    if not prepared_for("model quantize"):  # before mlx is imported
        return 2
    from .engine.registry import ModelRegistry
    from .engine.weights import quantize_folder, quantized_already
    from .model_choice import choose_model

    try:
        choice = choose_model(args.source, args.config)
    except ValueError as exc:  # a ConfigError, or no such folder or model id
        print(f"gmlx model quantize: {exc}", file=sys.stderr)
        return 2
    source = choice.registry.folders()[choice.model_id]
    registry = ModelRegistry(extra_models=[source])
    entry = registry.entries()[0]
    family = registry.family(entry.family) if entry.family else None
    choice_of = family.quantized_files(source) if family is not None else None
    if choice_of is None:
        what = f"family {entry.family}" if entry.family else "no family this server has"
        print(
            f"gmlx model quantize: {source} is of {what}, which writes no quantized folder",
            file=sys.stderr,
        )
        return 1
    try:  # --kquant re-encodes the DiT alone; the other components are copied as they are
        refused = quantized_already(source, ["transformer"] if args.kquant else choice_of)
    except (OSError, ValueError, KeyError, TypeError) as exc:  # a config that cannot be read
        print(f"gmlx model quantize: {source}: {exc}", file=sys.stderr)
        return 1
    if refused:
        print(f"gmlx model quantize: {refused}", file=sys.stderr)
        return 2
    if args.kquant:
        return write_kquant(source, args.destination, args.kquant, choice_of["transformer"])
    quantization = Quantization(args.bits, args.group_size)
    try:
        quantize_folder(source, args.destination, quantization, choice_of)
    except (OSError, ValueError) as exc:
        print(f"gmlx model quantize: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.destination} ({args.bits}-bit, groups of {args.group_size})")
    return 0


def write_kquant(source: Path, destination: Path, preset: str, include) -> int:
    from .engine.kquant_folder import write_kquant_folder

    try:
        counts = write_kquant_folder(source, destination, preset, include)
    except RuntimeError as exc:  # mlx-kquant is not installed
        print(f"gmlx model quantize: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"gmlx model quantize: {exc}", file=sys.stderr)
        return 1
    types = ", ".join(f"{count} {kind}" for kind, count in counts.items())
    print(f"wrote {destination} (its DiT as {preset}: {types}; text encoder and VAE as they were)")
    return 0
