"""A text encoder (an mlx.nn module) in GGUF files, named as llama.cpp names it: the gguf
package's own tables give each transformers name its llama.cpp name (`llama_cpp_names`), and
`ModuleFiles` checks the files against the module's config and reads its parameters, quantized
weights held as gguf.held_as() says."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np

from .ggml_blocks import Blocks
from .gguf import AFFINE, BLOCKS, GGUFError, GGUFFile, bits_per_weight, held_as, held_bits
from .gguf_affine import width
from .quantize import BIASES, SCALES


def llama_cpp_names(arch: gguf.MODEL_ARCH, blocks: int, names) -> dict[str, str]:
    """transformers tensor names -> llama.cpp's names of them (`blk.N.attn_q.weight` ...), by
    the gguf package's own tables (`gguf.get_tensor_name_map`); a name the table does not know
    is left out."""
    table = gguf.get_tensor_name_map(arch, blocks)
    found = {}
    for name in names:
        mapped = table.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is not None:
            found[name] = mapped
    return found


@dataclass(frozen=True)
class ModuleFiles:
    """A module's weights in GGUF files (a model file and, for a vision tower, its `mmproj`):
    `names`, module parameter name -> (file index, file tensor name); `shapes`, the shape the
    module's config gives each parameter; `title`, the component in prose."""

    paths: tuple[Path, ...]
    names: dict[str, tuple[int, str]]
    shapes: dict[str, tuple[int, ...]]
    title: str

    def open(self) -> list[GGUFFile]:
        """The files, each tensor the module reads checked present and of its shape (a
        GGUFError naming the file and the tensor)."""
        files = [GGUFFile(path) for path in self.paths]
        for name, (index, file_name) in self.names.items():
            file = files[index]
            entry = file.entries.get(file_name)
            if entry is None:
                arch = f" (its architecture: {file.architecture})" if file.architecture else ""
                raise GGUFError(
                    f"{file.path} is not a {self.title}{arch}: it has no tensor {file_name}"
                )
            if entry.shape != tuple(self.shapes[name]):
                raise GGUFError(
                    f"{file.path}: tensor {file_name} has shape {list(entry.shape)} where the"
                    f" {self.title}'s config gives {name} the shape {list(self.shapes[name])}"
                )
        return files

    def weights(self, dtype: mx.Dtype | None = None) -> dict[str, mx.array | Blocks]:
        """The module's parameters: a 2-D weight quantized in the file held quantized as
        `held_as()` says (`Blocks` of its bytes, or packed beside its `.scales` and `.biases`:
        weights.load_module makes its layer a quantized one), every other tensor a float array
        cast to `dtype`; one file tensor at a time."""
        files = self.open()
        blocks = held_as() == BLOCKS
        out: dict[str, mx.array | Blocks] = {}
        for name, (index, file_name) in self.names.items():
            file = files[index]
            quantized = file.quantized_2d(file_name) and name.endswith(".weight")
            if quantized and blocks:
                out[name] = file.read_blocks(file_name)
            elif quantized:
                value = file.read(file_name)
                base = name[: -len(".weight")]
                out[name], out[base + SCALES], out[base + BIASES] = value.packed()
            else:
                out[name] = file.read(file_name, dtype, as_float=True)
        return out

    def status(self) -> dict:
        """The component's precision as status reports it: the files, their types, how the
        quantized weights are held and at how many bits a weight (as DiTFile.status)."""
        files = [GGUFFile(path) for path in self.paths]
        counts: dict[str, int] = {}
        for file in files:
            for kind, count in file.type_counts().items():
                counts[kind] = counts.get(kind, 0) + count
        affine_form = held_as() == AFFINE
        held = []
        for name, (index, file_name) in self.names.items():
            entry = files[index].entries[file_name]
            if name.endswith(".weight") and files[index].quantized_2d(file_name):
                size = int(np.prod(entry.shape, dtype=np.int64))
                affine_width = width(entry.kind) if affine_form else None
                held.append((size, held_bits(entry.kind, size, affine_width)))
        return {
            "format": "gguf",
            "file": self.paths[0].name,
            "types": dict(sorted(counts.items())),
            "weights": held_as(),
            "bits_per_weight": bits_per_weight(held),
        }

    def stored_bytes(self) -> int:
        """Bytes of tensor data in the files."""
        return sum(
            entry.tensor.n_bytes for path in self.paths for entry in GGUFFile(path).entries.values()
        )

    def read_bytes(self) -> int:
        """Bytes of tensor data of the tensors the module reads (what a load holds, about: the
        files' other tensors, such as an `output.weight` or layers past the module's, left out)."""
        files = [GGUFFile(path) for path in self.paths]
        return sum(
            files[index].entries[file_name].tensor.n_bytes
            for index, file_name in self.names.values()
        )
