"""`python -m gmlx_server`: the `gmlx` command line."""

from .cli import entry

entry()
