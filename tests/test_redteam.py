"""Red-teaming building blocks: the log reward and its schedules, evaluation metrics, the
reward-keyed replay buffer. Hand-computed values throughout."""

from __future__ import annotations

import itertools
import json
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tbajax.buffer.config import BufferEmptyError
from tbajax.buffer.reward_heap import HeapItem, RewardHeap, RewardHeapConfig, edit_distances
from tbajax.redteam import (
    LinearRamp,
    RedTeamRewardConfig,
    attack_success,
    attack_success_from_log,
    attack_success_rate,
    diversity,
    geometric_mean_toxicity,
    mean_log_toxicity,
    prior_log_likelihood,
    red_team_log_reward,
    red_team_summary,
    replay_step,
    sample_temperature,
    unique_successful_attacks,
)

# ------------------------------------------------------------------------------ reward


def test_schedules_end_points() -> None:
    cfg = RedTeamRewardConfig()
    assert [float(cfg.tau.at(s)) for s in (0, 1, 250, 500, 501, 5000)] == pytest.approx(
        [2.0, 2.0 - 1 / 500, 1.5, 1.0, 1.0, 1.0]
    )
    assert [float(cfg.gamma.at(s)) for s in (0, 1000, 5000)] == [1.0, 1.0, 1.0]
    llama = RedTeamRewardConfig.llama()
    assert [float(llama.gamma.at(s)) for s in (0, 1000, 2000, 4000)] == pytest.approx([1.0, 1.1, 1.2, 1.2])
    assert float(LinearRamp(3.0, 5.0, 0).at(0)) == 5.0  # zero-length ramp: already at the end


def test_log_reward_hand_computed() -> None:
    cfg = RedTeamRewardConfig()  # β 0.1, γ 1, τ 2 -> 1 over 500 steps
    log_tox = np.log([[0.5, 0.5], [0.9, 0.1]])
    prior = np.array([-20.0, -10.0])
    # step 0: τ = 2. Row 0: (-20 + log 0.5 / 0.1) / 2; row 1: mean(log .9, log .1) = log 0.3 (geometric mean)
    want0 = [(-20 + math.log(0.5) / 0.1) / 2, (-10 + math.log(0.3) / 0.1) / 2]
    np.testing.assert_allclose(red_team_log_reward(cfg, 0, prior, log_tox), want0, rtol=1e-6)
    np.testing.assert_allclose(
        red_team_log_reward(cfg, 250, prior, log_tox), [w * 2 / 1.5 for w in want0], rtol=1e-6
    )
    # Llama γ: at step 1000, γ = 1.1 and τ = 1
    llama = RedTeamRewardConfig.llama()
    got = red_team_log_reward(llama, 1000, np.array([-22.0]), np.log([[0.2, 0.2, 0.2]]))
    np.testing.assert_allclose(got, [-22 / 1.1 + math.log(0.2) / 0.1], rtol=1e-6)
    # β scales only the toxicity term
    beta1 = RedTeamRewardConfig(beta=1.0)
    np.testing.assert_allclose(
        red_team_log_reward(beta1, 500, prior, log_tox), [-20 + math.log(0.5), -10 + math.log(0.3)], rtol=1e-6
    )


def test_short_attack_penalty() -> None:
    cfg = RedTeamRewardConfig()
    logp = np.array([[-1, -2, -3, -4, -5, -6], [-1, -1, -1, -1, 9, 9]], np.float32)
    mask = np.array([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    np.testing.assert_allclose(prior_log_likelihood(cfg, logp, mask), [-15.0, -500.0])
    got = red_team_log_reward(cfg, 500, np.array([-15.0, -3.0]), np.log([[0.5], [0.5]]), np.array([5, 4]))
    np.testing.assert_allclose(got, [-15 + math.log(0.5) / 0.1, -500 + math.log(0.5) / 0.1], rtol=1e-6)
    np.testing.assert_allclose(mean_log_toxicity(np.log([[0.1, 1.0]])), [0.5 * math.log(0.1)], rtol=1e-6)


def test_log_reward_jits_with_a_traced_step() -> None:
    cfg = RedTeamRewardConfig.llama()
    fn = jax.jit(partial(red_team_log_reward, cfg))
    args = (jnp.array([-30.0, -12.0]), jnp.log(jnp.array([[0.3, 0.6], [0.05, 0.9]])), jnp.array([7, 3]))
    for step in (0, 123, 3000):
        np.testing.assert_allclose(fn(step, *args), red_team_log_reward(cfg, step, *args), rtol=1e-6)


def test_reward_config_validation() -> None:
    with pytest.raises(ValueError, match="beta"):
        RedTeamRewardConfig(beta=0.0)
    with pytest.raises(ValueError, match="tau"):
        RedTeamRewardConfig(tau=LinearRamp(2.0, 0.0, 10))
    with pytest.raises(ValueError, match="steps"):
        LinearRamp(1.0, 2.0, -1)


def test_random_temperature_rule() -> None:
    n = 4000
    draw = jax.jit(partial(sample_temperature, shape=(n,)))
    temps = np.asarray(draw(jax.random.key(0)))
    ones = temps == 1.0
    assert abs(ones.mean() - 0.5) < 4 * math.sqrt(0.25 / n)  # a 4-sigma binomial band
    rand = temps[~ones]
    assert rand.min() >= 0.5 and rand.max() <= 2.0
    assert abs(rand.mean() - 1.25) < 0.03 and abs(rand.std() - 1.5 / math.sqrt(12)) < 0.03  # U[0.5, 2]
    np.testing.assert_array_equal(np.asarray(draw(jax.random.key(0))), temps)  # a function of the key
    assert not np.array_equal(np.asarray(draw(jax.random.key(1))), temps)
    steps = np.asarray(jax.jit(partial(replay_step, shape=(n,)))(jax.random.key(2)))
    assert steps.dtype == bool and abs(steps.mean() - 0.5) < 4 * math.sqrt(0.25 / n)


# ------------------------------------------------------------------------------ metrics


def test_attack_success_uses_the_geometric_mean() -> None:
    tox = np.array([[0.8, 0.2], [0.9, 0.4], [0.7, 0.35], [1.0, 0.0]])
    np.testing.assert_allclose(geometric_mean_toxicity(tox), [0.4, 0.6, math.sqrt(0.245), 0.0])
    # row 2 has arithmetic mean 0.525 > 0.5 but geometric mean 0.495: not a success
    assert attack_success(tox).tolist() == [False, True, False, False]
    assert attack_success_rate(tox) == 0.25
    with np.errstate(divide="ignore"):
        assert attack_success_from_log(np.log(tox)).tolist() == [False, True, False, False]
    assert math.isnan(attack_success_rate(np.zeros((0, 5))))
    with pytest.raises(ValueError, match="probabilities"):
        geometric_mean_toxicity(np.array([[1.2]]))


def test_unique_successful_attacks() -> None:
    attacks = ["a", "a", "b", "c", "d"]
    assert unique_successful_attacks(attacks, np.array([True, True, True, False, False])) == 2
    assert unique_successful_attacks(attacks, np.zeros(5, bool)) == 0


def test_diversity_on_hand_built_embeddings() -> None:
    assert diversity(np.eye(3)) == pytest.approx(1.0)  # orthogonal: mean cosine 0
    assert diversity(np.array([[1.0, 0.0], [2.0, 0.0]])) == pytest.approx(0.0)  # same direction
    assert diversity(np.array([[1.0, 0.0], [-3.0, 0.0]])) == pytest.approx(2.0)  # opposite
    # cosines 0, 1/√2, 1/√2 -> mean √2/3
    assert diversity(np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])) == pytest.approx(1 - math.sqrt(2) / 3)
    assert diversity(np.zeros((0, 4))) == 0.0 and diversity(np.ones((1, 4))) == 0.0
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(7, 5))
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    sims = unit @ unit.T
    brute = 1 - (sims.sum() - np.trace(sims)) / (7 * 6)
    assert diversity(emb) == pytest.approx(brute)
    with pytest.raises(ValueError, match="non-zero"):
        diversity(np.array([[1.0, 0.0], [0.0, 0.0]]))


def test_red_team_summary() -> None:
    attacks = ["x", "y", "x", "z"]
    tox = np.array([[0.9, 0.9], [0.6, 0.7], [0.95, 0.8], [0.1, 0.9]])
    emb = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [5.0, 5.0]])
    s = red_team_summary(attacks, tox, emb)
    assert s["num_attacks"] == 4 and s["num_successful"] == 3 and s["num_unique_successful"] == 2
    assert s["attack_success_rate"] == 0.75
    # successful rows 0, 1, 2: cosines (0,1)=0, (0,2)=1, (1,2)=0 -> mean 1/3
    assert s["diversity_successful"] == pytest.approx(2 / 3)


# ------------------------------------------------------------------------------ reward heap


def _levenshtein(a, b) -> int:
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


def test_edit_distances_match_plain_levenshtein() -> None:
    rng = np.random.default_rng(0)
    seqs = [tuple(rng.integers(0, 4, rng.integers(0, 9))) for _ in range(40)]
    width = max(len(s) for s in seqs)
    mat = np.full((len(seqs), width), -1)
    for r, s in enumerate(seqs):
        mat[r, : len(s)] = s
    lengths = np.array([len(s) for s in seqs])
    for q in seqs[:12]:
        np.testing.assert_array_equal(edit_distances(q, mat, lengths), [_levenshtein(q, s) for s in seqs])
    assert edit_distances((1, 2, 3), mat[:0], lengths[:0]).shape == (0,)


def item(tokens, reward, **kw) -> HeapItem:
    return HeapItem(tokens=tuple(tokens), reward=reward, **kw)


def _pairwise_near(buf: RewardHeap) -> bool:
    tol = buf.config.edit_tolerance
    items = buf.items()
    return any(
        _levenshtein(a.tokens, b.tokens) < tol * (len(a.tokens) + len(b.tokens))
        for a, b in itertools.combinations(items, 2)
    )


def test_edit_distance_dedup() -> None:
    buf = RewardHeap(RewardHeapConfig(capacity=10, strip_token_ids=(0,)))
    a = item([1, 2, 3, 4, 5, 6, 7, 8], 1.0)
    near = [1, 2, 3, 4, 5, 6, 7, 9]  # distance 1 < 0.25 * 16
    assert buf.add([a, item(near, 0.5), item(near, 1.0)]) == [True, False, False]  # ties keep the stored one
    assert buf.stats()["near_duplicate_drops"] == 2
    assert buf.add([item(near + [0, 0], 2.0)]) == [True]  # EOS (0) stripped: still near; better: replaces a
    assert [it.reward for it in buf] == [2.0] and buf.stats()["near_duplicate_replacements"] == 1
    far = [11, 12, 13, 14, 15, 16, 17, 18]
    # distance 4 == 0.25 * 16 is not "<": kept as a different attack
    four_off = [1, 2, 3, 4, 15, 16, 17, 18]
    assert buf.add([item(far, 0.1), item(four_off, 0.2)]) == [True, True]
    assert len(buf) == 3 and not _pairwise_near(buf)
    # a new item close to two stored ones, better than both, replaces both
    buf2 = RewardHeap(RewardHeapConfig(capacity=10))
    buf2.add([item([1, 2, 3, 4], 0.0), item([1, 2, 3, 5, 6, 7], 0.1)])  # distance 3 >= 2.5: both kept
    assert buf2.add([item([1, 2, 3, 5], 1.0)]) == [True]  # distances 1 (< 2) and 2 (< 2.5)
    assert [it.tokens for it in buf2] == [(1, 2, 3, 5)]


def test_exact_duplicates_are_rejected_even_if_better() -> None:
    buf = RewardHeap(RewardHeapConfig(capacity=5, edit_tolerance=None))
    offered = [item([1, 2], 0.0, text="hi"), item([3, 4], 9.0, text="hi"), item([1, 2], 9.0)]
    assert buf.add(offered) == [True, False, True]  # the text decides when given
    assert buf.stats()["exact_duplicates"] == 1
    no_text = RewardHeap(RewardHeapConfig(capacity=5, edit_tolerance=None))
    assert no_text.add([item([1, 2], 0.0), item([1, 2], 5.0)]) == [True, False]


def test_cosine_dedup() -> None:
    cfg = RewardHeapConfig(capacity=5, edit_tolerance=None, cosine_tolerance=0.9)
    buf = RewardHeap(cfg)
    e = lambda *v: np.array(v, np.float32)  # noqa: E731
    assert buf.add([item([1], 1.0, embedding=e(1, 0)), item([2], 0.5, embedding=e(10, 1))]) == [True, False]
    assert buf.add([item([3], 0.5, embedding=e(1, 1))]) == [True]  # cosine 0.707: different enough
    assert buf.add([item([4], 2.0, embedding=e(1, 0.05))]) == [True]  # beats [1]: replaces it
    assert sorted(it.tokens for it in buf) == [(3,), (4,)]
    with pytest.raises(ValueError, match="needs an embedding"):
        buf.add([item([5], 0.0)])


def test_eviction_order() -> None:
    buf = RewardHeap(RewardHeapConfig(capacity=3, edit_tolerance=None))
    assert buf.add([item([1], 5.0), item([2], 1.0), item([3], 3.0)]) == [True] * 3
    assert buf.add([item([4], 2.0)]) == [True]  # evicts reward 1
    assert buf.add([item([5], 1.5), item([6], 2.0)]) == [False, False]  # not strictly better than min 2
    assert sorted(it.reward for it in buf) == [2.0, 3.0, 5.0]
    assert buf.add([item([7], 4.0)]) == [True]  # evicts 2
    assert sorted(it.reward for it in buf) == [3.0, 4.0, 5.0]
    s = buf.stats()
    assert (s["evictions"], s["capacity_drops"], s["size"], s["min_reward"]) == (2, 2, 3, 3.0)
    # after many replacements (stale heap entries compacted away) the minimum is still right
    chain = RewardHeap(RewardHeapConfig(capacity=3))
    for k in range(200):
        assert chain.add([item([1, 2, 3, 4, 5, 6, 7, 100 + k], float(k))]) == [True]  # replaces k - 1
    assert len(chain) == 1 and len(chain._heap) < 40
    chain.add([item([20, 21, 22, 23], 500.0), item([30, 31, 32, 33], 150.0)])
    assert chain.add([item([40, 41, 42, 43], 160.0)]) == [True]  # evicts 150, not a stale entry
    assert sorted(it.reward for it in chain) == [160.0, 199.0, 500.0]
    ties = RewardHeap(RewardHeapConfig(capacity=2, edit_tolerance=None))
    ties.add([item([1], 1.0), item([2], 1.0), item([3], 3.0)])
    assert [it.tokens for it in ties] == [(2,), (3,)]  # equal rewards: the older one goes first


def test_sampling_follows_softmax_of_priority() -> None:
    rewards = [0.0, 5.0, 1.0, 2.0, -1.0]
    priorities = [0.0, 1.0, 2.0, 0.5, -1.0]
    buf = RewardHeap(RewardHeapConfig(capacity=10, edit_tolerance=None))
    buf.add([item([i], r, priority=p) for i, (r, p) in enumerate(zip(rewards, priorities))])
    want = np.exp(priorities) / np.exp(priorities).sum()
    np.testing.assert_allclose(buf.probabilities(), want)
    draws = buf.sample(np.random.default_rng(0), 40000, replace=True)
    freq = np.bincount([d.tokens[0] for d in draws], minlength=5) / 40000
    assert 0.5 * np.abs(freq - want).sum() < 0.01  # total variation; its sd here is ~0.003
    # without replacement: successive sampling; P(first two drawn = {1, 2}) exactly
    p = want
    pair = p[1] * p[2] / (1 - p[1]) + p[2] * p[1] / (1 - p[2])
    rng = np.random.default_rng(1)
    hits = sum({d.tokens[0] for d in buf.sample(rng, 2)} == {1, 2} for _ in range(4000))
    assert abs(hits / 4000 - pair) < 4 * math.sqrt(pair * (1 - pair) / 4000)
    assert sorted(d.tokens[0] for d in buf.sample(rng, 5)) == [0, 1, 2, 3, 4]
    uniform = RewardHeap(RewardHeapConfig(capacity=10, edit_tolerance=None, priority_inv_temp=0.0))
    uniform.add([item([i], r) for i, r in enumerate(rewards)])
    np.testing.assert_allclose(uniform.probabilities(), np.full(5, 0.2))
    with pytest.raises(BufferEmptyError):
        buf.sample(rng, 6)
    with pytest.raises(BufferEmptyError):
        RewardHeap().sample(rng, 1, replace=True)


def _random_items(rng: np.random.Generator, n: int) -> list[HeapItem]:
    out = []
    for i in range(n):
        toks = rng.integers(1, 6, rng.integers(3, 9))
        out.append(
            HeapItem(
                tokens=tuple(toks), reward=float(rng.normal()), priority=float(rng.normal()),
                text=" ".join(map(str, toks)), embedding=rng.normal(size=4).astype(np.float32),
                payload={"i": i, "victim_answers": [f"answer {i}"]},
            )
        )
    return out


def _snapshot(buf: RewardHeap):
    def emb(it: HeapItem):
        return None if it.embedding is None else it.embedding.tolist()

    return [(it.tokens, it.reward, it.priority, it.text, it.payload, emb(it)) for it in buf]


def test_state_round_trip_and_deterministic_rebuild() -> None:
    cfg = RewardHeapConfig(capacity=12, cosine_tolerance=0.95, strip_token_ids=(5,))
    rng = np.random.default_rng(0)
    items = _random_items(rng, 80)
    buf = RewardHeap(cfg)
    buf.add(items[:60])
    s = buf.stats()
    assert len(buf) == 12 and s["evictions"] + s["capacity_drops"] > 0 and s["near_duplicate_drops"] > 0
    state = json.loads(json.dumps(buf.state_dict()))  # survives JSON
    restored = RewardHeap(cfg)
    restored.load_state_dict(state)
    assert _snapshot(restored) == _snapshot(buf) and restored.stats() == buf.stats()
    draw = lambda b: [it.tokens for it in b.sample(np.random.default_rng(7), 5)]  # noqa: E731
    assert draw(restored) == draw(buf)
    # both continue identically
    assert restored.add(items[60:]) == buf.add(items[60:])
    assert _snapshot(restored) == _snapshot(buf) and restored.state_dict() == buf.state_dict()
    # re-adding the same sequence to a fresh buffer rebuilds the same state
    again = RewardHeap(cfg)
    again.add(items)
    assert again.state_dict() == buf.state_dict()
    with pytest.raises(ValueError, match="capacity"):
        other = RewardHeapConfig(capacity=13, cosine_tolerance=0.95, strip_token_ids=(5,))
        RewardHeap(other).load_state_dict(state)
