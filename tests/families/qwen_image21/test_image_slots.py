"""The wire rule of image slots, in the one place the route and the engine share."""

from __future__ import annotations

import pytest
from gmlx_server.engine.base import EngineInputError, kept_image_slots
from gmlx_server.engine.families.qwen_image21.step import wire_slots


def test_kept_slots_drop_extras_and_keep_order_within_the_text():
    assert kept_image_slots([0, 3, 9], 2, 5) == (0, 3)  # one slot per reference at most
    assert kept_image_slots([2, 2], 2, 5) == (2, 2)  # equal adjacent slots are ascending
    assert kept_image_slots([], 2, 5) == ()
    assert kept_image_slots([5], 1, 5) == (5,)  # before "no text row": after the text


@pytest.mark.parametrize(
    ("slots", "message"), [([6], "within 0..5"), ([-1], "within 0..5"), ([3, 1], "ascending")]
)
def test_slots_outside_the_text_or_descending_are_refused(slots, message):
    with pytest.raises(EngineInputError, match=message):
        kept_image_slots(slots, 2, 5)


def test_qwen_puts_references_without_a_slot_after_the_text():
    assert wire_slots([1], 3, 7) == (1, 7, 7)
    with pytest.raises(EngineInputError, match="ascending"):
        wire_slots([4, 2], 2, 7)
