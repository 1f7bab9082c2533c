"""Host-side packing of prompt groups (`tbajax.packing`) and the shape buckets it is padded to."""

from __future__ import annotations

import numpy as np
import pytest

from tbajax.packing import group_by_prompt, pack_prompt_groups, packed_width, response_windows
from tbajax.shapes import pow2_steps_bucket


def test_pack_prompt_groups_hand_values():
    prompts = [np.array([7, 8]), np.array([5])]
    responses = [[np.array([9, 10]), np.array([11])], [np.array([], np.int32), np.array([6, 6, 6])]]
    assert packed_width(prompts, responses) == 5
    rows = pack_prompt_groups(prompts, responses, width=6, rows=3)
    np.testing.assert_array_equal(rows.tokens, [[7, 8, 9, 10, 11, 0], [5, 6, 6, 6, 0, 0], [0] * 6])
    np.testing.assert_array_equal(rows.positions, [[0, 1, 2, 3, 2, 0], [0, 1, 2, 3, 0, 0], [0] * 6])
    np.testing.assert_array_equal(rows.segments, [[0, 0, 1, 1, 2, -1], [0, 2, 2, 2, -1, -1], [-1] * 6])
    assert rows.starts == ((2, 4), (1, 1))  # an empty response starts where the next one does
    with pytest.raises(ValueError, match="needs 5 slots"):
        pack_prompt_groups(prompts, responses, width=4)
    with pytest.raises(ValueError, match="do not fit in 1 rows"):
        pack_prompt_groups(prompts, responses, width=6, rows=1)
    with pytest.raises(ValueError, match="group 0 has an empty prompt"):
        pack_prompt_groups([np.array([], np.int32)], [[np.array([3])]], width=4)


def test_group_by_prompt_keeps_first_appearance_order():
    prompts = [np.array([1, 2]), np.array([3]), np.array([1, 2]), np.array([1]), np.array([3])]
    assert group_by_prompt(prompts) == [[0, 2], [1, 4], [3]]


def test_pow2_steps_bucket_hand_values():
    got = [pow2_steps_bucket(n, 16) for n in (1, 16, 17, 24, 25, 33, 129, 192, 193, 1200)]
    assert got == [16, 16, 24, 24, 32, 48, 192, 192, 256, 1536]
    got = [pow2_steps_bucket(n, 16, steps=4) for n in (1, 17, 21, 100, 112, 113, 200, 700)]
    assert got == [16, 20, 24, 112, 112, 128, 224, 768]
    assert [pow2_steps_bucket(n, 1, steps=4) for n in (1, 2, 3, 5, 7, 9)] == [1, 2, 4, 5, 7, 10]


def test_response_windows_hand_values():
    slots, real = response_windows([2, 1], [2, 3], rows=3, seq=5, width=4)
    np.testing.assert_array_equal(slots, [[2, 3, 4, 4], [1, 2, 3, 4], [1, 2, 3, 4]])  # the end repeats
    np.testing.assert_array_equal(real, [[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]])  # a filler row: none
    with pytest.raises(ValueError, match="slot >= 1"):
        response_windows([0], [1], rows=1, seq=4, width=2)
