"""Row tensor hashes memoised across steps (docs/contract.md §7.5), and where a batch's rows came from.

A step names each row's conditioning and reference latents by SHA-256; at full size that is
3-4 MiB and ~2 ms per tensor, as much as the whole transport of a step, for tensors that do
not change during a run. `TensorHashes` hashes each once. Pure: duck-types torch tensors and
imports neither ComfyUI nor torch.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
from gmlx_contract.hashing import tensor_hash

# Entries a memo keeps: a step names B rows x (1 + references) tensors, B <= a few.
MEMO_ENTRIES = 64
# Attribute of a tensor the pack concatenated: the tensors its rows came from, and its version.
ROW_SOURCES = "gmlx_row_sources"


def version_of(tensor: Any) -> int:
    """A tensor's in-place version counter. Inference tensors keep none (ComfyUI runs nodes
    and samplers under torch.inference_mode) and count as version 0, as numpy arrays do: they
    are then memoised by their bytes' place alone, which holds because nothing edits a
    conditioning or a LoRA matrix in place."""
    try:
        return int(getattr(tensor, "_version", 0))
    except RuntimeError:  # "Inference tensors do not track version counter"
        return 0


def content_key(tensor: Any) -> tuple | None:
    """What names a torch tensor's bytes while its storage lives: where they are (device,
    storage address, offset, shape, strides), how to read them (dtype) and its in-place
    version. A per-row view (context[i:i+1], a token prefix) differs from its base by offset
    or shape. None for anything else (a numpy array has no version counter to see an edit)."""
    if not hasattr(tensor, "untyped_storage") or tensor.numel() == 0:
        return None
    storage = tensor.untyped_storage()
    return (
        str(tensor.device),
        storage.data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        str(tensor.dtype),
        version_of(tensor),
    )


class TensorHashes:
    """Tensor hashes memoised by `content_key`.

    A storage address names bytes only while that storage lives (a new tensor may take the
    address of a freed one), so each entry keeps a weak reference to the storage it hashed and
    counts only while it lives. At most MEMO_ENTRIES entries are kept, least recently used
    dropped: an entry holds a digest and a weak reference, never the tensor.
    """

    def __init__(self, to_array: Callable[[Any], np.ndarray]) -> None:
        self.to_array = to_array
        self._memo: OrderedDict[tuple, tuple[weakref.ref, str]] = OrderedDict()
        self.hashed = 0  # tensors hashed (memo misses), for tests and diagnostics

    def __len__(self) -> int:
        return len(self._memo)

    def digest(self, tensor: Any) -> str:
        """The tensor hash of `to_array(tensor)`."""
        key = content_key(tensor)
        held = self._memo.get(key) if key is not None else None
        if held is not None and held[0]() is not None:
            self._memo.move_to_end(key)
            return held[1]
        digest = tensor_hash(self.to_array(tensor))
        self.hashed += 1
        if key is not None:
            self._memo[key] = (weakref.ref(tensor.untyped_storage()), digest)
            while len(self._memo) > MEMO_ENTRIES:
                self._memo.popitem(last=False)
        return digest


def mark_row_sources(batch: Any, parts: list[Any]) -> None:
    """Record on `batch`, the concatenation of `parts` along dim 0 (each maybe zero-padded
    along dim 1), which tensor each of its rows came from. ComfyUI concatenates cond and
    uncond afresh for every step; their sources live for the whole run, so hashes of rows read
    from the sources are memoised across steps."""
    rows = [part[j : j + 1] for part in parts for j in range(part.shape[0])]
    if len(rows) == batch.shape[0]:
        setattr(batch, ROW_SOURCES, (rows, version_of(batch)))


def row_source(batch: Any, j: int) -> Any | None:
    """The tensor row j of `batch` came from (see mark_row_sources), unless `batch` was edited
    in place since."""
    marked = getattr(batch, ROW_SOURCES, None)
    if marked is None or marked[1] != version_of(batch):
        return None
    return marked[0][j]
