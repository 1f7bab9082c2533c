"""The red-teaming replay buffer in the trainer (`BufferConfig(mode="reward_heap")`, HeapReplayBuffer).

Hand-built rows of one shared prompt with known toxicities; statistical checks use fixed seeds
and 5-sigma bounds (deterministic; they would only fail on a real bias).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tbajax.buffer import BufferConfig, BufferEmptyError, HeapReplayBuffer, make_buffer
from tbajax.buffer.heap_buffer import attack_tokens, trajectory_from_json, trajectory_to_json
from tbajax.trajectory import RewardStatus, Trajectory

PROMPT = np.array([1, 7, 8, 9], np.int32)
EOS = 2


def row(tokens, *, reward=0.0, tox=0.5, version=0, group=0, searcher=0, finished=False, prompt=PROMPT,
        extras=None) -> Trajectory:
    t = np.asarray(tokens, np.int32)
    ex = {"toxicity": [tox, tox], "attack": " ".join(map(str, tokens))} if extras is None else extras
    return Trajectory(prompt_id=0, group_id=group, prompt_tokens=prompt, response_tokens=t,
                      behavior_logprobs=np.linspace(-1, -2, len(t)).astype(np.float32), reward=reward,
                      finished=finished, policy_version=version, searcher_id=searcher, wall_time=1.5,
                      extras=ex)


def far(i: int, n: int = 6) -> list[int]:
    """Attacks i = 0, 1, ... that are never near-duplicates of each other (disjoint tokens)."""
    return [100 + n * i + j for j in range(n)]


def cfg(**kw) -> BufferConfig:
    base = dict(mode="reward_heap", samples_per_group=2, capacity_per_prompt=8, recency_prob=0.5,
                reward_inv_temp=1.0)
    return BufferConfig(**(base | kw))


def key(t: Trajectory) -> tuple:
    return (tuple(int(x) for x in t.response_tokens), int(t.policy_version), float(t.reward), int(t.group_id))


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(mode="heap"), "mode"),
        (dict(mode="reward_heap", heap_priority="toxicity"), "heap_priority"),
        (dict(mode="reward_heap", edit_tolerance=1.5), "edit_tolerance"),
        (dict(mode="reward_heap", cosine_tolerance=-2.0), "cosine_tolerance"),
        (dict(mode="reward_heap", max_staleness=3), "max_staleness"),
        (dict(mode="reward_heap", samples_per_group=9, capacity_per_prompt=8), "capacity"),
    ],
)
def test_config_rejects_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        BufferConfig(**kw)


def test_make_buffer_and_the_experiment_config_accept_the_mode():
    from tbajax.config import ConfigError, ExperimentConfig, RolloutSpec, apply_overrides
    from tbajax.sampling import SamplingConfig

    base = ExperimentConfig(name="x", rollout=RolloutSpec(sampling=SamplingConfig(num_samples=20)))

    assert type(make_buffer(cfg())) is HeapReplayBuffer
    exp = apply_overrides(base, ["buffer.mode=reward_heap", "buffer.heap_priority=reward",
                                                       "buffer.edit_tolerance=null"])
    assert (exp.buffer.mode, exp.buffer.heap_priority, exp.buffer.edit_tolerance) == ("reward_heap", "reward", None)
    with pytest.raises((ConfigError, ValueError), match="heap_priority"):
        apply_overrides(base, ["buffer.heap_priority=tox"])


def test_attack_tokens_strip_the_stop_token_of_finished_rows():
    assert attack_tokens(row([5, 6, EOS], finished=True)) == (5, 6)
    assert attack_tokens(row([5, 6, EOS], finished=False)) == (5, 6, EOS)


def test_half_online_half_replay_and_replay_follows_softmax_of_log_toxicity():
    """m = 0.5 over 4000 one-group steps; replay draws follow softmax(log toxicity) = toxicity / sum."""
    buf = make_buffer(cfg(samples_per_group=1, capacity_per_prompt=4))
    tox = [0.1, 0.2, 0.4, 0.8]
    buf.add([row(far(i), reward=10.0 + i, tox=tox[i], version=0, group=i) for i in range(4)])
    # newer, low-reward attacks: the full heap refuses them (capacity), the online set holds them
    buf.add([row(far(10 + i), reward=-5.0, tox=0.01, version=1, group=10 + i) for i in range(3)])
    s = buf.stats()
    assert s["heap"]["capacity_drops"] == 3 and s["num_rows"] == 4 and s["num_online_rows"] == 3
    n = 4000
    online_rows, replay_tokens = 0, []
    for i in range(n):
        (g,) = buf.sample(np.random.default_rng((3, i)), 1)
        assert len(g) == 1
        if g[0].policy_version == 1:
            online_rows += 1
        else:
            replay_tokens.append(g[0].response_tokens[0])
    s = buf.stats()
    assert s["groups_online"] == s["batches_online"] == online_rows and s["groups_replay"] == n - online_rows
    assert s["online_fallbacks"] == s["replay_fallbacks"] == 0
    assert abs(online_rows / n - 0.5) < 5 * np.sqrt(0.25 / n)
    probs = np.array(tox) / sum(tox)
    counts = np.array([np.sum(np.array(replay_tokens) == far(i)[0]) for i in range(4)])
    m = len(replay_tokens)
    assert np.all(np.abs(counts / m - probs) < 5 * np.sqrt(probs * (1 - probs) / m)), (counts / m, probs)
    # the trainer's record gets the counters
    em = s["extra_metrics"]
    assert em["heap_size"] == 4 and em["heap_capacity_drops"] == 3 and em["groups_online"] == online_rows


def test_online_or_replay_is_decided_per_batch():
    buf = make_buffer(cfg(samples_per_group=1, capacity_per_prompt=4))
    buf.add([row(far(i), reward=10.0 + i, version=0, group=i) for i in range(4)])
    buf.add([row(far(10 + i), reward=-5.0, version=1, group=10 + i) for i in range(4)])
    kinds = set()
    for i in range(200):
        versions = {t.policy_version for g in buf.sample(np.random.default_rng((4, i)), 4) for t in g}
        assert len(versions) == 1  # all 4 groups online (version 1) or all replay (version 0)
        kinds |= versions
    s = buf.stats()
    assert kinds == {0, 1} and s["batches_online"] + s["batches_replay"] == 200
    assert s["groups_online"] == 4 * s["batches_online"]


def test_groups_have_k_rows_of_the_one_prompt_and_online_rows_are_not_reused_within_a_step():
    buf = make_buffer(cfg(samples_per_group=3, capacity_per_prompt=30, recency_prob=1.0))
    buf.add([row(far(i), reward=float(i), version=0, group=i // 3) for i in range(9)])
    groups = buf.sample(np.random.default_rng(0), 3)
    assert [len(g) for g in groups] == [3, 3, 3]
    flat = [key(t) for g in groups for t in g]
    assert len(set(flat)) == 9  # three online groups use all 9 online rows, none twice
    assert all(np.array_equal(t.prompt_tokens, PROMPT) for g in groups for t in g)
    # a fourth online group has no unused online rows left: it falls back to the heap
    groups = buf.sample(np.random.default_rng(1), 4)
    assert buf.stats()["online_fallbacks"] == 1 and len(groups) == 4
    with pytest.raises(ValueError, match="one shared prompt"):
        buf.add([row(far(50), prompt=np.array([1, 2], np.int32))])


def test_online_set_newest_version_without_syncs_then_since_the_previous_sync():
    buf = make_buffer(cfg(samples_per_group=1, recency_prob=1.0))
    buf.add([row(far(0), version=0, group=0)])
    buf.add([row(far(1), version=1, group=1), row(far(2), version=1, group=1)])
    assert buf.stats()["num_online_rows"] == 2  # sync mode: the batch just generated (newest version)
    buf.mark_sync(1)
    buf.mark_sync(2)  # async: rows sampled with params >= the previous sync (1)
    buf.add([row(far(3), version=2, group=2)])
    assert buf.stats()["num_online_rows"] == 3
    buf.mark_sync(3)
    assert buf.stats()["num_online_rows"] == 1


def test_dedup_exact_and_near_duplicates_through_the_buffer():
    buf = make_buffer(cfg(capacity_per_prompt=10))
    buf.add([row([5, 6, 7, 8, EOS], reward=1.0, finished=True, group=0)])
    buf.add([row([5, 6, 7, 8], reward=3.0, group=1)])  # same attack cut at max tokens: exact duplicate
    buf.add([row([5, 6, 7, 9], reward=0.5, group=2)])  # distance 1 < 0.25 * 8: near, worse -> dropped
    s = buf.stats()["heap"]
    assert (s["exact_duplicates"], s["near_duplicate_drops"], s["accepted"], s["size"]) == (1, 1, 1, 1)
    buf.add([row([5, 6, 7, 9], reward=2.0, group=3)])  # near, better -> replaces
    buf.add([row(far(1), reward=0.0, group=4)])  # far from both: kept
    s = buf.stats()
    assert s["heap"]["near_duplicate_replacements"] == 1 and s["num_rows"] == 2
    assert sorted(r for r in (t.reward for t in buf._rows.values())) == [0.0, 2.0]
    assert s["extra_metrics"]["heap_near_duplicate_drops"] == 1 and s["extra_metrics"]["heap_accepted"] == 3
    # edit-distance dedup off: the near-duplicate is kept
    off = make_buffer(cfg(edit_tolerance=None))
    off.add([row([5, 6, 7, 8], reward=1.0), row([5, 6, 7, 9], reward=0.5)])
    assert len(off) == 2


def test_cosine_dedup_needs_embeddings():
    buf = make_buffer(cfg(edit_tolerance=None, cosine_tolerance=0.9))
    with pytest.raises(ValueError, match="embedding"):
        buf.add([row(far(0))])
    e = lambda v, r, g: row(far(g), reward=r, group=g, extras={"toxicity": [0.5], "embedding": v})  # noqa: E731
    buf.add([e([1.0, 0.0], 1.0, 0), e([0.99, 0.05], 0.5, 1), e([0.0, 1.0], 0.5, 2)])
    assert len(buf) == 2 and buf.stats()["heap"]["near_duplicate_drops"] == 1


def test_eviction_lowest_reward_first_and_failed_grades_dropped():
    buf = make_buffer(cfg(capacity_per_prompt=3, samples_per_group=1))
    buf.add([row(far(i), reward=r, group=i) for i, r in enumerate([2.0, 1.0, 3.0])])
    buf.add([row(far(3), reward=2.5, group=3)])  # evicts the 1.0
    buf.add([row(far(4), reward=0.5, group=4)])  # worse than the worst: refused
    buf.add([row(far(5), reward=9.0, group=5)])  # evicts the 2.0
    assert sorted(t.reward for t in buf._rows.values()) == [2.5, 3.0, 9.0]
    s = buf.stats()["extra_metrics"]
    assert s["heap_evictions"] == 2 and s["heap_capacity_drops"] == 1
    bad = Trajectory(prompt_id=0, group_id=9, prompt_tokens=PROMPT, response_tokens=np.array([5], np.int32),
                     behavior_logprobs=np.zeros(1, np.float32), reward=99.0, reward_status=RewardStatus.ERROR)
    buf.add([bad])
    assert buf.stats()["failed_grade_drops"] == 1 and len(buf) == 3
    with pytest.raises(ValueError, match="extras\\['toxicity'\\]"):
        buf.add([row(far(7), extras={"attack": "x"}, group=10)])


def test_too_little_data_raises_before_drawing():
    buf = make_buffer(cfg(samples_per_group=4))
    rng = np.random.default_rng(0)
    before = rng.bit_generator.state
    with pytest.raises(BufferEmptyError):
        buf.sample(rng, 1)
    buf.add([row(far(i), version=0, group=i) for i in range(3)])
    with pytest.raises(BufferEmptyError, match="wait for searchers"):
        buf.sample(rng, 1)
    assert rng.bit_generator.state == before
    wait = make_buffer(cfg(samples_per_group=2, recency_fallback="wait"))
    wait.add([row(far(i), version=0, group=i) for i in range(3)])
    wait.sample(np.random.default_rng(0), 1)
    wait.mark_sync(1)
    wait.mark_sync(2)  # the online set (versions >= 1) is empty now
    with pytest.raises(BufferEmptyError, match="online"):
        wait.sample(np.random.default_rng(0), 1)


def _stream(start: int, n: int, searchers: int = 2) -> list[Trajectory]:
    """Generation calls of 3 attacks each, searchers interleaved, versions rising; near-duplicates
    and duplicates included (attacks drawn from a small alphabet)."""
    rng = np.random.default_rng(start)
    rows = []
    for c in range(start, start + n):
        sid = c % searchers
        for _ in range(3):
            length = int(rng.integers(2, 6))
            rows.append(row(list(rng.integers(10, 14, size=length)) + [EOS], reward=float(rng.normal()),
                            tox=float(rng.uniform(0.01, 1)), version=c // 4, group=(sid << 40) + c,
                            searcher=sid, finished=True))
    return rows


def test_state_round_trip_gives_identical_draws_and_skips_replayed_rows():
    conf = cfg(samples_per_group=3, capacity_per_prompt=12, recency_prob=0.5)
    rows = _stream(0, 40)
    buf = make_buffer(conf)
    buf.add(rows)
    buf.mark_sync(5)
    buf.mark_sync(8)
    buf.sample(np.random.default_rng(0), 4, current_version=9)
    hs = buf.stats()["heap"]
    assert hs["near_duplicate_drops"] + hs["exact_duplicates"] > 0 and hs["evictions"] > 0  # the rules ran
    state = json.loads(json.dumps(buf.state_dict()))
    new = make_buffer(conf)
    new.load_state_dict(state)
    # an async restart re-reads every store from row 0: already offered rows are skipped
    new.add(rows[1::2] + rows[::2])
    assert new.stats()["replayed_rows_skipped"] == len(rows)
    more = _stream(40, 10)  # rows after the checkpoint go through the heap in both
    for b in (buf, new):
        b.add(more)
    for i in range(5):
        a = buf.sample(np.random.default_rng((1, i)), 4, current_version=10)
        b = new.sample(np.random.default_rng((1, i)), 4, current_version=10)
        assert [[key(t) for t in g] for g in a] == [[key(t) for t in g] for g in b]
        for ga, gb in zip(a, b):
            for ta, tb in zip(ga, gb):
                np.testing.assert_array_equal(ta.behavior_logprobs, tb.behavior_logprobs)
                assert ta.extras == tb.extras and ta.finished == tb.finished
    sa, sb = buf.stats(), new.stats()
    for st in (sa, sb):
        st.pop("replayed_rows_skipped"), st["extra_metrics"].pop("replayed_rows_skipped")
    assert json.dumps(sa, sort_keys=True, default=str) == json.dumps(sb, sort_keys=True, default=str)
    with pytest.raises(ValueError, match="config"):
        make_buffer(cfg(samples_per_group=3, capacity_per_prompt=13)).load_state_dict(state)


def test_trajectory_json_round_trip_keeps_every_field():
    t = row([5, 6, EOS], reward=-3.25, finished=True, version=4, group=7, searcher=1)
    back = trajectory_from_json(json.loads(json.dumps(trajectory_to_json(t))))
    for name in t.__dataclass_fields__:
        a, b = getattr(t, name), getattr(back, name)
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)
        else:
            assert a == b, name
