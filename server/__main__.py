"""`python -m gmlx_server`: the `gmlx` command line."""

import sys

from .cli import main

sys.exit(main())
