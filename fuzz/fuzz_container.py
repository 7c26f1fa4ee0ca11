"""Coverage-guided fuzzing of the container reader (gmlx_contract.wire) with atheris.

Property per input: `read_container` returns or raises `WireError` (a 400), never anything
else; and what it returns survives a round trip through the writer unchanged (same tensor
names, dtypes, shapes, bytes and fields).

Each input is tried twice: as a whole body, and framed (the bytes before the first NUL as the
header, the rest as the data section, with a length prefix that fits), so mutations of the header
JSON reach the checks behind the length prefix. fuzz/container.dict gives the fuzzer the
header's words.

    .venv/bin/python fuzz/fuzz_container.py --seeds fuzz/corpus      # write the seed corpus
    .venv/bin/python fuzz/fuzz_container.py fuzz/corpus -dict=fuzz/container.dict \
        -max_total_time=600 -rss_limit_mb=4096 -artifact_prefix=/tmp/

Crashes are written by libFuzzer as crash-<sha1> in the working folder; replay one with
`.venv/bin/python fuzz/fuzz_container.py crash-<sha1>`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris
import numpy as np

with atheris.instrument_imports():
    from gmlx_contract import wire
    from gmlx_contract.errors import WireError


def check_input(data: bytes) -> None:
    check_one(data)
    header, _, section = data.partition(b"\0")
    check_one(len(header).to_bytes(8, "little") + header + section)


def check_one(data: bytes) -> None:
    try:
        container = wire.read_container(data)
    except WireError:
        return
    again = wire.read_container(
        wire.write_container(container.tensors, container.fields, container.dtypes)
    )
    assert again.dtypes == container.dtypes
    assert wire.encode_fields(again.fields) == wire.encode_fields(container.fields)
    for name, array in container.tensors.items():
        assert again.tensors[name].shape == array.shape
        assert bytes(again.raw(name)) == bytes(container.raw(name))


def write_seeds(folder: Path) -> None:
    """A few valid containers and near misses for the fuzzer to start from."""
    folder.mkdir(parents=True, exist_ok=True)
    seeds = {
        "one_f32": wire.write_container({"t": np.array([[1.0, 2.0]], np.float32)}),
        "fields": wire.write_container(
            {"x": np.zeros((1, 4, 2, 2), np.float32), "timestep": np.ones(1, np.float32)},
            {"rows": [{"cond": "0" * 64, "num_tokens": 3}], "run": None},
        ),
        "every_dtype": wire.write_container(
            {
                "a": np.ones(3, np.float32),
                "b": np.ones((2, 1), np.float16),
                "c": np.arange(4, dtype=np.uint16),
                "d": np.arange(5, dtype=np.uint8),
                "e": np.array([True, False]),
                "s": np.float32(7.0),
                "z": np.zeros((0, 3), np.float32),
            },
            {"alpha": True},
        ),
        "no_tensors": wire.write_container({}, {"text": "a prompt"}),
        "short": b"\x08\x00\x00\x00",
    }
    for name, body in seeds.items():
        (folder / name).write_bytes(body)
        header_len = int.from_bytes(body[:8], "little")
        framed = body[8 : 8 + header_len] + b"\0" + body[8 + header_len :]
        (folder / f"{name}.framed").write_bytes(framed)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--seeds":
        write_seeds(Path(sys.argv[2]))
        return
    atheris.Setup(sys.argv, check_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
