"""The weights of a diffusers-layout component folder: its config, its (sharded) safetensors,
and what a family's load asks of them.

Everything that touches stored tensors goes through here: reading (safetensors shards, float
or quantized as `gmlx model quantize` writes them; a DiT's single GGUF or safetensors file
through gguf.py), casting to the compute dtype,
quantizing (quantize.py) and in time sharding. A quantized component's config.json names its
`quantization` ({"bits", "group_size", "mode"}, as mlx-lm's); which weights are quantized is
decided by the files themselves: a weight `X.weight` with an `X.scales` beside it. A family's load says what it needs (`load_tree(dir, sanitize, dtype,
keep_f32=..., quantization=..., quantized=...)`) and maps the names (its DiT's `sanitize`); it
never casts leaf by leaf. Memory is counted from the loaded
arrays (`nn.dtypes.tree_bytes`); the header-based `estimated_bytes` serves only estimates for a
folder that is not loaded. `tensor_infos` gives logical shapes, whatever the storage.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .dit_file import DiTFile, Naming, fused_weights
from .file_headers import UNREAD_COUNTER, check_read_dtypes, common_prefix, safetensors_entries
from .ggml_blocks import Blocks, hold_blocks, sanitize_blocks
from .gguf import GROUP_SIZE as GGUF_GROUP_SIZE
from .nn.dtypes import eval_leaf_by_leaf
from .precision import Quantization
from .processes import remove_left_by_gone, this_host
from .quantize import (
    BIASES,
    PACKED_BITS,
    SCALES,
    quantizable,
    quantize_module,
    quantize_stored_module,
    quantize_tree,
    quantized,
    sanitize_stored,
)
from .spec import read_config

QUANTIZED = "quant"  # the dtype tensor_infos gives a quantized weight (docs/contract.md §2.4)

_INDEX_SUFFIX = ".safetensors.index.json"


def weight_files(component_dir: Path) -> list[Path]:
    """The safetensors files of a component: the shards an index names, else every file."""
    component_dir = Path(component_dir)
    indexes = sorted(component_dir.glob("*" + _INDEX_SUFFIX))
    if indexes:
        index = json.loads(indexes[0].read_text())
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise ValueError(f"{indexes[0]} has no weight_map of tensor names to file names")
        return [component_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(component_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {component_dir}")
    return files


def load_weights(
    component_dir: Path,
    dtype: mx.Dtype | None = None,
    keep_f32: Callable[[str], bool] | None = None,
    include: Callable[[str], bool] | None = None,
) -> dict[str, mx.array]:
    """The tensors of a component by their file names (`include`: those it picks, None: all;
    the others are never read), cast to `dtype` when given; the names `keep_f32` picks (norm
    scales, read by norms that run in float32) are cast to float32. Packed quantized weights
    (uint32) are never cast."""
    weights: dict[str, mx.array] = {}
    for path in weight_files(component_dir):
        read_header(path)  # its dtypes checked
        for name, value in mx.load(str(path)).items():
            if (include is not None and not include(name)) or name.endswith(UNREAD_COUNTER):
                continue
            target = mx.float32 if keep_f32 is not None and keep_f32(name) else dtype
            if target is None or value.dtype == mx.uint32:
                weights[name] = value
            else:
                weights[name] = value.astype(target)
    return weights


def stored_quantization(component_dir: Path) -> Quantization | None:
    """The quantization a component's files hold (its config's `quantization`), or None (also
    for a component without a config.json)."""
    if not (Path(component_dir) / "config.json").is_file():
        return None
    stored = read_config(component_dir).get("quantization")
    if stored is None:
        return None
    return Quantization(stored["bits"], stored["group_size"])


def quantization_at_load(component_dir: Path, requested: Quantization | None):
    """What a load of the component still quantizes: `requested`; None for a component stored
    quantized, which loads as stored (a ValueError when `requested` names another precision)."""
    stored = stored_quantization(component_dir)
    if stored is None:
        return requested
    if requested is not None and requested != stored:
        raise ValueError(
            f"{Path(component_dir).name} is stored quantized ({stored.bits}-bit, groups of"
            f" {stored.group_size}); load it without quantize or at that precision"
        )
    return None


def load_module(
    module: Any,
    component_dir: Path,
    quantization: Quantization | None,
    quantized: Callable[[str], bool] | None,
    from_gguf: Callable[[], dict] | None,
    from_folder: Callable[[], dict],
) -> None:
    """Load an `mlx.nn` encoder's weights into `module`, evaluated leaf by leaf: from its GGUF
    files (`from_gguf`, the tensors kept quantized as the files hold them) or from its folder
    (`from_folder`, a folder stored quantized as stored); with a `quantization`, the float
    linear layers whose module path `quantized` picks (the family's choice) are quantized as
    they load (quantize.quantize_module)."""
    if from_gguf is not None:
        weights = from_gguf()
        hold_blocks(module, weights)
        quantize_stored_module(module, weights, GGUF_GROUP_SIZE)
    else:
        quantization = quantization_at_load(Path(component_dir), quantization)
        weights = from_folder()
        stored = stored_quantization(component_dir)
        if stored is not None:
            quantize_stored_module(module, weights, stored.group_size)
    if quantization is not None:
        if quantized is None:
            raise ValueError("a quantized load needs the family's choice of layers")
        quantize_module(module, weights, quantization, quantized)
    module.load_weights(list(weights.items()), strict=True)
    del weights
    eval_leaf_by_leaf(module.parameters())


def load_tree(
    component_dir: Path,
    sanitize: Callable[[dict[str, mx.array]], dict],
    dtype: mx.Dtype | None = None,
    keep_f32: Callable[[str], bool] | None = None,
    quantization: Quantization | None = None,
    quantized: Callable[[str], bool] | None = None,
    gguf: DiTFile | None = None,
    shard: Any = None,
) -> dict:
    """A component's weight tree, evaluated: its tensors read (`load_weights`, or from the
    single file, GGUF or safetensors, the dit_file.DiTFile `gguf` names), mapped by the family's `sanitize` (file names -> tree), and with a
    `quantization` the float linear weights whose tree path `quantized` picks quantized, one
    at a time (quantize.quantize_tree), so the float model is never whole in memory. A
    component stored quantized (a folder of `gmlx model quantize`, or GGUF) loads as stored
    (quantize.sanitize_stored), never through float weights. The leaves are evaluated one at a
    time (`eval_leaf_by_leaf`): evaluating the whole tree at once let MLX read many tensors
    before fusing them, 1.21x the resident bytes at the peak
    (tests/families/qwen_image21/test_load_peaks.py). A weight stored at the compute dtype is
    never cast (a bf16 file loaded at bf16 never passes through float32). A quantized load
    quantizes from the compute dtype: from a bf16 file at float32 compute each weight is cast
    first, one at a time, because `mx.quantize` gives the scales and biases its input's dtype
    and bf16 ones would change the dequantized weights (by 5e-3, docs/benchmarks.md, "Load
    peaks") against quantizing the float32 weights, as `gmlx model quantize` does. With a
    `shard` (a rank's shard.TreeShard) only the rank's slice of each weight is kept, cut
    before quantizing; of a GGUF file, the blocks of other ranks' stages are never read."""
    component_dir = Path(component_dir)
    if gguf is not None:
        reads = None if shard is None else shard.reads
        files = gguf.tensors(dtype, keep_f32, reads, quantizing=quantization is not None)
        if any(isinstance(value, Blocks) for value in files.values()):
            tree = sanitize_blocks(files, sanitize)
        else:
            tree = sanitize_stored(files, sanitize, GGUF_GROUP_SIZE)
    else:
        quantization = quantization_at_load(component_dir, quantization)
        files = load_weights(component_dir, dtype, keep_f32)
        stored = stored_quantization(component_dir)
        tree = (
            sanitize(files)
            if stored is None
            else sanitize_stored(files, sanitize, stored.group_size)
        )
    del files
    if shard is not None:
        tree = shard.slice(tree)
    if quantization is not None:
        if quantized is None:
            raise ValueError("a quantized load needs the family's choice of layers")
        quantize_tree(tree, quantization, quantized)
    if shard is not None:
        shard.mark(tree)
    eval_leaf_by_leaf(tree)
    return tree


GGUF_SUFFIX = ".gguf"


def load_dit_tree(
    transformer_dir: Path,
    config: Any,
    sanitize: Callable[[dict, Any], dict],
    f32_weights: tuple[str, ...],
    quantized: Callable[[str], bool],
    single: DiTFile | None,
    dtype: mx.Dtype,
    quantization: Quantization | None = None,
    shard: Any = None,
    plan: Any = None,
    depths: dict[str, int] | None = None,
) -> tuple[dict, Any]:
    """A DiT's weight tree (`load_tree`) and, with a `shard` (a shard_plan.Shard), the rank's
    stages: `sanitize(files, config)` its file names -> tree, the tensors whose names end in
    one of `f32_weights` kept in float32 (norm scales), `quantized` the tree paths a
    quantized load quantizes, `single` its single file (None: the folder's safetensors), and
    for a shard the family's `plan` (shard_plan.ShardPlan) over block stacks of `depths`."""
    from .shard import Stages, TreeShard

    tree_shard = None if shard is None else TreeShard(plan, shard, depths)
    weights = load_tree(
        transformer_dir,
        lambda files: sanitize(files, config),
        dtype,
        keep_f32=lambda name: name.endswith(f32_weights),
        quantization=quantization,
        quantized=quantized,
        gguf=single,
        shard=tree_shard,
    )
    return weights, None if tree_shard is None else Stages(tree_shard)


def block_weights(files: dict[str, mx.array], prefix: str, linears: dict, norms: dict) -> dict:
    """One block of a DiT's weight tree from the file's tensors under `prefix`: each of
    `linears` (tree key -> its file names, in row order) one weight, several parts concatenated
    along the output rows so they run as one matmul; each of `norms` (tree key -> file name)
    its scale."""
    block = {
        key: mx.concatenate([files[prefix + name + ".weight"] for name in parts], axis=0)
        if len(parts) > 1
        else files[prefix + parts[0] + ".weight"]
        for key, parts in linears.items()
    }
    for key, name in norms.items():
        block[key] = files[prefix + name + ".weight"]
    return block


def gguf_file(component_dir: Path, override: Path | None = None) -> Path | None:
    """The GGUF file a component's weights are read from: `override` (a model entry's; a file
    of another kind is refused), else the one `.gguf` file in the folder, else None
    (safetensors). Two are refused."""
    if override is not None:
        if Path(override).suffix.lower() != GGUF_SUFFIX:
            raise ValueError(f"{override} is not a GGUF file, the only file this family reads")
        return Path(override)
    found = sorted(Path(component_dir).glob("*" + GGUF_SUFFIX))
    if len(found) > 1:
        names = ", ".join(path.name for path in found)
        raise ValueError(f"{component_dir} holds more than one GGUF file ({names}); keep one")
    return found[0] if found else None


def single_file(component_dir: Path, override: Path | None, naming: Naming) -> Path | None:
    """The one file a DiT's weights are read from instead of its folder's diffusers
    safetensors: `override` (a model entry's `dit`, a GGUF or a safetensors file), else the
    folder's one `.gguf` file, else its one safetensors file when that is a single-file
    checkpoint (its names under a prefix such as `model.diffusion_model.`, or in `naming`),
    else None."""
    if override is not None:
        return Path(override)
    found = gguf_file(component_dir)
    if found is not None:
        return found
    files = weight_files(component_dir)
    if len(files) == 1:
        names = list(read_header(files[0]))
        if common_prefix(names) or naming.holds(names):
            return files[0]
    return None


def single_dit_file(
    config_class: Any,
    linear_slots: Callable[[Any], dict],
    tensor_shapes: Callable[[Any], dict],
    naming: Naming | Callable[[Any], Naming],
    title: str,
) -> Callable[[Path, Path | None], DiTFile | None]:
    """A DiT's `dit_file(transformer_dir, dit=None)` (dit_network.DiTPart's `file`): its single
    file (`single_file`: a model entry's `dit`, GGUF or safetensors, else the folder's one
    `.gguf`, else its one safetensors file under a prefix or in `naming`) as the family reads
    it, in `naming` (or the naming the config gives, for a function) or the family's file
    names; None for the folder's own safetensors."""

    def dit_file(transformer_dir: Path, dit: Path | None = None) -> DiTFile | None:
        config = config_class.from_dict(read_config(transformer_dir))
        named = naming if isinstance(naming, Naming) else naming(config)
        path = single_file(transformer_dir, dit, named)
        if path is None:
            return None
        fused = fused_weights(linear_slots(config))
        return DiTFile(path, named, tensor_shapes(config), fused, title)

    return dit_file


@dataclass(frozen=True)
class TensorInfo:
    """A stored tensor as a manifest names it: its logical shape and its stored dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # the safetensors name: F32, F16, BF16, ...


def tensor_infos(component_dir: Path) -> list[TensorInfo]:
    """Every tensor of a component as the model names it, from the file headers (no data
    read): a quantized weight by its logical (unquantized) shape with dtype QUANTIZED, its
    scales and biases left out."""
    headers = {
        name: entry
        for path in weight_files(component_dir)
        for name, entry in read_header(path).items()
    }
    stored = stored_quantization(component_dir)
    infos = []
    for name, entry in headers.items():
        shape = tuple(entry["shape"])
        if packed_name(name, headers):
            continue  # a quantized weight's scales or biases
        if name.endswith(".weight") and name[: -len(".weight")] + SCALES in headers:
            rows, words = shape
            infos.append(TensorInfo(name, (rows, words * PACKED_BITS // stored.bits), QUANTIZED))
        else:
            infos.append(TensorInfo(name, shape, entry["dtype"]))
    return infos


def packed_name(name: str, names) -> bool:
    """Whether `name` is the scales or biases of a quantized weight among `names`."""
    for suffix in (SCALES, BIASES):
        if name.endswith(suffix) and name[: -len(suffix)] + ".weight" in names:
            return True
    return False


def estimated_bytes(
    component_dir: Path, dtype: mx.Dtype, include: Callable[[str], bool] | None = None
) -> int:
    """The bytes a component's tensors would hold loaded, from the headers, for estimates of a
    folder that is not loaded (a loaded model counts its arrays): each float tensor at `dtype`,
    each weight stored quantized with its scales and biases as stored; with `include`, only
    the tensors it picks by file name (those the load reads)."""
    headers = {
        name: entry
        for path in weight_files(component_dir)
        for name, entry in read_header(path).items()
    }
    total = 0
    for name, entry in headers.items():
        if include is not None and not include(name):
            continue
        quantized_weight = name.endswith(".weight") and name[: -len(".weight")] + SCALES in headers
        if quantized_weight or packed_name(name, headers):
            start, end = entry["data_offsets"]
            total += end - start
        else:
            total += int(np.prod(entry["shape"], dtype=np.int64)) * dtype.size
    return total


def read_header(path: Path) -> dict:
    """The safetensors header of one file (names to dtype, shape, offsets), without its data;
    a file_headers.HeaderError (a ValueError) naming a file that does not hold them whole, or
    the first tensor stored in a dtype the server does not read (file_headers.READ_DTYPES)."""
    entries, _ = safetensors_entries(path)
    check_read_dtypes(path, {name: entry["dtype"] for name, entry in entries.items()})
    return entries


def component_bytes(component_dir: Path) -> int:
    """Bytes of tensor data in a component's files, from their headers."""
    total = 0
    for path in weight_files(component_dir):
        for entry in read_header(path).values():
            start, end = entry["data_offsets"]
            total += end - start
    return total


@contextlib.contextmanager
def written_whole(destination: Path) -> Iterator[Path]:
    """The folder to write the new model folder `destination` in: a hidden one beside it (a
    registry lists no hidden folder), renamed to `destination` once the block has written it
    whole, and removed with what it holds where the block fails or is interrupted, so that no
    half-written model is left to be listed and served."""
    destination = Path(destination)
    if destination.exists():
        raise FileExistsError(f"{destination} exists; name a new folder")
    destination.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_builds(destination)
    # named by its host and process, so that what a build killed outright left is told apart;
    # made as any folder is (the umask's mode: others may read it), not mkdtemp's 0700
    building = destination.parent / (
        f".{destination.name}-{this_host()}-{os.getpid()}-{secrets.token_hex(4)}"
    )
    building.mkdir()
    try:
        yield building
        os.rename(building, destination)
    finally:
        shutil.rmtree(building, ignore_errors=True)


def quantized_already(source: Path, components: Iterable[str]) -> str | None:
    """Why `source`'s components cannot be quantized, one being stored quantized already (None:
    they can); its float original is what to quantize."""
    stored = [name for name in components if stored_quantization(Path(source) / name)]
    if not stored:
        return None
    return f"{Path(source) / stored[0]} is stored quantized already; quantize the float original"


def _remove_abandoned_builds(destination: Path) -> None:
    """The hidden folders that builds of `destination` on this host killed outright (no
    cleanup ran) left beside it: those whose process no longer runs."""
    builds = re.compile(
        rf"\.{re.escape(destination.name)}-(?P<host>[^-]+)-(?P<pid>\d+)-[0-9a-f]{{8}}"
    )
    remove_left_by_gone(destination.parent, builds)


def quantize_folder(
    source: Path,
    destination: Path,
    quantization: Quantization,
    components: dict[str, Callable[[str], bool]],
) -> None:
    """Write `destination` (which must not exist), a copy of the model folder `source` in which
    each component named in `components` holds the weights its predicate picks (by file name)
    quantized (`write_quantized`). Loading the copy reads the quantized weights directly."""
    source = Path(source)
    refused = quantized_already(source, components)
    if refused:
        raise ValueError(refused)
    with written_whole(destination) as folder:
        for item in sorted(source.iterdir()):
            if item.name in components:
                write_quantized(item, folder / item.name, quantization, components[item.name])
            elif item.is_dir():
                shutil.copytree(item, folder / item.name)
            else:
                shutil.copy2(item, folder / item.name)


def write_quantized(
    source: Path, destination: Path, quantization: Quantization, include: Callable[[str], bool]
) -> None:
    """Copy a component folder with the float matrices `include` picks by file name (and
    whose rows the group size divides) quantized from float32: `X.weight` packed, `X.scales`
    and `X.biases` (float32), shard by shard (`quantize_shard`), each tensor quantized and
    evaluated before the next; its config records the `quantization` (`finish_quantized`)."""
    destination.mkdir()
    shards = {path.name for path in weight_files(source)}
    for item in sorted(source.iterdir()):
        if item.name not in shards and item.name != "config.json":
            copy = shutil.copytree if item.is_dir() else shutil.copy2
            copy(item, destination / item.name)
    weight_map = {}
    for path in weight_files(source):
        weight_map.update(quantize_shard(path, destination, quantization, include))
    finish_quantized(source, destination, quantization, weight_map)


def quantize_shard(
    path: Path, destination: Path, quantization: Quantization, include: Callable[[str], bool]
) -> dict[str, str]:
    """One safetensors shard written into `destination` under its name, the weights `include`
    picks quantized (write_quantized); its tensors' names -> the shard's name."""
    tensors = {}
    for name, value in mx.load(str(path)).items():
        if name.endswith(".weight") and include(name) and quantizable(value, quantization):
            base = name[: -len(".weight")]
            # in float32, as a load at float32 quantizes: the two give the same weights
            packed = quantized(value.astype(mx.float32), quantization)
            tensors[name], tensors[base + SCALES], tensors[base + BIASES] = packed
        else:
            tensors[name] = value
    written = Path(destination) / Path(path).name
    try:
        mx.save_safetensors(str(written), tensors, metadata={"format": "mlx"})
    except RuntimeError as exc:  # MLX's own: a full disk, a write refused
        raise OSError(f"cannot write {written.name}: {exc}") from exc
    return dict.fromkeys(tensors, Path(path).name)


def finish_quantized(
    source: Path, destination: Path, quantization: Quantization, weight_map: dict[str, str]
) -> None:
    """A quantized component's index (its shards' new tensor names, `weight_map`) and its
    config recording the `quantization`, from the float component's (`source`): only where a
    weight was quantized (a component too narrow for the group size stays float, and says so)."""
    for index in Path(source).glob("*" + _INDEX_SUFFIX):
        doc = json.loads(index.read_text())
        (Path(destination) / index.name).write_text(json.dumps({**doc, "weight_map": weight_map}))
    config = read_config(source)
    if any(name.endswith(SCALES) for name in weight_map):
        config = {**config, "quantization": quantization.status()}
    (Path(destination) / "config.json").write_text(json.dumps(config, indent=2))
