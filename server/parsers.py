"""The argument parser of every `gmlx` command (cli.py and the commands it delegates to): its
help shows each option's default, and a subcommand added with only `help=` gets that text as its
description too."""

from __future__ import annotations

import argparse


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
