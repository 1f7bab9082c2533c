"""Replay buffer: pure policies with hand-computed values, and statistical properties of sampling.

Statistical checks use fixed seeds and generous (>= 5 sigma or p < 1e-3) bounds, so they are
deterministic and would only fail on a real bias.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from tbajax.buffer import (
    BufferConfig,
    BufferEmptyError,
    GroupQueue,
    ReplayBuffer,
    Tailer,
    choose_branch,
    draw_group,
    make_buffer,
    recent_min_version,
    softmax_probs,
    stale_log_weights,
    take_newest,
)
from tbajax.trajectory import RewardStatus, Trajectory

_PROMPT = np.array([1, 5, 6], np.int32)


def traj(
    prompt: int,
    resp: tuple[int, ...] | int,
    *,
    reward: float = 0.0,
    version: int = 0,
    group: int = 0,
    searcher: int = 0,
    wall: float = 0.0,
    status: RewardStatus = RewardStatus.OK,
) -> Trajectory:
    resp = (resp,) if isinstance(resp, int) else resp
    r = np.asarray(resp, np.int32)
    return Trajectory(
        prompt_id=prompt,
        group_id=group,
        prompt_tokens=_PROMPT,
        response_tokens=r,
        behavior_logprobs=np.zeros(len(r), np.float32),
        reward=reward,
        reward_status=status,
        policy_version=version,
        searcher_id=searcher,
        wall_time=wall,
    )


def tokens(t: Trajectory) -> tuple[int, ...]:
    return tuple(int(x) for x in t.response_tokens)


def contents(buf: ReplayBuffer) -> dict[int, list[tuple[tuple[int, ...], int]]]:
    """prompt -> sorted (response, version) pairs of the rows the buffer holds."""
    out = {}
    for pid, pr in buf._prompts.items():  # noqa: SLF001 - white-box check of stored rows
        out[pid] = sorted((tokens(t), t.policy_version) for _, t in pr.rows.values())
    return out


def cfg(**kw) -> BufferConfig:
    base = dict(samples_per_group=2, capacity_per_prompt=10, recency_prob=0.0)
    base.update(kw)
    return BufferConfig(**base)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(recency_prob=1.5), "recency_prob"),
        (dict(recency_prob=-0.1), "recency_prob"),
        (dict(capacity_per_prompt=-1), "capacity_per_prompt"),
        (dict(capacity_per_prompt=0), "capacity_per_prompt"),
        (dict(samples_per_group=0), "samples_per_group"),
        (dict(samples_per_group=20, capacity_per_prompt=10), "no prompt could ever fill"),
        (dict(reward_inv_temp=-1.0), "reward_inv_temp"),
        (dict(reward_inv_temp=float("nan")), "reward_inv_temp"),
        (dict(mode="fifo"), "mode"),
        (dict(min_group_size=0), "min_group_size"),
        (dict(max_staleness=-1), "max_staleness"),
        (dict(stale_decay=0.0), "stale_decay"),
        (dict(async_level=-1), "async_level"),
    ],
)
def test_config_rejects_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        BufferConfig(**kw)


def test_make_buffer_picks_the_structure_and_a_wrong_mode_is_refused():
    assert type(make_buffer(BufferConfig())) is ReplayBuffer
    assert type(make_buffer(BufferConfig(mode="fifo_once"))) is GroupQueue
    with pytest.raises(ValueError, match="mode='fifo_once'.*make_buffer"):
        ReplayBuffer(BufferConfig(mode="fifo_once"))
    with pytest.raises(ValueError, match="mode='replay'.*make_buffer"):
        GroupQueue(BufferConfig())


def test_config_k_above_capacity_allowed_with_replacement():
    BufferConfig(samples_per_group=20, capacity_per_prompt=10, shortfall="replace")


# ----------------------------------------------------------------------------- pure policies


def test_softmax_probs_hand_values():
    np.testing.assert_allclose(softmax_probs([0.0, 1.0, 5.0], 0.0), [1 / 3] * 3)
    e = np.exp([0.0, 1.0, 2.0])
    np.testing.assert_allclose(softmax_probs([0.0, 1.0, 2.0], 1.0), e / e.sum())
    # inv_temp 2 on rewards (0, ln 2 / 2) -> weights (1, 2)
    np.testing.assert_allclose(softmax_probs([0.0, np.log(2) / 2], 2.0), [1 / 3, 2 / 3])
    # large rewards stay finite
    np.testing.assert_allclose(softmax_probs([1000.0, 1000.0], 1.0), [0.5, 0.5])
    with pytest.raises(ValueError, match="empty"):
        softmax_probs([], 1.0)


def test_stale_log_weights_hand_values():
    w = stale_log_weights(np.array([10, 8, 7, 5]), current_version=10, max_staleness=2, decay=0.5)
    np.testing.assert_allclose(np.exp(w), [1.0, 1.0, 0.5, 0.125])


def test_recent_min_version():
    assert recent_min_version([]) is None
    assert recent_min_version([4]) is None
    assert recent_min_version([4, 6]) == 4


def test_choose_branch_frequency():
    rng = np.random.default_rng(0)
    n, m = 20000, 0.3
    hits = sum(choose_branch(rng, m) for _ in range(n))
    assert abs(hits / n - m) < 5 * np.sqrt(m * (1 - m) / n)
    assert not any(choose_branch(rng, 0.0) for _ in range(100))
    assert all(choose_branch(rng, 1.0) for _ in range(100))


def test_draw_group_single_draw_matches_softmax_chi_square():
    rng = np.random.default_rng(1)
    rewards = np.array([0.0, 0.5, 1.0, 2.0])
    p = softmax_probs(rewards, 1.0)
    n = 20000
    counts = np.zeros(4)
    for _ in range(n):
        counts[draw_group(rng, rewards * 1.0, 1, replace=False)] += 1
    chi2 = ((counts - n * p) ** 2 / (n * p)).sum()
    assert chi2 < 16.27, (counts / n, p)  # df = 3, p = 0.001


def test_draw_group_without_replacement_matches_successive_sampling():
    """Inclusion probabilities of k=2 of 4 equal those of draw-one-renormalise-draw-again."""
    rng = np.random.default_rng(2)
    logits = np.array([0.0, 0.5, 1.0, 2.0])
    w = np.exp(logits)
    exact = np.zeros(4)
    for i, j in itertools.permutations(range(4), 2):
        pr = w[i] / w.sum() * w[j] / (w.sum() - w[i])
        exact[i] += pr
        exact[j] += pr
    n = 20000
    counts = np.zeros(4)
    for _ in range(n):
        idx = draw_group(rng, logits, 2, replace=False)
        assert len(set(idx.tolist())) == 2
        counts[idx] += 1
    freq = counts / n
    assert np.all(np.abs(freq - exact) < 5 * np.sqrt(exact * (1 - exact) / n)), (freq, exact)


def test_draw_group_errors_and_replacement():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="distinct"):
        draw_group(rng, np.zeros(3), 4, replace=False)
    with pytest.raises(ValueError, match="zero items"):
        draw_group(rng, np.zeros(0), 1, replace=True)
    idx = draw_group(rng, np.zeros(3), 7, replace=True)
    assert len(idx) == 7 and idx.min() >= 0 and idx.max() <= 2


def test_draw_group_handles_underflowing_weights():
    rng = np.random.default_rng(0)
    idx = draw_group(rng, np.array([0.0, -2000.0, -3000.0]), 3, replace=False)
    np.testing.assert_array_equal(idx, [0, 1, 2])


def test_take_newest_prefers_newest_groups():
    rng = np.random.default_rng(0)
    taken = take_newest(rng, [3, 5, 4], 6)
    np.testing.assert_array_equal(taken[0], [0, 1, 2])
    assert len(taken[1]) == 3 and len(set(taken[1].tolist())) == 3 and taken[1].max() < 5
    assert len(taken[2]) == 0
    short = take_newest(rng, [2, 1], 5)  # not enough rows: everything
    assert [len(t) for t in short] == [2, 1]


# ----------------------------------------------------------------------------- dedup, capacity


def test_dedup_keeps_newest_copy():
    buf = ReplayBuffer(cfg())
    buf.add([traj(0, (7, 2), version=3, reward=0.0)])
    buf.add([traj(0, (7, 2), version=5, reward=1.0), traj(0, (8, 2), version=1)])
    buf.add([traj(0, (7, 2), version=4, reward=0.5)])  # older copy arrives late: dropped
    assert contents(buf) == {0: [((7, 2), 5), ((8, 2), 1)]}
    kept = [t for _, t in buf._prompts[0].rows.values() if tokens(t) == (7, 2)]  # noqa: SLF001
    assert kept[0].reward == 1.0
    s = buf.stats()
    assert s["dedup_drops"] == 2 and s["num_rows"] == 2 and s["evictions"] == 0
    # same tokens under another prompt are a different response
    buf.add([traj(1, (7, 2), version=0)])
    assert buf.stats()["num_rows"] == 3


def test_dedup_off_keeps_every_copy_within_capacity():
    buf = ReplayBuffer(cfg(dedup=False, capacity_per_prompt=3))
    buf.add([traj(0, (7, 2), version=v, reward=1.0) for v in (1, 2, 3, 4)])
    assert contents(buf) == {0: [((7, 2), 2), ((7, 2), 3), ((7, 2), 4)]}  # oldest evicted
    s = buf.stats()
    assert s["dedup_drops"] == 0 and s["num_rows"] == 3 and s["evictions"] == 1


def test_capacity_evicts_oldest_version():
    buf = ReplayBuffer(cfg(capacity_per_prompt=3))
    buf.add([traj(0, i, version=v) for i, v in [(1, 5), (2, 1), (3, 3)]])
    buf.add([traj(0, 4, version=4)])  # evicts version 1
    assert contents(buf)[0] == [((1,), 5), ((3,), 3), ((4,), 4)]
    buf.add([traj(0, 5, version=0)])  # older than everything kept: rejected
    assert contents(buf)[0] == [((1,), 5), ((3,), 3), ((4,), 4)]
    s = buf.stats()
    assert s["evictions"] == 2 and s["num_rows"] == 3
    assert s["min_policy_version"] == 3 and s["max_policy_version"] == 5
    assert s["mean_policy_version"] == pytest.approx(4.0)


def test_capacity_and_dedup_invariants_random_stream_and_interleaving():
    """Final contents = per prompt, the C newest unique responses, whatever the interleaving."""
    rng = np.random.default_rng(3)
    per_searcher = []
    for s in range(3):
        rows = []
        for i in range(400):
            rows.append(
                traj(
                    int(rng.integers(4)),
                    (int(rng.integers(12)), 2),  # few distinct responses -> many duplicates
                    version=i // 40,
                    searcher=s,
                    group=i // 8,
                    reward=float(rng.random()),
                    wall=float(i),
                )
            )
        per_searcher.append(rows)

    def build(order_seed: int) -> ReplayBuffer:
        buf = ReplayBuffer(cfg(capacity_per_prompt=5))
        cursors = [0, 0, 0]
        r = np.random.default_rng(order_seed)
        while any(c < 400 for c in cursors):
            s = int(r.choice([i for i in range(3) if cursors[i] < 400]))
            n = int(r.integers(1, 30))
            buf.add(per_searcher[s][cursors[s] : cursors[s] + n])
            cursors[s] = min(400, cursors[s] + n)
        return buf

    a, b = build(10), build(11)
    assert contents(a) == contents(b)
    # expected: newest copy of each response by (version, wall, searcher, order), top 5
    expected: dict[int, list] = {}
    for p in range(4):
        best: dict = {}
        for s, rows in enumerate(per_searcher):
            for i, t in enumerate(rows):
                if t.prompt_id != p:
                    continue
                key = (t.policy_version, t.wall_time, s, i)
                if tokens(t) not in best or key > best[tokens(t)][0]:
                    best[tokens(t)] = (key, t)
        top = sorted(best.values(), key=lambda kv: kv[0])[-5:]
        expected[p] = sorted((tokens(t), t.policy_version) for _, t in top)
    assert contents(a) == expected
    for pr in a._prompts.values():  # noqa: SLF001
        assert len(pr.rows) <= 5
    ga = a.sample(np.random.default_rng(5), 20)
    gb = b.sample(np.random.default_rng(5), 20)
    assert [[tokens(t) for t in g] for g in ga] == [[tokens(t) for t in g] for g in gb]


# ----------------------------------------------------------------------------- branches


def test_recency_frequency_matches_m():
    m = 0.3
    buf = ReplayBuffer(cfg(recency_prob=m, samples_per_group=2))
    for p in range(10):
        buf.add([traj(p, i, version=0) for i in range(4)])
    buf.add([traj(10, i, version=5, group=1) for i in range(4)])
    buf.mark_sync(3)
    buf.mark_sync(5)  # recent = rows sampled with version >= 3: only prompt 10
    assert buf.stats()["num_recent_prompts"] == 1
    n = 4000
    groups = buf.sample(np.random.default_rng(7), n)
    s = buf.stats()
    assert s["groups_recency"] + s["groups_reward"] == n and s["recency_fallbacks"] == 0
    sd = np.sqrt(m * (1 - m) / n)
    assert abs(s["groups_recency"] / n - m) < 5 * sd
    frac_recent_prompt = np.mean([g[0].prompt_id == 10 for g in groups])
    expect = m + (1 - m) / 11
    assert abs(frac_recent_prompt - expect) < 5 * np.sqrt(expect * (1 - expect) / n)


def test_recent_set_follows_syncs():
    buf = ReplayBuffer(cfg(recency_prob=1.0))
    buf.add([traj(0, i, version=0) for i in range(3)])
    assert buf.stats()["num_recent_prompts"] == 1  # no sync yet: everything is recent
    buf.mark_sync(0)
    buf.mark_sync(2)  # recent: version >= 0
    assert buf.stats()["num_recent_prompts"] == 1
    buf.mark_sync(4)  # recent: version >= 2
    assert buf.stats()["num_recent_prompts"] == 0
    buf.mark_sync(4)  # repeated sync is a no-op
    assert buf.stats()["recent_min_version"] == 2
    with pytest.raises(ValueError, match="must not decrease"):
        buf.mark_sync(3)
    # nothing recent: recency slots fall back to the reward branch, and say so
    groups = buf.sample(np.random.default_rng(0), 5)
    assert len(groups) == 5 and buf.stats()["recency_fallbacks"] == 5
    buf.add([traj(1, i, version=2) for i in range(3)])  # in-flight rows of the previous params
    assert buf.stats()["num_recent_prompts"] == 1
    assert all(g[0].prompt_id == 1 for g in buf.sample(np.random.default_rng(0), 20))


def test_recency_fallback_wait_raises():
    buf = ReplayBuffer(cfg(recency_prob=0.5, recency_fallback="wait"))
    buf.add([traj(0, i, version=0) for i in range(3)])
    buf.mark_sync(2)
    buf.mark_sync(4)
    with pytest.raises(BufferEmptyError, match="previous sync"):
        buf.sample(np.random.default_rng(0), 1)


def test_max_recent_uses_caps_reuse_of_recent_groups_and_then_waits():
    buf = ReplayBuffer(cfg(recency_prob=1.0, max_recent_uses=1, recency_fallback="wait"))
    buf.add([traj(p, i, version=0, group=p) for p in range(4) for i in range(3)])
    buf.mark_sync(0)
    first = buf.sample(np.random.default_rng(0), 3)
    assert len({g[0].prompt_id for g in first}) == 3  # each recent group drawn at most once
    second = buf.sample(np.random.default_rng(1), 3)  # one unused group left, then fallback
    unused = ({0, 1, 2, 3} - {g[0].prompt_id for g in first}).pop()
    assert second[0][0].prompt_id == unused  # the recency slot took the one group left
    assert buf.stats()["groups_recency"] == 4 and buf.stats()["recency_fallbacks"] == 2
    with pytest.raises(BufferEmptyError, match="used fewer than 1 times"):
        buf.sample(np.random.default_rng(2), 1)
    state = json.loads(json.dumps(buf.state_dict()))
    buf.add([traj(9, i, version=1, group=9) for i in range(3)])  # a new group arrives
    assert buf.sample(np.random.default_rng(3), 1)[0][0].prompt_id == 9
    rebuilt = ReplayBuffer(buf.config)  # uses survive a restart (state + rows from the stores)
    rebuilt.add([traj(p, i, version=0, group=p) for p in range(4) for i in range(3)])
    rebuilt.load_state_dict(state)
    with pytest.raises(BufferEmptyError):
        rebuilt.sample(np.random.default_rng(2), 1)


def test_max_recent_uses_two_allows_two_draws_per_group():
    buf = ReplayBuffer(cfg(recency_prob=1.0, max_recent_uses=2, recency_fallback="wait"))
    buf.add([traj(0, i, version=0) for i in range(3)])
    assert len(buf.sample(np.random.default_rng(0), 2)) == 2
    with pytest.raises(BufferEmptyError):
        buf.sample(np.random.default_rng(1), 1)


def test_recency_branch_prefers_newest_generation_group():
    buf = ReplayBuffer(cfg(recency_prob=1.0, samples_per_group=4))
    buf.add([traj(0, 10 + i, version=4, group=1, searcher=0) for i in range(5)])
    buf.add([traj(0, 20 + i, version=5, group=7, searcher=1) for i in range(3)])
    buf.add([traj(0, 30 + i, version=3, group=2, searcher=0) for i in range(5)])
    seen_from_g1 = set()
    for seed in range(40):
        (g,) = buf.sample(np.random.default_rng(seed), 1)
        toks = sorted(tokens(t)[0] for t in g)
        assert toks[1:] == [20, 21, 22]  # all of the newest group ...
        assert 10 <= toks[0] < 15  # ... topped up from the next newest
        seen_from_g1.add(toks[0])
    assert seen_from_g1 == set(range(10, 15))  # the top-up is a random subset


def test_reward_branch_uniform_with_zero_inv_temp():
    buf = ReplayBuffer(cfg(samples_per_group=3, reward_inv_temp=0.0))
    rewards = [0.0, 1.0, 0.0, 5.0, 0.0, 1.0, 2.0, 0.0]
    buf.add([traj(0, i, reward=r) for i, r in enumerate(rewards)])
    rng = np.random.default_rng(11)
    n = 4000
    counts = np.zeros(8)
    for g in buf.sample(rng, n):
        assert len({tokens(t) for t in g}) == 3  # without replacement
        for t in g:
            counts[tokens(t)[0]] += 1
    incl = counts / n  # each row's inclusion probability is 3/8
    assert np.all(np.abs(incl - 3 / 8) < 5 * np.sqrt((3 / 8) * (5 / 8) / n)), incl
    # chi-square of the single-draw distribution (K = 1)
    counts1 = np.zeros(8)
    for g in buf.sample(np.random.default_rng(12), n, k=1):
        counts1[tokens(g[0])[0]] += 1
    chi2 = ((counts1 - n / 8) ** 2 / (n / 8)).sum()
    assert chi2 < 24.32  # df = 7, p = 0.001


def test_reward_branch_matches_softmax_with_inv_temp_one():
    buf = ReplayBuffer(cfg(samples_per_group=1, reward_inv_temp=1.0))
    rewards = [0.0, 0.5, 1.0, 2.0]
    buf.add([traj(0, i, reward=r) for i, r in enumerate(rewards)])
    n = 8000
    counts = np.zeros(4)
    for g in buf.sample(np.random.default_rng(13), n):
        counts[tokens(g[0])[0]] += 1
    p = softmax_probs(rewards, 1.0)
    chi2 = ((counts - n * p) ** 2 / (n * p)).sum()
    assert chi2 < 16.27, (counts / n, p)


def test_reward_branch_at_inv_temp_one_follows_softmax_of_skewed_real_rewards():
    """TL;DR's setting: reward-model scores (real-valued, long right tail, -1 for every response
    without EOS) drawn with softmax(reward * 1). Each row's frequency must match exp(r) / sum exp(r)
    computed here by hand, within 5 binomial sigmas, over many draws."""
    rewards = [-1.0, -1.0, -1.0, -2.6, -0.37, 0.12, 0.8, 1.9, 3.4, 5.1]
    buf = ReplayBuffer(cfg(samples_per_group=1, capacity_per_prompt=16, reward_inv_temp=1.0))
    buf.add([traj(0, i, reward=r) for i, r in enumerate(rewards)])
    n = 20000
    counts = np.zeros(len(rewards))
    for g in buf.sample(np.random.default_rng(17), n):
        counts[tokens(g[0])[0]] += 1
    e = np.exp(np.array(rewards) - max(rewards))
    p = e / e.sum()  # the 5.1 row: ~0.79; each -1 row: ~0.0018
    sigma = np.sqrt(p * (1 - p) / n)
    assert np.all(np.abs(counts / n - p) < 5 * sigma + 1e-9), (counts / n, p)
    assert counts[9] > counts[8] > counts[7] > counts[6]  # the order of the head follows the rewards


def test_groups_never_mix_prompts_and_have_k_rows():
    rng = np.random.default_rng(4)
    buf = ReplayBuffer(cfg(samples_per_group=3, recency_prob=0.5, reward_inv_temp=1.0))
    buf.add(
        [
            traj(int(rng.integers(20)), int(rng.integers(50)), version=int(v), group=int(v))
            for v in rng.integers(0, 6, size=600)
        ]
    )
    buf.mark_sync(3)
    buf.mark_sync(5)
    for g in buf.sample(np.random.default_rng(0), 500):
        assert len(g) == 3
        assert len({t.prompt_id for t in g}) == 1
        assert len({tokens(t) for t in g}) == 3


# ----------------------------------------------------------------------------- shortfall, empty


def test_empty_buffer_and_too_few_rows_raise_buffer_empty():
    buf = ReplayBuffer(cfg(samples_per_group=4))
    with pytest.raises(BufferEmptyError, match="wait for searchers"):
        buf.sample(np.random.default_rng(0), 1)
    buf.add([traj(0, i) for i in range(3)])  # 3 < K = 4 with shortfall="skip"
    rng = np.random.default_rng(0)
    before = rng.bit_generator.state
    with pytest.raises(BufferEmptyError):
        buf.sample(rng, 1)
    assert rng.bit_generator.state == before  # a failed attempt draws nothing
    with pytest.raises(ValueError, match="capacity_per_prompt"):
        buf.sample(rng, 1, k=11)  # can never be satisfied
    with pytest.raises(TypeError, match="Generator"):
        buf.sample(0, 1)
    buf.add([traj(0, 3)])
    assert len(buf.sample(rng, 1)[0]) == 4


def test_shortfall_replace_draws_with_replacement():
    buf = ReplayBuffer(cfg(samples_per_group=5, shortfall="replace", min_group_size=2))
    buf.add([traj(0, 1)])  # below min_group_size
    with pytest.raises(BufferEmptyError):
        buf.sample(np.random.default_rng(0), 1)
    buf.add([traj(0, 2), traj(0, 3)])
    for g in buf.sample(np.random.default_rng(1), 20):  # reward branch: i.i.d. draws
        assert len(g) == 5 and {tokens(t)[0] for t in g} <= {1, 2, 3}
    recent = ReplayBuffer(cfg(samples_per_group=5, shortfall="replace", recency_prob=1.0))
    recent.add([traj(0, i) for i in (1, 2, 3)])
    for g in recent.sample(np.random.default_rng(2), 20):  # every row, then topped up
        assert len(g) == 5 and {tokens(t)[0] for t in g} == {1, 2, 3}


def test_failed_grades_dropped_and_nan_reward_rejected():
    buf = ReplayBuffer(cfg())
    buf.add([traj(0, 1, status=RewardStatus.TIMEOUT), traj(0, 2, status=RewardStatus.WRONG)])
    assert buf.stats()["failed_grade_drops"] == 1 and len(buf) == 1
    with pytest.raises(ValueError, match="non-finite reward"):
        buf.add([traj(0, 3, reward=float("nan"))])
    with pytest.raises(TypeError, match="Trajectory"):
        buf.add([{"prompt_id": 0}])
    keep = ReplayBuffer(cfg(keep_failed_grades=True))
    keep.add([traj(0, 1, status=RewardStatus.ERROR)])
    assert len(keep) == 1


# ----------------------------------------------------------------------------- staleness


def test_max_staleness_drop():
    buf = ReplayBuffer(cfg(samples_per_group=2, max_staleness=3))
    for v in range(10):
        buf.add([traj(v % 3, 100 + 2 * v + j, version=v) for j in range(2)])
    with pytest.raises(ValueError, match="current_version"):
        buf.sample(np.random.default_rng(0), 1)
    for g in buf.sample(np.random.default_rng(0), 200, current_version=10):
        assert all(t.policy_version >= 7 for t in g)
    s = buf.stats()
    assert s["num_rows"] == 6 and s["stale_drops"] == 14 and s["min_policy_version"] == 7
    assert s["mean_staleness"] == pytest.approx(10 - 8)
    buf.add([traj(0, 999, version=6)])  # arrives late and already too old
    assert buf.stats()["stale_drops"] == 15 and len(buf) == 6
    with pytest.raises(ValueError, match="backwards"):
        buf.sample(np.random.default_rng(0), 1, current_version=9)


def test_max_staleness_weight_mode_hand_values():
    buf = ReplayBuffer(
        cfg(samples_per_group=1, max_staleness=1, staleness_mode="weight", stale_decay=0.5)
    )
    buf.add([traj(0, 1, version=10), traj(0, 2, version=7)])  # staleness 0 and 3 (excess 2)
    n = 6000
    stale = sum(
        tokens(g[0]) == (2,)
        for g in buf.sample(np.random.default_rng(3), n, current_version=10)
    )
    assert len(buf) == 2
    p = 0.25 / 1.25  # weights 1 and 0.5 ** 2
    assert abs(stale / n - p) < 5 * np.sqrt(p * (1 - p) / n)


# ----------------------------------------------------------------------------- fifo_once


def fifo_rows(prompt, group, version, n=3, searcher=0):
    return [
        traj(prompt, 100 * group + i, version=version, group=group, searcher=searcher)
        for i in range(n)
    ]


def test_fifo_once_consumes_each_group_once_oldest_first():
    buf = GroupQueue(BufferConfig(mode="fifo_once", samples_per_group=3, async_level=2))
    buf.add(fifo_rows(0, 1, version=4) + fifo_rows(1, 2, version=3) + fifo_rows(0, 3, version=1))
    buf.add(fifo_rows(2, 4, version=5)[:2])  # incomplete: waits
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="current_version"):
        buf.sample(rng, 1)
    g1 = buf.sample(rng, 1, current_version=5)
    # group 3 (version 1) is 4 versions old > async_level: dropped; group 2 (v3) is oldest
    assert [t.group_id for t in g1[0]] == [2, 2, 2]
    assert [tokens(t)[0] for t in g1[0]] == [200, 201, 202]
    s = buf.stats()
    assert s["stale_groups_dropped"] == 1 and s["groups_consumed"] == 1
    g2 = buf.sample(rng, 1, current_version=5)
    assert {t.group_id for t in g2[0]} == {1}
    before = rng.bit_generator.state
    with pytest.raises(BufferEmptyError):  # group 4 is still incomplete
        buf.sample(rng, 1, current_version=5)
    assert rng.bit_generator.state == before
    buf.add(fifo_rows(2, 4, version=5)[2:] + fifo_rows(1, 2, version=3))  # late copy of group 2
    assert buf.stats()["late_rows_dropped"] == 3
    (g3,) = buf.sample(rng, 1, current_version=5)
    assert {t.group_id for t in g3} == {4} and len(g3) == 3
    with pytest.raises(BufferEmptyError):
        buf.sample(rng, 1, current_version=5)


def test_fifo_once_subsets_large_groups_and_needs_all_groups_at_once():
    buf = GroupQueue(BufferConfig(mode="fifo_once", samples_per_group=4, async_level=1))
    buf.add(fifo_rows(0, 1, version=0, n=6))
    with pytest.raises(BufferEmptyError):  # 2 groups requested, 1 ready: nothing consumed
        buf.sample(np.random.default_rng(0), 2, current_version=0)
    (g,) = buf.sample(np.random.default_rng(0), 1, current_version=0)
    assert len(g) == 4 and len({tokens(t) for t in g}) == 4
    assert len(buf) == 0


def test_sync_on_policy_is_fifo_with_async_level_zero():
    buf = GroupQueue(BufferConfig(mode="fifo_once", samples_per_group=3, async_level=0))
    buf.add(fifo_rows(0, 1, version=6) + fifo_rows(1, 2, version=7))
    (g,) = buf.sample(np.random.default_rng(0), 1, current_version=7)
    assert {t.policy_version for t in g} == {7}
    assert buf.stats()["stale_groups_dropped"] == 1
    buf.add(fifo_rows(3, 5, version=6))  # late and stale
    assert len(buf) == 0 and buf.stats()["stale_drops"] == 6


# ----------------------------------------------------------------------------- determinism, state


def _replay_rows(seed: int, n: int) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    return [
        traj(
            int(rng.integers(30)),
            (int(rng.integers(40)), int(rng.integers(3))),
            reward=float(rng.random()),
            version=i // 50,
            group=i // 6,
            searcher=i % 2,
        )
        for i in range(n)
    ]


def test_sampling_deterministic_given_seed():
    conf = cfg(samples_per_group=3, recency_prob=0.6, reward_inv_temp=1.0)
    rows = _replay_rows(0, 800)
    out = []
    for _ in range(2):
        buf = make_buffer(conf)
        buf.add(rows)
        buf.mark_sync(8)
        buf.mark_sync(12)
        out.append([[tokens(t) for t in g] for g in buf.sample(np.random.default_rng(42), 50)])
    assert out[0] == out[1]
    buf.add([])
    other = [[tokens(t) for t in g] for g in buf.sample(np.random.default_rng(43), 50)]
    assert other != out[0]


def test_state_dict_round_trip_replay():
    conf = cfg(samples_per_group=3, recency_prob=0.6, max_staleness=10)
    rows = _replay_rows(1, 800)
    buf = make_buffer(conf)
    buf.add(rows)
    buf.mark_sync(10)
    buf.mark_sync(14)
    buf.sample(np.random.default_rng(0), 4, current_version=15)
    state = json.loads(json.dumps(buf.state_dict()))
    assert state["sync_versions"] == [10, 14] and state["current_version"] == 15
    for rows_first in (True, False):  # restore before or after re-adding the rows
        new = make_buffer(conf)
        if rows_first:
            new.add(rows[::2] + rows[1::2])  # another interleaving of the two searchers
            new.load_state_dict(state)
        else:
            new.load_state_dict(state)
            new.add(rows[1::2] + rows[::2])
        assert contents(new) == contents(buf)
        a = buf.sample(np.random.default_rng(9), 30, current_version=15)
        b = new.sample(np.random.default_rng(9), 30, current_version=15)
        assert [[tokens(t) for t in g] for g in a] == [[tokens(t) for t in g] for g in b]
    with pytest.raises(ValueError, match="mode"):
        GroupQueue(BufferConfig(mode="fifo_once")).load_state_dict(state)


def test_state_dict_round_trip_fifo():
    conf = BufferConfig(mode="fifo_once", samples_per_group=3, async_level=2)
    rows = []
    for v in range(6):
        rows += fifo_rows(v, 10 + v, version=v, searcher=v % 2)
    buf = make_buffer(conf)
    buf.add(rows)
    consumed = buf.sample(np.random.default_rng(0), 2, current_version=5)
    assert [g[0].group_id for g in consumed] == [13, 14]
    state = json.loads(json.dumps(buf.state_dict()))
    assert sorted(tuple(c[:3]) for c in state["consumed"]) == [(3, 1, 13), (4, 0, 14)]
    new = make_buffer(conf)
    new.load_state_dict(state)
    new.add(rows)
    assert len(new) == len(buf) == 3
    (g,) = new.sample(np.random.default_rng(0), 1, current_version=5)
    assert g[0].group_id == 15
    # consumed groups older than async_level are forgotten: the state stays small
    buf.add(fifo_rows(9, 20, version=9))
    buf.sample(np.random.default_rng(0), 1, current_version=9)
    assert [c[:3] for c in buf.state_dict()["consumed"]] == [[9, 0, 20]]


# ----------------------------------------------------------------------------- tailer, scale


class ListSource:
    def __init__(self, rows):
        self.rows = list(rows)
        self.reads = []

    def committed_rows(self):
        return len(self.rows)

    def read(self, start, stop):
        self.reads.append((start, stop))
        return self.rows[start:stop]


def test_tailer_reads_new_rows_in_chunks():
    a = ListSource(_replay_rows(2, 10))
    b = ListSource([])
    tail = Tailer([a, b], chunk_rows=4)
    buf = ReplayBuffer(cfg())
    assert tail.poll(buf) == 10 and tail.cursors == (10, 0)
    assert a.reads == [(0, 4), (4, 8), (8, 10)]
    b.rows += _replay_rows(3, 5)
    a.rows += _replay_rows(4, 3)
    assert tail.poll(buf, max_rows=4) == 4 and tail.cursors == (13, 1)
    assert tail.poll(buf) == 4 and tail.cursors == (13, 5)
    assert buf.stats()["rows_added"] == 18
    c = ListSource(_replay_rows(5, 2))
    tail.add_source(c)
    assert tail.poll(buf) == 2
    a.rows = a.rows[:5]
    with pytest.raises(RuntimeError, match="append-only"):
        tail.poll(buf)


def test_capacity_and_counts_at_scale():
    """10k rows over 200 prompts, 3 interleaved searchers, capacity 40 of 50 per prompt: every
    prompt keeps exactly its 40 newest rows, and the counters add up."""
    rng = np.random.default_rng(0)
    n, prompts = 10_000, 200
    resp = rng.integers(3, 100, size=(n, 8)).astype(np.int32)
    zeros = np.zeros(8, np.float32)
    rows = [
        Trajectory(
            prompt_id=i % prompts,
            group_id=i // 20,
            prompt_tokens=_PROMPT,
            response_tokens=resp[i],
            behavior_logprobs=zeros,
            reward=float(i % 2),
            policy_version=i // 500,
            searcher_id=i % 3,
        )
        for i in range(n)
    ]
    buf = ReplayBuffer(BufferConfig(samples_per_group=20, capacity_per_prompt=40))
    for start in range(0, n, 4096):
        buf.add(rows[start : start + 4096])
    s = buf.stats()
    assert s["num_rows"] == prompts * 40 and s["evictions"] == n - prompts * 40
    kept = contents(buf)
    # prompt p got rows p, p + 200, ...: its 10 oldest (versions 0..3) are the ones evicted
    expect = sorted((tokens(rows[i]), rows[i].policy_version) for i in range(7, n, prompts)[10:])
    assert kept[7] == expect
    buf.mark_sync(15)
    buf.mark_sync(19)
    groups = buf.sample(np.random.default_rng(0), 64)
    assert len(groups) == 64 and all(len(g) == 20 and len({t.prompt_id for t in g}) == 1 for g in groups)
