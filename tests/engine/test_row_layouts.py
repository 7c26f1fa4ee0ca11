"""dit_network.by_layout: a batch whose rows differ in layout runs one batch per layout and
answers in row order; one layout runs once, on the arrays as they are."""

import mlx.core as mx
import numpy as np
from gmlx_server.engine.dit_network import by_layout, rows_of, stacked_references


def test_rows_of_two_layouts_run_apart_and_answer_in_row_order():
    x = mx.arange(12, dtype=mx.float32).reshape(4, 3)
    runs = []

    def run(rows):
        runs.append(rows)
        return rows_of(x, rows) * 10 + len(rows)

    out = by_layout(["a", "b", "a", "b"], run)
    assert runs == [[0, 2], [1, 3]]
    np.testing.assert_array_equal(np.array(out), np.array(x) * 10 + 2)


def test_one_layout_runs_once_on_the_arrays_as_they_are():
    x = mx.zeros((3, 2))
    seen = []

    def run(rows):
        seen.append(rows_of(x, rows))
        return seen[-1]

    assert by_layout([(5, ())] * 3, run) is x
    assert len(seen) == 1
    assert rows_of(x, [2, 0]).shape == (2, 2)


def test_the_rows_references_stack_one_batch_per_reference():
    first, second = mx.ones((2, 3, 3)), mx.zeros((2, 5, 4))
    stacked = stacked_references([[first, second], [first * 2, second]])
    assert [tuple(batch.shape) for batch in stacked] == [(2, 2, 3, 3), (2, 2, 5, 4)]
    np.testing.assert_array_equal(np.array(stacked[0][1]), np.full((2, 3, 3), 2.0))
    assert stacked_references([[], []]) == []
