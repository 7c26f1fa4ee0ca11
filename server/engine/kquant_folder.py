"""`gmlx model quantize SOURCE DESTINATION --kquant PRESET`: a copy of a model folder whose DiT is
one GGUF file of llama.cpp's K-quants, encoded by `mlx-kquant` (the `kquant` extra), which the
server loads as any GGUF DiT (engine/gguf.py: held as the file's blocks).

The presets mix types as llama.cpp's of the same names do, by tensor kind:
- `q4_k_m`, `q5_k_m`: Q4_K (Q5_K) for the matrices the family quantizes at load, and Q6_K for
  the attention value and feed-forward output matrices of the blocks llama.cpp's
  `use_more_bits` picks (the first and last eighth, and every third between);
- `q6_k`, `q8_0`: that type for every one of them.
A matrix whose input width the type's block does not divide takes llama.cpp's fallback (Q5_0
for a K-quant of 4 or 5 bits, Q8_0 for Q6_K), or stays float when no block divides it. Every
other tensor keeps its dtype (F32, F16 or BF16). The text encoder and the VAE are copied as
they are.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as T

from .load_settings import KQUANT_PRESETS
from .weights import weight_files, written_whole

# preset -> (the type of the matrices, the type of the "more bits" ones)
PRESETS = dict(
    zip(
        KQUANT_PRESETS,
        ((T.Q4_K, T.Q6_K), (T.Q5_K, T.Q6_K), (T.Q6_K, T.Q6_K), (T.Q8_0, T.Q8_0)),
        strict=True,
    )
)
# llama.cpp's attn_v and ffn_down, under the families' diffusers names.
MORE_BITS = re.compile(
    r"(\.to_v|\.add_v_proj|\.v_proj|\.img_mlp\.out|\.ff\.net\.2|\.ff_context\.net\.2"
    r"|\.ff\.linear_out|\.ff_context\.linear_out|\.feed_forward\.w2)\.weight$"
)
FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_0, T.Q6_K: T.Q8_0}
FLOATS = {mx.float32: T.F32, mx.float16: T.F16, mx.bfloat16: T.BF16}
INSTALL = (
    "--kquant needs mlx-kquant, the `kquant` extra (macOS: pip install -e '.[kquant]'; on"
    " Linux build its sdist with pip install mlx-kquant in a venv of mlx 0.32.3)"
)


def kquant_module():
    """mlx-kquant, or a RuntimeError saying how to install it."""
    try:
        import mlx_kquant
    except ImportError:
        raise RuntimeError(INSTALL) from None
    return mlx_kquant


def preset_types(preset: str, blocks: int) -> Callable[[str, tuple[int, ...]], T | None]:
    """(file name, shape) -> the GGUF type a picked matrix takes under `preset` (None: it stays
    float), for a DiT of `blocks` blocks (numbered by the first index in a name)."""
    base, more = PRESETS[preset]

    def more_bits(index: int) -> bool:  # llama.cpp's use_more_bits
        eighth = blocks // 8
        return index < eighth or index >= 7 * blocks // 8 or (index - eighth) % 3 == 2

    def kind(name: str, shape: tuple[int, ...]) -> T | None:
        index = re.search(r"\.(\d+)\.", name)
        wanted = base
        if MORE_BITS.search(name) and index is not None and more_bits(int(index[1])):
            wanted = more
        for candidate in (wanted, FALLBACK.get(wanted), T.Q8_0):
            if candidate is not None and shape[-1] % gguf.GGML_QUANT_SIZES[candidate][0] == 0:
                return candidate
        return None

    return kind


def write_kquant_folder(
    source: Path, destination: Path, preset: str, include: Callable[[str], bool]
) -> dict[str, int]:
    """Write `destination` (which must not exist): `source` with its transformer/ weights as one
    GGUF file of `preset`, the matrices `include` picks (by file name) encoded by mlx-kquant,
    one tensor at a time. Returns how many tensors of each type the file holds."""
    kq = kquant_module()
    if preset not in PRESETS:
        raise ValueError(f"--kquant must be one of {', '.join(PRESETS)}, not {preset!r}")
    source = Path(source)
    with written_whole(destination) as folder:
        for item in sorted(source.iterdir()):
            if item.name != "transformer":
                copy = shutil.copytree if item.is_dir() else shutil.copy2
                copy(item, folder / item.name)
        target = folder / "transformer"
        target.mkdir()
        shutil.copy2(source / "transformer" / "config.json", target / "config.json")
        gguf_file = target / f"diffusion_pytorch_model-{preset}.gguf"
        return write_kquant_gguf(source / "transformer", gguf_file, preset, include, kq)


def write_kquant_gguf(
    component: Path, path: Path, preset: str, include: Callable[[str], bool], kq: Any
) -> dict[str, int]:
    """The GGUF file `path` of a component folder's weights, the matrices `include` picks
    encoded by mlx-kquant at `preset`'s type for their block, the rest as they are stored;
    how many tensors of each type it holds."""
    tensors = {}
    for weights in weight_files(component):
        tensors.update(mx.load(str(weights)))
    blocks = 1 + max((int(m[1]) for n in tensors if (m := re.search(r"\.(\d+)\.", n))), default=0)
    kind_of = preset_types(preset, blocks)
    writer = gguf.GGUFWriter(str(path), arch="")
    writer.kv_data[0].pop(gguf.Keys.General.ARCHITECTURE, None)
    counts: dict[str, int] = {}
    for name in sorted(tensors):
        value = tensors[name]
        kind = kind_of(name, value.shape) if value.ndim == 2 and include(name) else None
        if kind is None:
            kind = FLOATS[value.dtype]
            # bf16 as its bytes (numpy has no bfloat16)
            data = (
                np.array(value.view(mx.uint16)).view(np.uint8)
                if kind == T.BF16
                else np.array(value)
            )
        else:
            encoded, _ = kq.quantize(value.astype(mx.float32), kind.name.lower())
            data = np.array(encoded)
        writer.add_tensor(name, data, raw_dtype=None if kind in (T.F32, T.F16) else kind)
        counts[kind.name] = counts.get(kind.name, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dict(sorted(counts.items()))
