"""Container bytes built by hand (docs/contract.md §1.3): the 8-byte little-endian header length,
the header, the data. Also the layout of a safetensors file, which the tests damage."""

from __future__ import annotations

import json


def frame(header, data: bytes = b"") -> bytes:
    """A body from a header (object, or raw bytes) and a data section, without padding."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data
