"""Connection.ensure_adapters: each adapter matrix goes through StepClient.ensure_adapter once."""

import numpy as np
import pytest
from gmlx_comfy.connection import Connection
from gmlx_comfy.errors import GmlxError
from gmlx_contract.hashing import tensor_hash


class RecordingClient:
    """Stands for StepClient's ensure_adapter (HEAD, PUT if absent): records what went up."""

    def __init__(self) -> None:
        self.ensured: list[str] = []

    def ensure_adapter(self, array: np.ndarray, dtype: str | None = None) -> str:
        digest = tensor_hash(array, dtype)
        self.ensured.append(digest)
        return digest


def _connection() -> Connection:
    return Connection(url="http://x", api_key=None, client=RecordingClient(), capabilities={})


def _matrices(seed: int, count: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal((4, 8), dtype=np.float32) for _ in range(count)]
    return {tensor_hash(a): a for a in arrays}


def test_each_adapter_is_ensured_once_per_connection():
    conn = _connection()
    first, second = _matrices(0, 2), _matrices(1, 1)
    conn.ensure_adapters(first)
    conn.ensure_adapters({**first, **second})  # a new table naming old and new matrices
    assert conn.client.ensured == [*first, *second]
    assert conn.adapters_held == {*first, *second}


def test_an_adapter_named_by_the_wrong_hash_is_refused_and_not_held():
    conn = _connection()
    ((digest, array),) = _matrices(2, 1).items()
    wrong = "0" * 64
    with pytest.raises(GmlxError, match=wrong):
        conn.ensure_adapters({wrong: array})
    assert conn.adapters_held == set()
    conn.ensure_adapters({digest: array})
    assert conn.adapters_held == {digest}
