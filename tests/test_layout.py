"""The trainer's layout choice (`training.layout`, `TrainerConfig.pack_groups="auto"`): the work
each layout does, its cost, and which one a batch gets. Host side only (no compilation)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tbajax.config import apply_overrides
from tbajax.main import load_experiment
from tbajax.models.config import ModelConfig
from tbajax.training import TrainerConfig
from tbajax.training.collate import collate
from tbajax.training.layout import (
    LayoutWork,
    batch_layout,
    causal_pairs,
    cheapest,
    configured_layouts,
    layout_work,
    step_cost,
)
from tbajax.trajectory import Trajectory

TINY = ModelConfig(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=2,
                   num_heads=2, num_kv_heads=1, head_dim=4)
# the 50M Llama of `experiments/benchmarks/packed_groups.py`, whose three layouts were timed
LLAMA_50M = ModelConfig(model_type="llama", vocab_size=16384, hidden_size=512, intermediate_size=1536,
                        num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64)


def groups_of(prompt: int, responses: list[list[int]], seed: int = 0) -> list[list[Trajectory]]:
    """One group per list of response lengths, each with its own random prompt of `prompt` tokens."""
    r = np.random.default_rng(seed)
    out = []
    for g, lengths in enumerate(responses):
        p = r.integers(3, 1000, prompt).astype(np.int32)
        out.append([Trajectory(g, g, p, r.integers(3, 1000, n).astype(np.int32), np.zeros(n, np.float32), 0.0)
                    for n in lengths])
    return out


def in_layout(groups: list[list[Trajectory]], layout: str, **kwargs):
    return collate(groups, beta=0.1, pack_microbatches=None if layout == "rows" else 1,
                   pack_strided=layout == "strided", **kwargs)


def test_causal_pairs_hand_values():
    # 16 queries: one block, the whole 16 x 16 square
    assert causal_pairs(16) == 256
    # 64: two blocks of 32, over 32 and 64 keys
    assert causal_pairs(64) == 32 * 32 + 32 * 64
    # 128 after 10 keys in front: four blocks of 32 over 10 + 32, 10 + 64, 10 + 96, 10 + 128 keys
    assert causal_pairs(128, keys_before=10) == 32 * (42 + 74 + 106 + 138)
    assert causal_pairs(0) == 0


def test_layout_work_of_each_layout():
    # a prompt of 40 and responses of 20, 30 and 25 tokens; 32-token buckets
    groups = groups_of(40, [[20, 30, 25]])
    rows, packed, strided = (in_layout(groups, lay) for lay in ("rows", "packed", "strided"))
    assert [batch_layout(b) for b in (rows, packed, strided)] == ["rows", "packed", "strided"]
    # rows: 3 x 96 slots (70 bucketed), each causal in 2 blocks of 48
    assert rows.tokens.shape == (3, 96)
    assert layout_work(rows) == LayoutWork(slots=288, pairs=3 * (48 * 48 + 48 * 96),
                                           scored=3 * rows.scored.shape[1])
    # packed: one row of 40 + 75 = 115 slots, bucketed to 128; below PACKED_CAUSAL_BLOCKS_MIN the
    # whole square
    assert packed.packed.tokens.shape == (1, 128)
    assert layout_work(packed) == LayoutWork(slots=128, pairs=128 * 128, scored=packed.packed.scored.shape[1])
    # strided: the prompt in 64 slots, 3 responses of 32: 64 x 64 in 2 blocks of 32, and each
    # response's 32 queries in one block over 64 + 32 keys
    assert strided.packed.tokens.shape == (1, 64 + 3 * 32)
    assert layout_work(strided) == LayoutWork(slots=160, pairs=(32 * 32 + 32 * 64) + 3 * 32 * 96,
                                              scored=strided.packed.scored.shape[1])


def test_step_cost_hand_value():
    # layer params: norms 2 x 8, q 64, k 32, v 32, o 64, gate / up / down 3 x 128 = 592: 1184 FLOPs
    # a slot; a pair 4 x 2 heads x 4 = 32 per layer; the head 2 x 8 x 10 = 160 per scored slot
    work = LayoutWork(slots=10, pairs=100, scored=5)
    assert step_cost(work, TINY, attention_weight=2.0) == 2 * (10 * 1184 + 2.0 * 100 * 32) + 5 * 160
    assert step_cost(work, TINY, attention_weight=1.0) == 2 * (10 * 1184 + 100 * 32) + 5 * 160
    # the layers' part is the rule the sampler's packed scoring uses too (`packing_is_cheaper`)
    assert TINY.layers_forward_flops(10, 100) == 2 * (10 * 1184 + 100 * 32)
    assert TINY.layers_forward_flops(10, 100, attention_weight=2.0) == 2 * (10 * 1184 + 2.0 * 100 * 32)


@pytest.mark.parametrize("prompt,responses,want", [
    # the three shapes `packed_groups.py` timed (responses R/2..R; `packed_groups_*_shape.json`)
    (160, (8, 16), "packed"),  # short answers: packed 4.29x rows, strided 3.11x
    (128, (128, 256), "strided"),  # math-like: strided 1.30x, packed 1.10x
    (128, (256, 512), "strided"),  # long: strided 1.16x, packed 0.99x
])
def test_auto_picks_the_layout_that_ran_fastest(prompt, responses, want):
    r = np.random.default_rng(0)
    groups = groups_of(prompt, [list(r.integers(responses[0], responses[1] + 1, 8)) for _ in range(2)])
    batches = [in_layout(groups, lay) for lay in ("rows", "packed", "strided")]
    for weight in (1.0, 2.0, 6.0):
        assert batch_layout(cheapest(batches, LLAMA_50M, weight)) == want


def test_auto_keeps_rows_without_a_prompt_to_share():
    # one sample per prompt: the packed row is the row itself, and ties go to the first (rows)
    groups = groups_of(64, [[40], [30]])
    batches = [in_layout(groups, lay) for lay in ("rows", "packed", "strided")]
    assert batch_layout(cheapest(batches, LLAMA_50M, 2.0)) == "rows"
    with pytest.raises(ValueError, match="at least one"):
        cheapest([], LLAMA_50M, 2.0)


def test_configured_layouts():
    base = TrainerConfig()
    assert configured_layouts(base) == ("rows",)
    assert configured_layouts(dataclasses.replace(base, pack_groups=True)) == ("packed",)
    assert configured_layouts(dataclasses.replace(base, pack_groups=True, pack_strided=True)) == ("strided",)
    auto = dataclasses.replace(base, pack_groups="auto")
    assert configured_layouts(auto) == ("rows", "packed", "strided")
    # an objective that reads prompt features (a log Z head) needs the row layout
    assert configured_layouts(auto, prompt_features=True) == ("rows",)


def test_auto_config_errors_and_override():
    with pytest.raises(ValueError, match="leave pack_strided=false"):
        TrainerConfig(pack_groups="auto", pack_strided=True)
    with pytest.raises(ValueError, match="true, false or 'auto'"):
        TrainerConfig(pack_groups="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layout_attention_weight"):
        TrainerConfig(pack_groups="auto", layout_attention_weight=0.0)
    config = apply_overrides(load_experiment("tiny_arithmetic"), ["train.trainer.pack_groups=auto",
                                                                  "train.trainer.layout_attention_weight=3"])
    assert config.train.trainer.pack_groups == "auto"
    assert config.train.trainer.layout_attention_weight == 3.0
