"""Quantized weights in MLX: affine quantization (`mx.quantize`) of a component's linear layers
as it loads, and the linear that applies either form.

In a weight tree (nested dicts and lists, as a DiT's `sanitize` builds it) a quantized linear
weight `name` sits in its node as MLX stores it: `name` packed (uint32), `name.scales` and
`name.biases` (one of each per `group_size` input columns of a row), and `name.quantization`,
the (bits, group_size) constants `mx.quantized_matmul` needs (mx.compile takes them as part of a
trace's signature). An `mlx.nn` module (a text encoder) gets this module's `QuantizedLinear`
layers (`nn.QuantizedLinear` through the same matmul). On the CPU backend a quantized matmul
of 16 rows or more dequantizes its weight and runs the float GEMM (`quantized_matmul`); GPU
backends run MLX's quantized kernels.

Which layers are quantized is the family's choice, in one place: a predicate on the tree path
("blocks.3.qkv", "language_model.layers.0.mlp.up_proj"), as mlx-lm's `class_predicate`. A layer
whose input width is no multiple of the group size stays as it is. Quantizing goes tensor by
tensor, each evaluated and its float source dropped before the next, so a load peaks near the
quantized size plus one float tensor (tests/engine/test_quantize.py measures it).

A folder stored quantized (`gmlx model quantize`: weights.quantize_folder) holds the same
arrays in its files, `X.weight` packed beside `X.scales` and `X.biases`; `sanitize_stored` and
`quantize_stored_module` load them as they are, never through float weights.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from . import ggml_blocks
from .ggml_blocks import LAYOUT, BlockLayout
from .precision import MODE, Quantization

SCALES = ".scales"
BIASES = ".biases"
SPEC = ".quantization"  # (bits, group_size)
PACKED_BITS = 32  # the packed weight's element: uint32
DEQUANTIZE_MIN_ROWS = 16  # quantized_matmul, below: MLX's CPU kernel is faster (benchmarks.md)


def linear(node: dict, name: str, x: mx.array) -> mx.array:
    """x W^T for the weight `name` of a tree node: float, affine quantized, or a GGUF file's
    blocks (ggml_blocks.py)."""
    layout = node.get(name + LAYOUT)
    if layout is not None:
        return ggml_blocks.matmul(x, node[name], BlockLayout.of(layout))
    spec = node.get(name + SPEC)
    if spec is None:
        return x @ node[name].T
    bits, group_size = spec
    return quantized_matmul(
        x, node[name], node[name + SCALES], node[name + BIASES], bits, group_size
    )


def quantized_matmul(
    x: mx.array, packed: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int
) -> mx.array:
    """x W^T for a quantized W. On the CPU backend W is dequantized and multiplied through the
    BLAS (`dequantize_first`): MLX's CPU `quantized_matmul` is a plain loop, tens of times
    slower than the float32 GEMM at a step's row counts (docs/benchmarks.md, "Quantized
    weights"). The transient: while it runs, a dequantize
    holds twice W's out x in elements in the scales' dtype, and a chain of linears holds a few
    of those at a time (tests/engine/test_quantize.py), never the float model. GPU backends
    keep MLX's quantized kernels. Both compute x times the dequantized W."""
    if dequantize_first(x.size // x.shape[-1]):
        # Not before x: MLX evaluates ready nodes breadth-first, and a dequantize that hangs on
        # the weights alone would run ahead with every other, all float weights alive at once.
        (packed,) = mx.depends([packed], [x])
        weight = mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits, mode=MODE)
        return x @ weight.T
    return mx.quantized_matmul(
        x, packed, scales, biases, transpose=True, group_size=group_size, bits=bits, mode=MODE
    )


def dequantize_first(rows: int) -> bool:
    """Whether a quantized weight is dequantized before its matmul with `rows` input rows: on
    the CPU backend, from DEQUANTIZE_MIN_ROWS rows (the dequantize costs as much as MLX's
    loop kernel at about 12 rows of a 4096 x 4096 weight; a step has hundreds)."""
    return mx.default_device() == mx.cpu and rows >= DEQUANTIZE_MIN_ROWS


class QuantizedLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear` (affine) through `quantized_matmul`: a module's quantized layers
    (quantize_module, quantize_stored_module) take the same path as a weight tree's."""

    def __call__(self, x: mx.array) -> mx.array:
        out = quantized_matmul(
            x, self["weight"], self["scales"], self["biases"], self.bits, self.group_size
        )
        return out + self["bias"] if "bias" in self else out


def logical_shape(node: dict, name: str) -> tuple[int, int]:
    """(out, in) of the linear weight `name` as the file holds it, quantized or not."""
    layout = node.get(name + LAYOUT)
    if layout is not None:
        return BlockLayout.of(layout).shape
    rows, cols = node[name].shape
    spec = node.get(name + SPEC)
    return (rows, cols) if spec is None else (rows, cols * PACKED_BITS // spec[0])


def quantization_status(weights: dict | list | nn.Module) -> dict | None:
    """A component's precision as its status reports it: the quantization its loaded weights
    hold (a weight tree's or a module's), or None when they hold none."""
    found = quantization_of(weights)
    return None if found is None else found.status()


def quantization_of(weights: dict | list | nn.Module) -> Quantization | None:
    """The quantization of the first quantized weight of a tree or a module (None if none)."""
    if isinstance(weights, nn.Module):
        for _, layer in weights.named_modules():
            if isinstance(layer, nn.QuantizedLinear):
                return Quantization(layer.bits, layer.group_size)
        return None
    spec = next(_specs(weights), None)
    return None if spec is None else Quantization(*spec)


def _specs(tree, suffix: str = SPEC):
    """The constants beside a tree's quantized weights (`suffix`: SPEC's (bits, group_size), or
    LAYOUT's), depth first."""
    if isinstance(tree, list):
        for child in tree:
            yield from _specs(child, suffix)
    elif isinstance(tree, dict):
        for key, value in tree.items():
            if key.endswith(suffix):
                yield value
            else:
                yield from _specs(value, suffix)


def float_weight_bytes(tree: dict, itemsize: int) -> int:
    """Bytes per weight element that a step's matmul holds beside its quantized weight while it
    runs: a GGUF file's blocks are decoded every time (ggml_blocks.DECODE_BYTES), affine
    weights are dequantized at `itemsize` on the CPU backend (dequantize_first), else none."""
    if next(_specs(tree, LAYOUT), None) is not None:
        return ggml_blocks.DECODE_BYTES
    if quantization_of(tree) is not None and dequantize_first(DEQUANTIZE_MIN_ROWS):
        return itemsize
    return 0


def quantize_tree(
    tree: dict | list, quantization: Quantization, include: Callable[[str], bool], path: str = ""
) -> None:
    """Quantize, in place, every 2-D float weight of the tree whose dotted path `include` picks
    and whose input width the group size divides (a weight held quantized already stays as it
    is); each is evaluated before the next, and its float form dropped from the tree."""
    if isinstance(tree, list):
        for index, child in enumerate(tree):
            quantize_tree(child, quantization, include, f"{path}{index}.")
        return
    for key in list(tree):
        value, where = tree[key], path + key
        if isinstance(value, (dict, list)):
            quantize_tree(value, quantization, include, where + ".")
        elif (
            key.endswith((SCALES, BIASES, SPEC, LAYOUT))
            or key + SPEC in tree
            or key + LAYOUT in tree
        ):
            continue  # held quantized already (a GGUF file's: affine, or its blocks)
        elif quantizable(value, quantization) and include(where):
            tree[key], tree[key + SCALES], tree[key + BIASES] = quantized(value, quantization)
            tree[key + SPEC] = (quantization.bits, quantization.group_size)


def quantize_module(
    module: nn.Module,
    weights: dict[str, mx.array],
    quantization: Quantization,
    include: Callable[[str], bool],
) -> None:
    """Quantize, in place, the module's `nn.Linear` and `nn.Embedding` layers whose module
    path `include` picks (and whose rows the group size divides: a linear's input width, an
    embedding's width), and their weights in `weights` (the module's parameter names, as
    `Module.load_weights` takes them), one tensor at a time. An embedding becomes MLX's
    `QuantizedEmbedding` (mlx-lm quantizes token tables so): it looks rows up and dequantizes
    them, the dequantized table's rows exactly."""
    picked: list[str] = []

    def predicate(path: str, layer: nn.Module) -> Quantization | None:
        if not (quantizable(layer.weight, quantization) and include(path)):
            return None
        picked.append(path)
        return quantization

    swap_quantized(module, predicate)
    for path in picked:
        value = weights.pop(path + ".weight")
        packed = quantized(value, quantization)
        weights[path + ".weight"], weights[path + SCALES], weights[path + BIASES] = packed


def sanitize_stored(
    files: dict[str, mx.array], sanitize: Callable[[dict], dict], group_size: int
) -> dict:
    """The weight tree of files stored quantized (each quantized `X.weight` packed, with
    `X.scales` and `X.biases`, one per `group_size` columns), through the family's own
    `sanitize`: it maps the packed weights, then the scales and then the biases in their
    weights' places, and each packed leaf gets its scales, biases and (bits, group_size)
    beside it, its bits read from its shapes, so the files may mix widths (a GGUF file does).
    A family's sanitize may fuse linear weights along their rows only (concatenation on axis
    0), which quantized rows of one width allow."""
    packed = {name[: -len(SCALES)] + ".weight" for name in files if name.endswith(SCALES)}
    plain = {n: v for n, v in files.items() if not n.endswith((SCALES, BIASES))}

    def beside(suffix: str) -> dict:
        return {
            n: files[n[: -len(".weight")] + suffix] if n in packed else v for n, v in plain.items()
        }

    tree = sanitize(plain)
    _attach(tree, sanitize(beside(SCALES)), sanitize(beside(BIASES)), group_size)
    return tree


def _attach(tree, scales, biases, group_size: int) -> None:
    """Beside each packed (uint32) leaf of `tree`, the leaves at the same path of `scales`
    and `biases` and its (bits, group_size) constants."""
    if isinstance(tree, list):
        for index, child in enumerate(tree):
            _attach(child, scales[index], biases[index], group_size)
        return
    for key in list(tree):
        value = tree[key]
        if isinstance(value, (dict, list)):
            _attach(value, scales[key], biases[key], group_size)
        elif value.dtype == mx.uint32:
            tree[key + SCALES], tree[key + BIASES] = scales[key], biases[key]
            columns = scales[key].shape[-1] * group_size
            tree[key + SPEC] = (value.shape[-1] * PACKED_BITS // columns, group_size)


def quantize_stored_module(
    module: nn.Module, weights: dict[str, mx.array], group_size: int
) -> None:
    """Make the module's layers whose weights are stored quantized (`path.scales` among
    `weights`, as mlx-lm decides) quantized layers (this module's `QuantizedLinear`, MLX's
    `QuantizedEmbedding`), ready for `load_weights`, each at the width its packed weight's
    shape gives (a GGUF file mixes widths)."""

    def stored(path: str, layer: nn.Module) -> Quantization | None:
        scales = weights.get(path + SCALES)
        if scales is None:
            return None
        packed = weights[path + ".weight"]
        bits = packed.shape[-1] * PACKED_BITS // (scales.shape[-1] * group_size)
        return Quantization(bits, group_size)

    swap_quantized(module, stored)


def swap_quantized(
    module: nn.Module, picks: Callable[[str, nn.Module], Quantization | None]
) -> None:
    """Replace, in place, the module's `nn.Linear` and `nn.Embedding` leaves for which `picks`
    (module path, layer) gives a quantization by quantized ones at it (as `nn.quantize` does,
    linears with this module's `QuantizedLinear`); their weights are still to be loaded
    (`Module.load_weights`)."""

    def swap(path: str, layer: nn.Module) -> nn.Module:
        if not isinstance(layer, (nn.Linear, nn.Embedding)):
            return layer
        quantization = picks(path, layer)
        if quantization is None:
            return layer
        size, bits = quantization.group_size, quantization.bits
        if isinstance(layer, nn.Linear):
            return QuantizedLinear.from_linear(layer, size, bits, mode=MODE)
        return nn.QuantizedEmbedding.from_embedding(layer, size, bits, mode=MODE)

    leaves = tree_map_with_path(swap, module.leaf_modules(), is_leaf=nn.Module.is_module)
    module.update_modules(leaves)


def quantizable(value: mx.array, quantization: Quantization) -> bool:
    """A float matrix whose rows the group size divides."""
    return (
        value.ndim == 2
        and mx.issubdtype(value.dtype, mx.floating)
        and value.shape[1] % quantization.group_size == 0
    )


def quantized(value: mx.array, quantization: Quantization) -> tuple[mx.array, ...]:
    """(packed, scales, biases) of a matrix, evaluated."""
    packed, scales, biases = mx.quantize(
        value, quantization.group_size, quantization.bits, mode=MODE
    )
    mx.eval(packed, scales, biases)
    return packed, scales, biases
