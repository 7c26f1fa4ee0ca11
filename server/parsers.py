"""The argument parser of every `gmlx` command (cli.py and the commands it delegates to): its
help shows each option's default, and a subcommand added with only `help=` gets that text as its
description too."""

from __future__ import annotations

import argparse

from .engine.precision import BITS, DEFAULT_GROUP_SIZE, GROUP_SIZES, Quantization


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's help with each option's default, except where there is none to show (None, a
    flag's False, an empty list): there the help text says what happens."""

    def _get_help_string(self, action: argparse.Action) -> str:
        default = action.default
        if default is None or default is False or (isinstance(default, list) and not default):
            return action.help or ""
        return super()._get_help_string(action)


class Subcommands(argparse._SubParsersAction):
    """Subcommands whose description defaults to their one-line help."""

    def add_parser(self, name: str, **kwargs):
        if "help" in kwargs:
            kwargs.setdefault("description", kwargs["help"])
        return super().add_parser(name, **kwargs)


class CommandParser(argparse.ArgumentParser):
    """The parser of `gmlx` and of each of its subcommands (argparse makes a subcommand's parser
    of its parent's class)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", Subcommands)


def add_quantize_arguments(parser: argparse.ArgumentParser) -> None:
    """`--quantize BITS` and `--group-size N`: the precision models load at (engine/quantize.py),
    over the configuration's model entries; read back with `quantization_argument`."""
    parser.add_argument(
        "--quantize",
        type=int,
        choices=BITS,
        default=None,
        metavar="BITS",
        help="quantize the DiT's and the text encoder's linear layers to this many bits as they"
        f" load ({', '.join(map(str, BITS))}; over the model entries' own `quantize`)",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        choices=GROUP_SIZES,
        default=None,
        help=f"with --quantize: weights per scale and bias (default {DEFAULT_GROUP_SIZE})",
    )


def quantization_argument(args: argparse.Namespace) -> Quantization | None:
    """The Quantization that `--quantize` and `--group-size` name (None without --quantize); a
    ValueError for --group-size alone."""
    if args.quantize is None:
        if args.group_size is not None:
            raise ValueError("--group-size needs --quantize")
        return None
    return Quantization(args.quantize, args.group_size or DEFAULT_GROUP_SIZE)


def add_group_arguments(parser) -> None:
    """How a command launched as ranks of a group (mlx.launch) shards the DiT."""
    from .distributed import RANK_TIMEOUT_S
    from .engine.shard_plan import MODES

    parser.add_argument(
        "--shard",
        choices=MODES,
        default="pipeline",
        help="launched as a rank group: contiguous blocks per rank (pipeline) or every block"
        " split over the ranks (tensor); see docs/server.md",
    )
    parser.add_argument(
        "--rank-timeout",
        type=float,
        default=RANK_TIMEOUT_S,
        help="seconds a step may take over the rank group while every rank is heard",
    )
