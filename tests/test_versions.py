"""Per-token param versions (in-flight weight updates): Trajectory -> store -> buffer -> batch ->
lag metrics, and the policy-gradient objectives' stale-token mask / cap, on hand-made data."""

from __future__ import annotations

import dataclasses
import math
import tarfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tbajax.batch import Batch
from tbajax.buffer import BufferConfig, make_buffer
from tbajax.objectives import (
    DrGRPOConfig,
    GRPOConfig,
    ReinforceConfig,
    RLOOConfig,
    TBAPrimeConfig,
    dr_grpo,
    get_objective,
    grpo,
    reinforce,
    rloo,
    tba_prime,
    validate_batch,
)
from tbajax.stores import TrajectoryReader, TrajectoryWriter, discover_searcher_stores, trajectory_store_url
from tbajax.system.distributed import decode_groups, encode_groups
from tbajax.training.collate import collate
from tbajax.trajectory import Trajectory

# a v2 store (before per-token versions) written by tbajax at commit db410da; its rows are
# listed in `test_old_v2_store_loads_with_every_token_at_its_policy_version`
V2_STORE = Path(__file__).parent / "data" / "trajectories_v2_store.tar.gz"


def row(versions, *, prompt=(1, 2), pid=0, group=0, reward=0.0, policy_version=None, sid=0) -> Trajectory:
    """A row whose response is len(versions) tokens; token_versions omitted when `versions` is an int
    (then it is the response length and the row has one version, `policy_version`)."""
    if isinstance(versions, int):
        n, tv = versions, None
    else:
        n, tv = len(versions), np.asarray(versions, np.int32)
    pv = policy_version if policy_version is not None else (int(min(versions)) if tv is not None and n else 0)
    return Trajectory(
        prompt_id=pid,
        group_id=group,
        prompt_tokens=np.asarray(prompt, np.int32),
        response_tokens=np.arange(10, 10 + n, dtype=np.int32),
        behavior_logprobs=-np.arange(1, n + 1, dtype=np.float32) / 8,
        reward=reward,
        policy_version=pv,
        searcher_id=sid,
        token_versions=tv,
    )


# ------------------------------------------------------------------ the record


def test_trajectory_token_versions_default_and_checks() -> None:
    t = row(3, policy_version=5)
    assert t.token_versions.dtype == np.int32 and t.token_versions.tolist() == [5, 5, 5]
    assert not t.mixed_versions
    m = row([4, 4, 6])
    assert m.policy_version == 4 and m.mixed_versions and m.token_versions.tolist() == [4, 4, 6]
    assert not row([], policy_version=3).mixed_versions
    with pytest.raises(ValueError, match="one entry per response token"):
        Trajectory(**{**_fields(m), "token_versions": np.array([4, 4])})
    with pytest.raises(ValueError, match="oldest of token_versions is 4"):
        row([4, 5], policy_version=5)
    with pytest.raises(ValueError, match="integer array"):
        Trajectory(**{**_fields(m), "token_versions": np.array([4.0, 4.0, 6.0])})


def _fields(t: Trajectory) -> dict:
    return {f: getattr(t, f) for f in t.__dataclass_fields__}


# ------------------------------------------------------------------ the store


def test_store_round_trip_with_and_without_token_versions(tmp_path: Path) -> None:
    url = trajectory_store_url(tmp_path, 0)
    uniform = [row(3, policy_version=7), row(0, policy_version=7), row(2, policy_version=8)]
    mixed = [row([7, 8, 8, 9]), row(2, policy_version=9), row([9, 9, 10])]
    writer = TrajectoryWriter(url, searcher_id=0)
    writer.append(uniform)  # an append of single-version rows writes no token_versions data
    assert not (tmp_path / "trajectories/searcher-0/token_versions/c").exists()
    writer.append(mixed)
    got = TrajectoryReader(url).read_new()
    assert len(got) == 6
    for a, b in zip(got, uniform + mixed):
        assert a.policy_version == b.policy_version
        assert a.token_versions.dtype == np.int32
        np.testing.assert_array_equal(a.token_versions, b.token_versions)
        np.testing.assert_array_equal(a.response_tokens, b.response_tokens)
    assert [t.mixed_versions for t in got] == [False, False, False, True, False, True]
    # random access inside the mixed append, and a reader that starts there
    assert TrajectoryReader(url, start_row=5).read_new()[0].token_versions.tolist() == [9, 9, 10]
    assert [t.token_versions.tolist() for t in TrajectoryReader(url).read(3, 5)] == [[7, 8, 8, 9], [9, 9]]


def test_old_v2_store_loads_with_every_token_at_its_policy_version(tmp_path: Path) -> None:
    with tarfile.open(V2_STORE) as tar:
        tar.extractall(tmp_path, filter="data")
    stores = discover_searcher_stores(tmp_path)
    assert list(stores) == [0]
    got = TrajectoryReader(stores[0]).read_new()
    # written as: row i has prompt [1, 2, 3], response 10..10+i, behaviour -(1..i+1)/4, reward i,
    # policy_version 7 + i // 2, wall time 1.5e9 + i, reference log-probs (-1) on row 1, extras {"a": 2} on row 2
    assert len(got) == 4
    for i, t in enumerate(got):
        assert t.prompt_id == i and t.group_id == i // 2 and t.reward == float(i)
        assert t.policy_version == 7 + i // 2 and t.wall_time == 1.5e9 + i
        assert t.response_tokens.tolist() == list(range(10, 11 + i))
        np.testing.assert_array_equal(t.behavior_logprobs, -np.arange(1, i + 2, dtype=np.float32) / 4)
        assert t.token_versions.tolist() == [7 + i // 2] * (i + 1)  # the default: one version per row
        assert not t.mixed_versions
    assert got[1].reference_logprobs.tolist() == [-1.0, -1.0] and got[0].reference_logprobs is None
    assert got[2].extras == {"a": 2}
    # a resumed searcher keeps appending to its v2 store: single-version rows fit, mixed ones do not
    writer = TrajectoryWriter(stores[0], searcher_id=0)
    assert writer.append([row(2, policy_version=9)]) == 5
    with pytest.raises(ValueError, match="format tbajax.trajectories.v2, which has no per-token versions"):
        writer.append([row([9, 10])])
    assert writer.committed_rows() == 5
    back = TrajectoryReader(stores[0]).read(4, 5)[0]
    assert back.token_versions.tolist() == [9, 9]
    assert '"format": "tbajax.trajectories.v2"' in (tmp_path / "trajectories/searcher-0/commit.json").read_text()


def test_multihost_group_blob_keeps_token_versions() -> None:
    groups = [[row([3, 4]), row(1, policy_version=3)], [row([5, 5, 6], group=1)]]
    back = decode_groups(encode_groups(groups))
    assert [[t.token_versions.tolist() for t in g] for g in back] == [[[3, 4], [3]], [[5, 5, 6]]]


def test_buffer_keeps_token_versions() -> None:
    for mode in ("replay", "fifo_once"):
        buf = make_buffer(BufferConfig(mode=mode, samples_per_group=2, capacity_per_prompt=10, recency_prob=0.0))
        buf.add([row([2, 3, 3], group=4), row([3, 3, 3, 3], group=4)])
        (g,) = buf.sample(np.random.default_rng(0), 1, current_version=3)
        assert sorted(t.token_versions.tolist() for t in g) == [[2, 3, 3], [3, 3, 3, 3]]


# ------------------------------------------------------------------ the batch


def test_collate_pads_token_versions_and_sets_current_version() -> None:
    groups = [[row([5, 6, 6]), row(1, policy_version=6)], [row([4, 6], prompt=(7,), pid=1)] * 2]
    b = collate(groups, beta=0.1, num_rows=5, length_bucket=8, current_version=7)
    assert b.token_versions.dtype == np.int32 and b.token_versions.shape == (5, 8)
    assert b.token_versions.tolist() == [
        [0, 0, 5, 6, 6, 0, 0, 0],  # prompt (2 tokens) 0, response versions, padding 0
        [0, 0, 6, 0, 0, 0, 0, 0],
        [0, 4, 6, 0, 0, 0, 0, 0],
        [0, 4, 6, 0, 0, 0, 0, 0],
        [0] * 8,  # padding row
    ]
    assert b.policy_version.tolist() == [5, 6, 4, 4, 0]
    assert b.current_version.shape == () and int(b.current_version) == 7
    validate_batch(b, "dr_grpo")
    assert int(collate(groups, beta=0.1).current_version) == 0  # default
    with pytest.raises(ValueError, match="token_versions has shape"):
        validate_batch(_replace(b, token_versions=b.token_versions[:, :4]), "dr_grpo")
    with pytest.raises(ValueError, match="current_version must be a scalar"):
        validate_batch(_replace(b, current_version=np.zeros(5, np.int32)), "dr_grpo")
    with pytest.raises(ValueError, match="token_versions must hold integer"):
        validate_batch(_replace(b, token_versions=b.token_versions.astype(np.float32)), "dr_grpo")


def _replace(b: Batch, **kw) -> Batch:
    return dataclasses.replace(b, **kw)


def test_lag_metrics_per_sample_and_per_token() -> None:
    from tbajax.system.trainer import Learner

    groups = [[row([8, 9, 9]), row([10, 10])], [row(1, policy_version=7), row([7, 9])]]
    b = collate(groups, beta=0.0, current_version=10)
    m = Learner.batch_metrics(groups, b, current_version=10)
    # token lags: [2, 1, 1], [0, 0], [3], [3, 1] -> 11 / 8, max 3; sample lags 2, 0, 3, 3
    assert m["token_lag_mean"] == pytest.approx(11 / 8) and m["token_lag_max"] == 3
    assert m["policy_lag_mean"] == pytest.approx(8 / 4) and m["policy_lag_max"] == 3


# ------------------------------------------------------------------ stale tokens in the objectives

L2 = math.log(2.0)
# 4 rows (groups {0, 1}, {2, 3}), 1 prompt token + 3 response tokens; the trainer is at version 10.
# Behaviour log-probs are all -1; the policy's are -1 + log rho, rho per token below.
RHO = np.array([[1, 2, 1], [2, 2, 1], [2, 1, 2], [2, 1, 1]], np.float64)
VERSIONS = np.array([[8, 9, 10], [10, 10, 10], [7, 7, 9], [9, 10, 10]], np.int32)
REWARD = np.array([1.0, 0.0, 2.0, 0.0])
# max lag 1: stale = version < 9 -> row 0 token 0 (rho 1), row 2 tokens 0 (rho 2) and 1 (rho 1)
STALE = np.array([[1, 0, 0], [0, 0, 0], [1, 1, 0], [0, 0, 0]], bool)


def hand_batch(versions: np.ndarray = VERSIONS) -> tuple[Batch, jax.Array]:
    b, t = 4, 4
    loss = np.zeros((b, t), bool)
    loss[:, 1:] = True
    lp = np.full((b, t), -7.5)  # junk on the prompt token
    lp[:, 1:] = -1.0 + np.log(RHO)
    tv = np.zeros((b, t), np.int32)
    tv[:, 1:] = versions
    batch = Batch(
        tokens=jnp.asarray(np.arange(b * t).reshape(b, t) % 50 + 3, jnp.int32),
        attention_mask=jnp.ones((b, t), bool),
        loss_mask=jnp.asarray(loss),
        behavior_logprobs=jnp.asarray(np.where(loss, -1.0, 0.0), jnp.float32),
        reference_logprobs=jnp.asarray(np.where(loss, -1.0, 0.0), jnp.float32),
        reward=jnp.asarray(REWARD, jnp.float32),
        group_id=jnp.asarray([0, 0, 2, 2], jnp.int32),
        sample_mask=jnp.ones((b,), bool),
        policy_version=jnp.asarray(versions.min(-1), jnp.int32),
        prompt_id=jnp.zeros((b,), jnp.int32),
        beta=jnp.asarray(0.0, jnp.float32),
        token_versions=jnp.asarray(tv),
        current_version=jnp.asarray(10, jnp.int32),
    )
    return batch, jnp.asarray(lp, jnp.float32)


def loss_of(fn, config, batch=None, lp=None) -> float:
    if batch is None:
        batch, lp = hand_batch()
    loss, _ = fn(batch, lp, config)
    return float(loss.value)


A = 1 / math.sqrt(2.0)  # every GRPO advantage is ±1/√2 here (groups of two, std with ddof=1)
CASES = {
    # dr_grpo, constant normaliser 1: per row -A_i Σ rho, A = ±0.5 (group 0), ±1 (group 1)
    # rows: -0.5·4, +0.5·5, -1·5, +1·4; masked: row 0 -0.5·3, row 2 -1·2; capped at 1: row 2 -1·4
    "dr_grpo": (dr_grpo, DrGRPOConfig(length_norm="constant"), -0.5 / 4, 3.0 / 4, 0.5 / 4),
    # GRPO (std_eps 0): token term -min(rho A, clip(rho, .8, 1.2) A) = -a, -1.2a (A>0) / +a, +2a (A<0),
    # divided by 3 tokens: rows -3.2a, +5a, -3.4a, +4a; masked: row 0 -2.2a, row 2 -1.2a;
    # capped: row 2's first token rho 2 -> 1, so row 2 -3.2a
    "grpo": (grpo, GRPOConfig(std_eps=0.0), 2.4 * A / 12, 5.6 * A / 12, 2.6 * A / 12),
    # RLOO: -(r_i - r_other) S_i, S = Σ log pi: rows -3+L, -3+2L, -3+2L, -3+L; masked S rows 0, 2:
    # -2+L, -1+L
    "rloo": (rloo, RLOOConfig(), -L2 / 4, (-5 + L2) / 4, None),
    # REINFORCE without KL: -(r_i - r̄) S_i, advantages ±0.5, ±1
    "reinforce": (reinforce, ReinforceConfig(kl_in_reward=False), -L2 / 8, (-2.5 + 0.5 * L2) / 4, None),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_stale_token_mask_and_cap_by_hand(name: str) -> None:
    fn, off, want_off, want_mask, want_cap = CASES[name]
    assert loss_of(fn, off) == pytest.approx(want_off, abs=1e-6)
    mask = dataclasses.replace(off, stale_token_max_lag=1)
    assert loss_of(fn, mask) == pytest.approx(want_mask, abs=1e-6)
    if want_cap is not None:
        cap = dataclasses.replace(off, stale_token_max_lag=1, stale_token_mode="cap", stale_token_ratio_cap=1.0)
        assert loss_of(fn, cap) == pytest.approx(want_cap, abs=1e-6)
    batch, lp = hand_batch()
    _, metrics = fn(batch, lp, mask)
    assert float(metrics["stale_frac"].value) == pytest.approx(3 / 12)
    assert "stale_frac" not in fn(batch, lp, off)[1]


@pytest.mark.parametrize("name", sorted(CASES))
def test_masked_tokens_get_no_gradient_and_the_others_keep_theirs(name: str) -> None:
    fn, off, *_ = CASES[name]
    batch, lp = hand_batch()
    mask = dataclasses.replace(off, stale_token_max_lag=1)
    g_off = np.asarray(jax.grad(lambda x: fn(batch, x, off)[0].value)(lp))[:, 1:]
    g_mask = np.asarray(jax.grad(lambda x: fn(batch, x, mask)[0].value)(lp))[:, 1:]
    assert (g_mask[STALE] == 0).all() and g_off[STALE].any()
    np.testing.assert_array_equal(g_mask[~STALE], g_off[~STALE])


@pytest.mark.parametrize("name", sorted(CASES))
def test_option_off_ignores_token_versions_bit_for_bit(name: str) -> None:
    fn, off, *_ = CASES[name]
    current, lp = hand_batch(np.full_like(VERSIONS, 10))
    wild, _ = hand_batch(np.full_like(VERSIONS, -(10**6)))
    a, b = fn(current, lp, off)[0], fn(wild, lp, off)[0]
    assert np.asarray(a.total).tobytes() == np.asarray(b.total).tobytes()
    # on, but with no token past the lag: the same bits as off
    lax = dataclasses.replace(off, stale_token_max_lag=10**7)
    c = fn(wild, lp, lax)[0]
    assert np.asarray(c.total).tobytes() == np.asarray(a.total).tobytes()


def test_tba_prime_masks_like_dr_grpo_at_beta_zero() -> None:
    cfg = dict(length_norm="constant", stale_token_max_lag=1)
    assert loss_of(tba_prime, TBAPrimeConfig(**cfg)) == pytest.approx(loss_of(dr_grpo, DrGRPOConfig(**cfg)), abs=1e-7)


def test_stale_token_mask_under_jit() -> None:
    batch, lp = hand_batch()
    cfg = dataclasses.replace(CASES["dr_grpo"][1], stale_token_max_lag=1)
    jitted = jax.jit(lambda b, x: dr_grpo(b, x, cfg)[0].value)
    assert float(jitted(batch, lp)) == pytest.approx(3.0 / 4, abs=1e-6)


@pytest.mark.parametrize(
    "objective, overrides, match",
    [
        ("dr_grpo", {"stale_token_max_lag": -1}, "stale_token_max_lag=-1"),
        ("grpo", {"stale_token_max_lag": 1.5}, "give an int >= 0"),
        ("tba_prime", {"stale_token_max_lag": True}, "give an int >= 0"),
        ("grpo", {"stale_token_max_lag": 2, "stale_token_mode": "drop"}, "choose 'mask'"),
        ("rloo", {"stale_token_max_lag": 2, "stale_token_mode": "cap"}, "has none"),
        ("reinforce", {"stale_token_mode": "cap"}, "has none"),
        ("dr_grpo", {"stale_token_ratio_cap": 0.0}, "finite number > 0"),
        ("tb", {"stale_token_max_lag": 1}, "unknown TBConfig fields"),
    ],
)
def test_stale_token_config_errors(objective: str, overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        get_objective(objective).make_config(overrides)


def test_stale_token_config_accepted() -> None:
    c = get_objective("grpo").make_config({"stale_token_max_lag": 2, "stale_token_mode": "cap",
                                           "stale_token_ratio_cap": 2.0})
    assert c.stale_token_max_lag == 2 and c.stale_token_mode == "cap"
    assert get_objective("rloo").make_config({"stale_token_max_lag": 0}).stale_token_max_lag == 0


def test_bad_stale_token_option_stops_the_launcher_before_any_role_starts(tmp_path, capsys) -> None:
    from tbajax.main import main

    run = tmp_path / "run"
    code = main([f"--run-dir={run}", "--quiet", "--objective=rloo",
                 "--set", "train.objective_options.stale_token_max_lag=2",
                 "--set", "train.objective_options.stale_token_mode=cap"])
    err = capsys.readouterr().err
    assert code == 2 and "RLOOConfig: stale_token_mode='cap'" in err, err
    assert not (run / "logs").exists()


def test_train_step_with_stale_mask_accumulates_exactly_over_micro_batches() -> None:
    """Through the real step (jit, micro-batch scan): `current_version` (a scalar) reaches every
    micro-batch, the masked loss of two micro-batches equals the whole batch's, and stale_frac is
    the share of scored tokens more than 1 version behind."""
    from tests.test_training import ACCUM_CONFIG, FAST_COMPILE, fresh_model, make_batch
    from tbajax.training import init_train_state, make_train_step, raise_on_bad_step

    batch = make_batch(0)
    rng = np.random.default_rng(1)
    versions = np.where(batch.loss_mask, rng.integers(0, 4, batch.loss_mask.shape), 0).astype(np.int32)
    batch = dataclasses.replace(batch, token_versions=versions, current_version=np.int32(3))
    scored = batch.loss_mask & batch.sample_mask[:, None]
    want_frac = float((scored & (versions < 2)).sum() / scored.sum())
    assert 0 < want_frac < 1
    losses = {}
    for m, lag in ((1, 1), (2, 1)):
        config = dataclasses.replace(ACCUM_CONFIG, num_microbatches=m)
        objective_config = DrGRPOConfig(stale_token_max_lag=lag)
        graphdef, state = init_train_state(fresh_model(), config)
        step = make_train_step(graphdef, config, "dr_grpo", objective_config, compiler_options=FAST_COMPILE)
        _, out = step(state, batch)
        metrics = raise_on_bad_step(out, 1)
        losses[m, lag] = metrics["loss"]
        assert metrics["stale_frac"] == pytest.approx(want_frac, abs=1e-6)
    assert losses[2, 1] == pytest.approx(losses[1, 1], rel=1e-5, abs=1e-7)
