"""A family's DiT as data and the half of its network every family shares.

`DiTPart` names what a DiT's weights are (its config class, its file names onto its weight tree,
its linear layers, which of them a quantized load quantizes, the norm scales kept in float32,
its single files and its shard plan): FolderFamily reads the status, manifest, checks and
`gmlx model quantize`'s choice from it, and `DiTNetwork.load` reads the weights through it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from .base import Capabilities
from .nn import cpu_ops
from .nn.compiled import CompiledPass
from .nn.dtypes import default_compute_dtype, tree_bytes
from .nn.embeddings import time_frequencies
from .shard import Shard, Stages
from .weights import load_dit_tree, read_config, tensor_infos

log = logging.getLogger("gmlx.server")
# (transformer folder, its unread tensors) already said in the log: a load checks twice
_UNREAD_SAID: set[tuple[Path, tuple[str, ...]]] = set()


def _no_extras(manifest: dict) -> dict:
    return {}


@dataclass(frozen=True)
class DiTPart:
    """A family's DiT as its folder holds it (the fields in order, those up to `tensor_shapes`
    given positionally by the families):

    - `file(transformer_dir, dit)`: its single file (GGUF or safetensors, the family's
      dit.dit_file; None: diffusers' own folder);
    - `config`: its config class (`from_dict`);
    - `linear_slots(config)`: its linear layers by file name (lora.LinearSlot);
    - `quantized(path)`: the tree paths a quantized load quantizes;
    - `sanitize(files, config)`: file names -> its weight tree;
    - `f32_weights`: the name endings of the tensors kept in float32 (norm scales);
    - `shard_layout(config)`: (shard_plan.ShardPlan, block stack depths), None: never sharded;
    - `tensor_shapes(config)`: every tensor the DiT reads, by diffusers name, in the shape the
      config gives it (None: a folder's shapes are not checked before it loads);
    - `manifest_extras(manifest)`: what its manifest adds (FLUX.2 klein's `lora_aliases`);
    - `table_slots(config)`: the layers a LoRA patch table may name (None: `linear_slots`;
      FLUX.2 klein's BFL names too)."""

    file: Callable[[Path, Path | None], Any]
    config: Any
    linear_slots: Callable[[Any], dict]
    quantized: Callable[[str], bool]
    sanitize: Callable[[dict, Any], dict] | None = None
    f32_weights: tuple[str, ...] = ()
    shard_layout: Callable[[Any], tuple[Any, dict[str, int]]] | None = None
    tensor_shapes: Callable[[Any], dict] | None = None
    manifest_extras: Callable[[dict], dict] = _no_extras
    table_slots: Callable[[Any], dict] | None = None

    def load(
        self,
        transformer_dir: Path,
        dtype: mx.Dtype,
        quantization: Any = None,
        dit: Path | None = None,
        shard: Shard | None = None,
    ) -> tuple[Any, dict, Stages | None]:
        """(config, weight tree, this rank's stages) of a transformer/ folder, its weights from
        safetensors or its single file (`dit`, a model entry's, else the folder's one), with a
        `quantization` the float layers `quantized` picks quantized as they load, with a
        `shard` this rank's part alone (a ValueError for a DiT without a shard layout)."""
        config = self.config.from_dict(read_config(transformer_dir))
        plan, depths = None, None
        if shard is not None:
            if self.shard_layout is None:
                raise ValueError("this DiT has no shard plan; serve it from one process")
            plan, depths = self.shard_layout(config)
        single = self.file(transformer_dir, dit)
        weights, stages = load_dit_tree(
            transformer_dir,
            config,
            self.sanitize,
            self.f32_weights,
            self.quantized,
            single,
            dtype,
            quantization,
            shard,
            plan,
            depths,
        )
        return config, weights, stages

    def check_folder(self, transformer_dir: Path) -> None:
        """Refuse, before anything loads, a transformer/ folder whose config cannot be read,
        whose safetensors are not whole (file_headers.HeaderError naming the file), or that
        lacks a tensor its config gives or holds it in another shape (a ValueError naming the
        folder and the tensor), as DiTFile.open refuses a single file; tensors the config does
        not read are said in the log."""
        config = self.config.from_dict(read_config(transformer_dir))
        stored = {info.name: info.shape for info in tensor_infos(transformer_dir)}
        if self.tensor_shapes is None:
            return
        shapes = self.tensor_shapes(config)
        missing = [name for name in shapes if name not in stored]
        if missing:
            raise ValueError(
                f"{transformer_dir} does not hold the DiT its config.json gives: it has no"
                f" tensor {missing[0]} ({len(missing)} of the {len(shapes)} it reads are missing)"
            )
        for name, expected in shapes.items():
            if stored[name] != tuple(expected):
                raise ValueError(
                    f"{transformer_dir}: tensor {name} has shape {list(stored[name])} where"
                    f" its config.json gives {list(expected)}"
                )
        unread = sorted(set(stored) - set(shapes))
        said = (Path(transformer_dir), tuple(unread))
        if unread and said not in _UNREAD_SAID:  # said once, not refused: a release may
            _UNREAD_SAID.add(said)  # carry a tensor no forward reads
            log.warning(
                "%s holds %d tensors its config.json does not read (%s, ...): a config that"
                " names fewer blocks than the weights hold runs a smaller network",
                transformer_dir,
                len(unread),
                unread[0],
            )


def by_layout(layouts: Sequence[Hashable], run: Callable[[list[int]], mx.array]) -> mx.array:
    """A batch's answer (B, ...) in row order, its rows run in groups: `layouts[b]` says what
    row b must share with the rows it runs beside (its text length, its references' shapes),
    `run(rows)` answers the rows of one layout as one batch (len(rows), ...). One layout runs
    once, as the batch it is."""
    groups: dict[Hashable, list[int]] = {}
    for row, layout in enumerate(layouts):
        groups.setdefault(layout, []).append(row)
    if len(groups) == 1:
        return run(list(range(len(layouts))))
    answers: dict[int, mx.array] = {}
    for rows in groups.values():
        answers.update(zip(rows, run(rows), strict=True))
    return mx.stack([answers[row] for row in range(len(layouts))])


def rows_of(array: mx.array, rows: list[int]) -> mx.array:
    """`array`'s rows `rows` (B', ...): the array itself where they are all of its rows."""
    return array if rows == list(range(array.shape[0])) else array[mx.array(rows)]


def stacked_references(rows: list[list[mx.array]]) -> list[mx.array]:
    """The references of rows of one layout (each row's a list of (C, h_k, w_k)) as one
    (B, C, h_k, w_k) batch per reference."""
    return [mx.stack([row[k] for row in rows]) for k in range(len(rows[0]))]


class DiTNetwork:
    """What every family's DiT network holds: its config, weight tree and compute dtype, this
    process's part of its blocks (`stages`, engine/shard.py), the time embedding's
    frequencies (at its config's `time_dim`), and whether attention takes the CPU backend's
    kernels. A subclass sets `PART`, its DiTPart, and adds its forward; one whose whole forward
    is one pure pass of arrays writes it as `_pass`, which then runs as `compiled_pass`
    (nn/compiled.py: its elementwise work, RoPE, norms, modulation and gates, fuses where
    compiling pays; sharded, it runs eagerly, its collectives outside any compiled graph), at
    its config's width `dim`."""

    PART: DiTPart

    def __init__(self, config: Any, weights: dict, dtype: mx.Dtype, stages: Stages | None = None):
        self.config = config
        self.weights = weights
        self.dtype = dtype
        self.stages = stages or Stages()
        # The time embedding's sinusoid frequencies at the width its config names (`time_dim`;
        # a DiT that embeds the time another way names none).
        time_dim = getattr(config, "time_dim", None)
        self._time_freqs = None if time_dim is None else time_frequencies(time_dim)
        self.cpu_ops = cpu_ops.use_cpu_ops(dtype)
        if hasattr(self, "_pass"):
            self.compiled_pass = CompiledPass(self._pass, config.dim, enabled=stages is None)

    @classmethod
    def load(
        cls,
        transformer_dir: Path,
        dtype: mx.Dtype | None = None,
        quantization: Any = None,
        dit: Path | None = None,
        shard: Shard | None = None,
    ):
        """The DiT of a transformer/ folder (DiTPart.load)."""
        dtype = dtype or default_compute_dtype()
        config, weights, stages = cls.PART.load(transformer_dir, dtype, quantization, dit, shard)
        return cls(config, weights, dtype, stages)

    @property
    def weight_bytes(self) -> int:
        return tree_bytes(self.weights)

    @staticmethod
    def tokens(x: mx.array) -> mx.array:
        """Latents (B, C, h, w) as tokens (B, h*w, C), a cell a token in raster order."""
        batch, channels, height, width = x.shape
        return x.reshape(batch, channels, height * width).transpose(0, 2, 1)

    @staticmethod
    def grid(tokens: mx.array, height: int, width: int) -> mx.array:
        """Tokens (B, h*w, C) in raster order back as latents (B, C, h, w)."""
        batch, _, channels = tokens.shape
        return tokens.transpose(0, 2, 1).reshape(batch, channels, height, width)

    def capabilities(self, declared: Capabilities) -> Capabilities:
        """What a model on these weights can do: the spec's `declared` capabilities, where the
        weights decide none of them (a DiT whose weights do says so: its blocks to skip, a
        flow map's target time)."""
        return declared
