"""The argument parser of every `gmlx` command (cli.py and the commands it delegates to): its
help shows each option's default, and a subcommand added with only `help=` gets that text as its
description too."""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from .engine.precision import (
    BITS,
    DEFAULT_GROUP_SIZE,
    ENCODER_VAE_DTYPES,
    GROUP_SIZES,
    Quantization,
)


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
    of its parent's class). A command's parser names a mistyped option with the nearest one it
    takes: among its leftovers (which then stop it, as `parse_args` would), or in the error it
    stops at (a required option that the mistyped one was meant to be). A parser of
    subcommands leaves that to them."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", Subcommands)
        self._given: list[str] = []
        self._commands = False

    def add_subparsers(self, **kwargs):
        self._commands = True
        return super().add_subparsers(**kwargs)

    def parse_known_args(self, args=None, namespace=None):
        self._given = list(sys.argv[1:] if args is None else args)
        parsed, extras = super().parse_known_args(args, namespace)
        if self._misspelt(extras):
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras

    def error(self, message: str):
        hints = [
            f"{given} is no option here: did you mean {near}?"
            for given, near in self._misspelt(self._given)
        ]
        super().error("; ".join([message, *hints]))

    def _misspelt(self, tokens: list[str]) -> list[tuple[str, str]]:
        """(token, the nearest option) for each of `tokens` that is an option this command does
        not take, not even abbreviated, but is near one it does."""
        if self._commands:
            return []
        known = [name for name in self._option_string_actions if name.startswith("--")]
        found = []
        for token in tokens:
            given = token.split("=", 1)[0]
            if not given.startswith("--") or any(name.startswith(given) for name in known):
                continue
            near = difflib.get_close_matches(given, known, n=1, cutoff=0.75)
            if near:
                found.append((given, near[0]))
        return found


def file_to_write(text: str) -> Path:
    """The argparse type of an option naming a file a command writes: an empty one is refused
    (Path would read it as the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; name a file")
    return Path(text)


def folder_to_write(text: str) -> Path:
    """The argparse type of an option naming a folder a command writes into: an empty one is
    refused (Path would read it as the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; name a folder")
    return Path(text)


# The argparse form of a model entry's keys whose value is not a file (config.MODEL_SETTINGS).
FLAG_FORMS = {
    "quantize": {"type": int, "choices": BITS, "metavar": "BITS"},
    "group_size": {"type": int, "choices": GROUP_SIZES},
    "encoder_vae_dtype": {"choices": ENCODER_VAE_DTYPES},
    "family": {"metavar": "FAMILY"},
    "variant": {"metavar": "VARIANT"},
    "tokenizer": {"metavar": "FOLDER"},
}
# A model entry's keys a command takes otherwise (its `--adapter`, repeatable, the sampling's) or
# not at all (the upsampler rewrites the encode route's prompts).
NOT_FLAGS = ("adapters", "prompt_upsampler", "prompt_upsampling")


def flag_name(key: str) -> str:
    """The flag of a model entry's key: `--text-encoder` for `text_encoder`."""
    return "--" + key.replace("_", "-")


def add_quantize_arguments(parser: argparse.ArgumentParser) -> None:
    """`--quantize BITS` and `--group-size N` of `gmlx serve`: the precision every model loads
    at (engine/quantize.py), over the model entries' own; read back with
    `quantization_argument`."""
    from .config import MODEL_SETTINGS

    for key in ("quantize", "group_size"):
        parser.add_argument(
            flag_name(key),
            default=None,
            help=f"{MODEL_SETTINGS[key]}; every model's, over the model entries' own {key}",
            **FLAG_FORMS[key],
        )


def quantization_argument(args: argparse.Namespace) -> Quantization | None:
    """The Quantization that `--quantize` and `--group-size` name (None without --quantize); a
    ValueError for --group-size alone."""
    if args.quantize is None:
        if args.group_size is not None:
            raise ValueError("--group-size needs --quantize")
        return None
    return Quantization(args.quantize, args.group_size or DEFAULT_GROUP_SIZE)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """A model entry's settings (config.MODEL_SETTINGS) as flags of a command that loads a
    model: `--quantize`, `--group-size`, `--encoder-vae-dtype`, `--dit`, `--text-encoder`,
    `--mmproj`, each over the entry's own; read back with `model_flags`."""
    from .config import MODEL_SETTINGS

    for key, description in MODEL_SETTINGS.items():
        if key in NOT_FLAGS:
            continue
        parser.add_argument(
            flag_name(key),
            default=None,
            help=f"{description}; over the model entry's own {key}",
            **FLAG_FORMS.get(key, {"metavar": "FILE"}),
        )


def model_flags(args: argparse.Namespace) -> dict:
    """The model entry settings the flags of `add_model_arguments` give, as a model entry's
    table (only those given); a ConfigError (a ValueError) naming the flag for a value the
    configuration would refuse (config.model_settings: a file that is not an existing .gguf,
    --group-size without --quantize)."""
    from .config import MODEL_SETTINGS, model_settings

    table = {
        key: getattr(args, key)
        for key in MODEL_SETTINGS
        if key not in NOT_FLAGS and getattr(args, key) is not None
    }
    model_settings(table, Path.cwd(), name=flag_name)
    return table


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
