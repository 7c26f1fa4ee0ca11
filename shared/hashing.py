"""Content addresses of the step contract: tensor hash (docs/contract.md §1.7), table id (§1.8)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from typing import Any

import numpy as np

from .wire import wire_array

DIGEST_RE = re.compile(r"[0-9a-f]{64}")


def is_digest(text: Any) -> bool:
    """Whether `text` is a hash as the routes accept it: 64 lowercase hex characters."""
    return isinstance(text, str) and DIGEST_RE.fullmatch(text) is not None


def hash_parts(dtype_name: str, shape: Iterable[int], data: bytes | memoryview) -> str:
    """SHA-256 of wire dtype name + shape as Python's default JSON list + raw bytes."""
    digest = hashlib.sha256()
    digest.update(dtype_name.encode("ascii"))
    digest.update(json.dumps([int(d) for d in shape]).encode("ascii"))
    digest.update(data)
    return digest.hexdigest()


def tensor_hash(array: np.ndarray, dtype: str | None = None) -> str:
    """The tensor hash of `array` as it would travel in a container (uint16 = BF16 bits)."""
    wire_name, data = wire_array(array, dtype)
    return hash_parts(wire_name, data.shape, data.reshape(-1).view(np.uint8).data)


def canonical_json(doc: Any) -> bytes:
    """Python's canonical form of a JSON document: sorted keys at every level, no whitespace,
    non-ASCII escaped. This is also the body the client sends for a patch table."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def table_id(doc: Any) -> str:
    """The id of a patch table: SHA-256 of its canonical JSON."""
    return hashlib.sha256(canonical_json(doc)).hexdigest()
