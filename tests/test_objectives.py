"""Objectives: hand-computed values, group bookkeeping, exact accumulation, bad input."""

from __future__ import annotations

import dataclasses
import functools
import math
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tbajax.batch import Batch
from tbajax.objectives import (
    OBJECTIVES,
    GRPOConfig,
    ObjectiveInputs,
    ObjectiveSpec,
    TBAPrimeConfig,
    Ratio,
    combine_metrics,
    gather_aux,
    get_objective,
    metric_values,
    validate_batch,
)

PROMPT = 2  # prompt tokens before each response; their (junk) log-probs must be ignored
# XLA's optimisations cost most of the compile time of these tiny programs and buy nothing here
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def enable_x64(on: bool = True):
    """float64 for this scope (jax.enable_x64 where it exists, else the jax.experimental one)."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(on)
    from jax.experimental import disable_x64
    from jax.experimental import enable_x64 as legacy

    return legacy() if on else disable_x64()


@pytest.fixture(autouse=True)
def x64():
    with enable_x64(True):
        yield


@dataclasses.dataclass
class Row:
    pol: np.ndarray  # response-token log-probs under the policy being trained
    ref: np.ndarray
    beh: np.ndarray
    reward: float
    gid: int
    pid: int = 0  # prompt id (for the learned log Z table)
    real: bool = True


def split(total: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """n token log-probs summing to `total` (so sums, not single tokens, are exercised)."""
    return total * rng.dirichlet(np.ones(n))


B, T = 16, 8  # one shape for every batch, so each objective compiles once for the whole file


def build(rows: list[Row], beta: float, seed: int = 0):
    """(Batch, policy logprobs [B, T], prompt ids) in float64, padded to B rows with wild padding
    rows (group id B − 1) and with junk log-probs outside the loss mask."""
    rng = np.random.default_rng(seed)
    rows = rows + [pad_row(B - 1, rng) for _ in range(B - len(rows))]
    lp = rng.normal(-3.0, 2.0, (B, T))  # junk: prompt tokens, padding
    ref, beh = np.zeros((B, T)), np.zeros((B, T))
    loss = np.zeros((B, T), bool)
    attn = np.zeros((B, T), bool)
    for i, r in enumerate(rows):
        n = len(r.pol)
        sl = slice(PROMPT, PROMPT + n)
        lp[i, sl], ref[i, sl], beh[i, sl] = r.pol, r.ref, r.beh
        loss[i, sl] = True
        attn[i, : PROMPT + n] = True
    batch = Batch(
        tokens=jnp.asarray(rng.integers(3, 100, (B, T)), jnp.int32),
        attention_mask=jnp.asarray(attn),
        loss_mask=jnp.asarray(loss),
        behavior_logprobs=jnp.asarray(beh),
        reference_logprobs=jnp.asarray(ref),
        reward=jnp.asarray([r.reward for r in rows], jnp.float64),
        group_id=jnp.asarray([r.gid for r in rows], jnp.int32),
        sample_mask=jnp.asarray([r.real for r in rows]),
        policy_version=jnp.zeros((B,), jnp.int32),
        prompt_id=jnp.asarray([r.pid for r in rows], jnp.int32),
        beta=jnp.asarray(beta, jnp.float64),
        token_versions=jnp.zeros((B, T), jnp.int32),
        current_version=jnp.asarray(0, jnp.int32),
    )
    return batch, jnp.asarray(lp), batch.prompt_id


def random_group(k: int, gid: int, rng, pid: int = 0) -> list[Row]:
    rows = []
    for _ in range(k):
        n = int(rng.integers(2, 6))
        pol = rng.normal(-1.0, 0.6, n)
        rows.append(
            Row(
                pol=pol,
                ref=pol + rng.normal(0, 0.3, n),
                beh=pol + rng.normal(0, 0.8, n),  # some ratios beyond the clips
                reward=float(rng.choice([0.0, 0.1, 1.0])),
                gid=gid,
                pid=pid,
            )
        )
    return rows


def pad_row(gid: int, rng) -> Row:
    """A padding row with wild values; it must not change anything."""
    return Row(pol=rng.normal(-1, 5, 3), ref=rng.normal(0, 5, 3), beh=rng.normal(0, 5, 3),
               reward=100.0, gid=gid, pid=0, real=False)


TABLE = np.array([3.0, -2.0, 10.0, 0.5, 7.0, -4.0])  # a learned log Z per prompt id


def with_log_z(spec: ObjectiveSpec, batch: Batch, pids, table):
    """(batch, aux) giving row i the log Z table[pids[i]]: the table rows for a per-prompt table;
    for a log Z head, one-hot prompt features and w = table (so every generic test of the table
    holds for the head too)."""
    if not spec.has_aux:
        return batch, None
    if spec.aux_scope == "shared":
        features = jax.nn.one_hot(pids, table.shape[0], dtype=table.dtype)
        return dataclasses.replace(batch, prompt_features=features), {"w": table[None], "b": jnp.zeros((1,), table.dtype)}
    return batch, gather_aux({"log_z": table}, pids)


@functools.cache
def _compiled(name: str, overrides: tuple):
    spec = get_objective(name)
    config = spec.make_config(dict(overrides))

    def f(batch, lp, pids, table):
        def total(x):
            b, aux = with_log_z(spec, batch, pids, table)
            loss, metrics = spec(b, x, config, aux)
            return loss.total, (loss, metrics)

        grad, (loss, metrics) = jax.grad(total, has_aux=True)(lp)
        return loss, metrics, grad

    return jax.jit(f, compiler_options=FAST_COMPILE)


def evaluate(name: str, batch: Batch, lp, pids, **overrides):
    """(loss Ratio, metrics, d loss.total / d logprobs as numpy), jitted per objective + config."""
    loss, metrics, grad = _compiled(name, tuple(sorted(overrides.items())))(
        batch, lp, pids, jnp.asarray(TABLE)
    )
    return loss, metrics, np.asarray(grad)


def total_and_grad(name, batch, lp, pids, **overrides):
    loss, _, grad = evaluate(name, batch, lp, pids, **overrides)
    return float(loss.total), float(loss.count), grad


# --------------------------------------------------------------------------- TB by hand


def value_grad(name, batch, lp, pids=None, **overrides):
    """(loss Ratio, metric values, d loss.value / d logprobs)."""
    pids = jnp.zeros((B,), jnp.int32) if pids is None else pids
    loss, metrics, grad = evaluate(name, batch, lp, pids, **overrides)
    return loss, metric_values(metrics), grad / float(loss.count)


def test_tb_hand_computed_group():
    beta = 0.014
    r = np.array([1.0, 0.0, 1.0, 0.0])
    S = np.array([-35.2, -42.7, -28.9, -50.3])
    R = np.array([-33.8, -40.1, -30.2, -47.9])
    # by hand: δ = S − R − r/β, log Ẑ = −mean δ, L = mean (δ − δ̄)², dL/dS = (2/K)(δ − δ̄)
    delta = S - R - r / beta
    np.testing.assert_allclose(-delta.mean(), 36.989286, atol=1e-6)
    np.testing.assert_allclose(((delta - delta.mean()) ** 2).mean(), 1190.427079, atol=1e-6)
    dlds = np.array([-17.919643, 17.194643, -16.569643, 17.294643])
    np.testing.assert_allclose(0.5 * (delta - delta.mean()), dlds, atol=1e-6)

    rng = np.random.default_rng(1)
    lengths = [3, 5, 4, 2]
    rows = [Row(split(s, n, rng), split(q, n, rng), split(s, n, rng), float(x), 0)
            for s, q, x, n in zip(S, R, r, lengths)]
    batch, lp, pids = build(rows, beta)
    loss, m, grad = value_grad("tb", batch, lp)
    assert float(loss.count) == 1.0
    np.testing.assert_allclose(float(loss.value), 1190.427079, atol=1e-5)
    np.testing.assert_allclose(m["log_z"], 36.989286, atol=1e-6)
    np.testing.assert_allclose(m["kl"], (S - R).mean(), atol=1e-9)
    np.testing.assert_allclose(m["residual_std"], math.sqrt(1190.427079), atol=1e-6)
    for i, n in enumerate(lengths):  # every scored token of row i carries dL/dS_i
        np.testing.assert_allclose(grad[i, PROMPT : PROMPT + n], dlds[i], atol=1e-5)
    assert np.all(grad[~np.asarray(batch.loss_mask)] == 0)  # prompt tokens, padding


def test_tb_gradient_identity_random():
    rng = np.random.default_rng(7)
    k, beta = 5, 0.37
    rows = random_group(k, 3, rng) + random_group(k, 1, rng) + random_group(k, 6, rng)
    rows = [rows[i] for i in rng.permutation(len(rows))] + [pad_row(3, rng)]
    for r in rows:
        r.reward = float(rng.normal())
    batch, lp, _ = build(rows, beta)
    grad = value_grad("tb", batch, lp)[2] * 3  # loss = mean over 3 groups
    for gid in (3, 1, 6):
        idx = [i for i, r in enumerate(rows) if r.gid == gid and r.real]
        S = np.array([rows[i].pol.sum() for i in idx])
        R = np.array([rows[i].ref.sum() for i in idx])
        r = np.array([rows[i].reward for i in idx])
        lhs = -(k * beta / 2) * grad[idx, PROMPT]
        rhs = (r - r.mean()) - beta * ((S - R) - (S - R).mean())
        np.testing.assert_allclose(lhs, rhs, rtol=1e-9, atol=1e-9)


def test_reinforce_gradient_is_beta_half_tb():
    rng = np.random.default_rng(3)
    batch, lp, _ = build(random_group(4, 0, rng) + random_group(4, 1, rng), 0.2)
    g_tb, g_rf = value_grad("tb", batch, lp)[2], value_grad("reinforce", batch, lp)[2]
    np.testing.assert_allclose(g_rf, 0.1 * g_tb, atol=1e-12)


# --------------------------------------------------------------------------- groups by id


NAMES = sorted(OBJECTIVES)


@pytest.mark.parametrize("name", NAMES)
def test_interleaved_groups_with_padding_match_separate(name):
    rng = np.random.default_rng(11)
    a = random_group(4, 0, rng, pid=2)
    b = random_group(3, 0, rng, pid=4)
    a[0].reward, a[1].reward = 0.0, 1.0  # DPO needs a reward gap in each group
    b[0].reward, b[1].reward = 1.0, 0.0
    beta = 0.05
    sep = [total_and_grad(name, *build(g, beta)) for g in (a, b)]

    ga, gb = 5, 2  # arbitrary ids; a padding row shares group a's id
    at = lambda row, gid: dataclasses.replace(row, gid=gid)  # noqa: E731
    mixed = [at(a[0], ga), at(b[0], gb), at(a[1], ga), pad_row(ga, rng), at(b[1], gb),
             at(a[2], ga), at(b[2], gb), at(a[3], ga), pad_row(7, rng)]
    total, count, grad = total_and_grad(name, *build(mixed, beta))
    np.testing.assert_allclose(total, sep[0][0] + sep[1][0], rtol=1e-10, atol=1e-12)
    assert count == sep[0][1] + sep[1][1]
    for (_, _, g_sep), where in zip(sep, ([0, 2, 5, 7], [1, 4, 6])):
        np.testing.assert_allclose(grad[where], g_sep[: len(where)], rtol=1e-9, atol=1e-12)
    assert np.all(grad[[3, 8]] == 0)  # padding rows
    assert np.all(grad[:, :PROMPT] == 0)


# --------------------------------------------------------------------------- TBA′ vs Dr. GRPO


@pytest.mark.parametrize("norm", ["sequence", "response", "constant"])
def test_tba_prime_at_beta_zero_is_dr_grpo(norm):
    rng = np.random.default_rng(5)
    rows = random_group(4, 0, rng) + random_group(4, 1, rng)
    rows[0].beh = rows[0].pol - 3.0  # ratio e³ > 8: the cap is active
    over = dict(length_norm=norm, norm_constant=16.0)
    batch, lp, pids = build(rows, 0.0)
    t1, c1, g1 = total_and_grad("tba_prime", batch, lp, pids, **over)
    t2, c2, g2 = total_and_grad("dr_grpo", batch, lp, pids, **over)
    assert (t1, c1) == (t2, c2)
    np.testing.assert_array_equal(g1, g2)
    assert np.all(g1[0] == 0) and np.any(g1[1] != 0)  # capped ratio: no gradient
    # with β > 0 the KL term changes the advantage
    batch = dataclasses.replace(batch, beta=jnp.asarray(0.5))
    assert total_and_grad("tba_prime", batch, lp, pids, **over)[0] != t2


def test_length_normalisers():
    rng = np.random.default_rng(8)
    rows = random_group(2, 0, rng)
    rows[0].pol, rows[1].pol = rows[0].pol[:2], rows[1].pol[:4]
    rows[0].ref, rows[1].ref, rows[0].beh, rows[1].beh = (r[:n] for r, n in (
        (rows[0].ref, 2), (rows[1].ref, 4), (rows[0].pol, 2), (rows[1].pol, 4)))
    batch, lp, pids = build(rows, 0.0)  # on-policy: ρ = 1, A = ±(r0 − r1)/2
    a = (rows[0].reward - rows[1].reward) / 2
    for norm, n0, n1 in (("response", 2, 4), ("sequence", PROMPT + 2, PROMPT + 4), ("constant", 10, 10)):
        loss, _, grad = value_grad("dr_grpo", batch, lp, length_norm=norm, norm_constant=10.0)
        np.testing.assert_allclose(float(loss.value), (-a * 2 / n0 + a * 4 / n1) / 2, atol=1e-12)
        np.testing.assert_allclose(grad[0, PROMPT], -a / n0 / 2, atol=1e-12)


def test_capped_ratio_gradients_stay_finite_for_huge_log_ratios():
    rng = np.random.default_rng(2)
    rows = random_group(3, 0, rng)
    rows[1].beh = rows[1].pol - 2000.0  # exp would overflow
    batch, lp, pids = build(rows, 0.01)
    for name in ("tba_prime", "dr_grpo", "icepop"):
        _, _, g = total_and_grad(name, batch, lp, pids)
        assert np.all(np.isfinite(g)) and np.all(g[1] == 0), name


# --------------------------------------------------------------------------- exact accumulation


@pytest.mark.parametrize("name", NAMES)
def test_micro_batch_ratios_accumulate_exactly(name):
    rng = np.random.default_rng(9)
    groups = [random_group(k, 0, rng, pid=p) for p, k in enumerate([3, 4, 2, 3])]
    for g in groups:
        g[0].reward, g[1].reward = 1.0, 0.0

    def loss_grad(parts):
        losses, grads, metrics = [], [], None
        for part in parts:
            rows = [dataclasses.replace(r, gid=j) for j, g in enumerate(part) for r in g]
            loss, m, grad = evaluate(name, *build(rows, 0.02))
            losses.append(loss)
            grads.append(grad[: len(rows)])
            metrics = m if metrics is None else combine_metrics(metrics, m)
        acc = sum(losses[1:], losses[0])
        return float(acc.value), np.concatenate(grads) / float(acc.count), metric_values(metrics)

    whole_value, whole_grad, whole_metrics = loss_grad([groups])
    assert np.isfinite(whole_value) and np.any(whole_grad != 0)
    for n in (2, 4):
        parts = [groups[i : i + 4 // n] for i in range(0, 4, 4 // n)]
        value, grad, metrics = loss_grad(parts)
        np.testing.assert_allclose(value, whole_value, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(grad, whole_grad, rtol=1e-10, atol=1e-14)
        assert metrics.keys() == whole_metrics.keys()
        for k in whole_metrics:
            assert np.isfinite(whole_metrics[k]), k
            np.testing.assert_allclose(metrics[k], whole_metrics[k], rtol=1e-10, atol=1e-14, err_msg=k)


def kl_centring_rows() -> list[Row]:
    """Two 2-token rows, β = 0.5. KL under the current policy: 0.5, −1 (mean −0.25); under the
    behaviour policy: −0.5, −1.5 (mean −1); r̄ = 0.5."""
    return [
        Row(pol=np.array([-1.0, -1.0]), ref=np.array([-1.5, -1.0]), beh=np.array([-2.0, -1.0]), reward=1.0, gid=0),
        Row(pol=np.array([-2.0, -1.0]), ref=np.array([-1.0, -1.0]), beh=np.array([-2.0, -1.5]), reward=0.0, gid=0),
    ]


@pytest.mark.parametrize(
    "name,overrides,advantage",
    [
        # A_i = (r_i − r̄) − β (KL_i − mean KL^c): current 0.5 − 0.5(0.5 + 0.25), −0.5 − 0.5(−1 + 0.25)
        ("tba_prime", (), (0.125, -0.125)),
        # behaviour: 0.5 − 0.5(0.5 + 1), −0.5 − 0.5(−1 + 1)
        ("tba_prime", (("kl_mean_source", "behaviour"),), (-0.25, -0.5)),
        ("tba_prime_paper", (), (-0.25, -0.5)),  # the paper's centring by name
        ("tba_prime_paper", (("kl_mean_source", "current"),), (0.125, -0.125)),
    ],
)
def test_tba_prime_kl_mean_source_hand_values(name, overrides, advantage):
    batch, lp, _ = build(kl_centring_rows(), 0.5)
    a0, a1 = advantage
    rho0, rho1 = (math.e, 1.0), (1.0, math.exp(0.5))  # π/π_old per token
    # ℓ_i = −A_i Σ_t ρ_t (norm 1), mean over the 2 rows
    loss, _, g = value_grad(name, batch, lp, length_norm="constant", norm_constant=1.0, **dict(overrides))
    np.testing.assert_allclose(float(loss.value), (-a0 * sum(rho0) - a1 * sum(rho1)) / 2, rtol=1e-12)
    # d ℓ_i / d log π_t = −A_i ρ_t (A is a constant), / 2 rows
    np.testing.assert_allclose(g[:2, PROMPT : PROMPT + 2], [[-a0 * r / 2 for r in rho0], [-a1 * r / 2 for r in rho1]],
                               atol=1e-12)


def test_tba_prime_kl_centrings_agree_on_policy_and_config_is_checked():
    rows = kl_centring_rows()
    for r in rows:
        r.beh = r.pol.copy()
    batch, lp, pids = build(rows, 0.5)
    t1, _, g1 = total_and_grad("tba_prime", batch, lp, pids)
    t2, _, g2 = total_and_grad("tba_prime_paper", batch, lp, pids)
    np.testing.assert_allclose(t1, t2, rtol=1e-12)
    np.testing.assert_allclose(g1, g2, atol=1e-12)
    with pytest.raises(ValueError, match="kl_mean_source='behavior'.*'current' or 'behaviour'"):
        TBAPrimeConfig(kl_mean_source="behavior")


# --------------------------------------------------------------------------- declared inputs


def test_declared_inputs_of_the_built_ins():
    def reads_ref(name, **over):
        spec = get_objective(name)
        return spec.inputs_for(spec.make_config(over)).reference_logprobs

    assert {n for n in NAMES if not reads_ref(n)} == {"dr_grpo", "icepop", "grpo", "rloo"}
    assert reads_ref("grpo", kl_penalty=True) and reads_ref("rloo", kl_in_reward=True)
    assert not reads_ref("reinforce", kl_in_reward=False)
    assert all(get_objective(n).inputs_for(get_objective(n).make_config()).behavior_logprobs for n in NAMES)

    def mine(batch, logprobs, config):  # says nothing: assumed to read everything
        raise AssertionError("not called")

    assert get_objective(mine).inputs_for(None) == ObjectiveInputs(True, True)
    lean = ObjectiveSpec(loss=mine, inputs=ObjectiveInputs(reference_logprobs=False), name="lean")
    assert not lean.inputs_for(None).reference_logprobs
    with pytest.raises(TypeError, match="inputs must be an ObjectiveInputs"):
        ObjectiveSpec(loss=mine, inputs=("reference",), name="bad")
    with pytest.raises(TypeError, match="returned 'yes'"):
        ObjectiveSpec(loss=mine, inputs=lambda c: "yes", name="bad").inputs_for(None)


@pytest.mark.parametrize("name", NAMES)
def test_declarations_are_truthful(name):
    """An objective that declares it does not read the reference log-probs gives the same loss,
    metrics and gradient whatever they hold (NaN included); one that declares it does, does not."""
    rng = np.random.default_rng(3)
    rows = random_group(3, 0, rng) + random_group(3, 1, rng)
    rows[0].reward, rows[1].reward, rows[3].reward, rows[4].reward = 1.0, 0.0, 0.0, 1.0
    batch, lp, pids = build(rows, 0.05)
    spec = get_objective(name)
    loss, metrics, grad = evaluate(name, batch, lp, pids)
    other = dataclasses.replace(batch, reference_logprobs=jnp.full_like(batch.reference_logprobs, jnp.nan))
    loss2, metrics2, grad2 = evaluate(name, other, lp, pids)
    if spec.inputs_for(spec.make_config()).reference_logprobs:
        assert not np.isfinite(float(loss2.value)) or float(loss2.value) != float(loss.value)
    else:
        assert float(loss2.value) == float(loss.value)
        np.testing.assert_array_equal(grad2, grad)
        assert {k: float(v) for k, v in metric_values(metrics2).items()} == {
            k: float(v) for k, v in metric_values(metrics).items()}
        assert "kl" not in metrics


def test_validate_batch_checks_only_declared_inputs():
    rng = np.random.default_rng(0)
    batch, lp, _ = build(random_group(3, 0, rng) + random_group(2, 1, rng), 0.1)
    nan_ref = dataclasses.replace(batch, reference_logprobs=batch.reference_logprobs.at[1, 3].set(jnp.nan))
    validate_batch(nan_ref, "dr_grpo")  # never read
    validate_batch(nan_ref, "tb", reference_from_trainer=True)  # the trainer scores them itself
    with pytest.raises(ValueError, match="reference_logprobs has 1 non-finite"):
        validate_batch(nan_ref, "tb")
    with pytest.raises(ValueError, match="reference_logprobs has 1 non-finite"):
        validate_batch(nan_ref, "grpo")  # config-dependent and no config given: check everything
    validate_batch(nan_ref, "grpo", objective_config=GRPOConfig())
    with pytest.raises(ValueError, match="reference_logprobs has 1 non-finite"):
        validate_batch(nan_ref, "grpo", objective_config=GRPOConfig(kl_penalty=True))


# --------------------------------------------------------------------------- baselines by hand


def ratio_rows(ratios_per_row, rewards, gid=0):
    """Rows whose behaviour log-prob is −1 per token and policy −1 + log ρ."""
    return [Row(pol=np.array([-1.0 + math.log(x) for x in rs]), ref=np.full(len(rs), -1.2),
                beh=np.full(len(rs), -1.0), reward=r, gid=gid) for rs, r in zip(ratios_per_row, rewards)]


def test_grpo_ppo_clip_by_hand():
    batch, lp, _ = build(ratio_rows([[1.5, 1.0], [1.5, 0.5]], [1.0, 0.0]), 0.1)
    a = 0.5 / math.sqrt(0.5)  # (r − r̄)/std with ddof=1: ±0.7071
    # row 0 (A=+a): min(1.5a, 1.2a) -> clipped, −1.2a; ρ=1 -> −a.       ℓ0 = (−1.2a − a)/2
    # row 1 (A=−a): min(−1.5a, −1.2a) = −1.5a -> +1.5a; ρ=.5 clipped -> +0.8a. ℓ1 = (1.5a+0.8a)/2
    expect = ((-1.2 * a - a) / 2 + (1.5 * a + 0.8 * a) / 2) / 2
    loss, m, g = value_grad("grpo", batch, lp, std_eps=0.0)
    np.testing.assert_allclose(float(loss.value), expect, rtol=1e-12)
    np.testing.assert_allclose(m["clip_frac"], 0.5)
    # d(−ρA)/d log π = −ρA, divided by 2 tokens and 2 sequences; clipped tokens get nothing
    np.testing.assert_allclose(g[:2, PROMPT : PROMPT + 2], [[0, -a / 4], [1.5 * a / 4, 0]], atol=1e-12)

    k3 = lambda d: math.exp(d) - d - 1  # noqa: E731  (d = log π_ref − log π)
    d = [[-0.2 - math.log(1.5), -0.2], [-0.2 - math.log(1.5), -0.2 - math.log(0.5)]]
    kl_term = sum(0.1 * (k3(x) + k3(y)) / 2 for x, y in d) / 2
    loss = value_grad("grpo", batch, lp, std_eps=0.0, kl_penalty=True)[0]
    np.testing.assert_allclose(float(loss.value), expect + kl_term, rtol=1e-12)


def test_rloo_leave_one_out_baseline_by_hand():
    rng = np.random.default_rng(0)
    rows = [Row(split(s, 3, rng), np.full(3, -1.0), split(s, 3, rng), r, 2)
            for s, r in zip([-4.0, -6.0, -5.0], [1.0, 0.0, 0.5])]
    rows.append(pad_row(2, rng))  # same id, reward 100: must not enter the baseline
    batch, lp, _ = build(rows, 0.1)
    adv = np.array([1.0 - 0.25, 0.0 - 0.75, 0.5 - 0.5])  # r_i − mean of the other two
    loss, _, g = value_grad("rloo", batch, lp)
    np.testing.assert_allclose(float(loss.value), (-adv * [-4.0, -6.0, -5.0]).mean(), rtol=1e-12)
    np.testing.assert_allclose(g[:3, PROMPT : PROMPT + 3], np.repeat(-adv[:, None] / 3, 3, 1), atol=1e-12)
    assert np.all(g[3:] == 0)


def test_online_dpo_pairs_best_with_worst_and_skips_ties():
    rng = np.random.default_rng(1)
    g0 = [Row(split(s, 2, rng), split(q, 2, rng), split(s, 2, rng), r, 0)
          for s, q, r in zip([-3.0, -2.0, -5.0, -4.0], [-3.5, -2.6, -4.0, -4.1], [0.2, 1.0, -0.5, 1.0])]
    g1 = [Row(split(-2.0, 2, rng), split(-2.0, 2, rng), split(-2.0, 2, rng), 0.3, 1) for _ in range(3)]
    rows = g0 + [pad_row(0, rng)] + g1  # padding row: id 0, reward 100, never the winner
    beta = 0.5
    batch, lp, _ = build(rows, beta)
    h_w, h_l = -2.0 - -2.6, -5.0 - -4.0  # winner: first of the tied best (row 1); loser row 2
    margin = beta * (h_w - h_l)
    loss, m, g = value_grad("online_dpo", batch, lp)
    np.testing.assert_allclose(float(loss.value), math.log1p(math.exp(-margin)), rtol=1e-12)
    assert float(loss.count) == 1.0
    np.testing.assert_allclose(m["pair_frac"], 0.5)
    np.testing.assert_allclose(m["margin"], margin, rtol=1e-12)
    s = 1 / (1 + math.exp(margin))  # 1 − σ(margin)
    expect = np.zeros(B)
    expect[1], expect[2] = -beta * s, beta * s
    np.testing.assert_allclose(g[:, PROMPT], expect, atol=1e-12)
    np.testing.assert_allclose(g[:, PROMPT + 1], expect, atol=1e-12)


def test_icepop_masks_tokens_outside_the_window():
    batch, lp, _ = build(ratio_rows([[10.0, 2.0, 1.0], [0.1, 1.0, 0.5]], [1.0, 0.0]), 0.0)
    # A = ±0.5; row 0 keeps ρ = 2, 1; row 1 keeps ρ = 1, 0.5; 3 response tokens each
    expect = (-(2 + 1) * 0.5 / 3 + (1 + 0.5) * 0.5 / 3) / 2
    loss, m, g = value_grad("icepop", batch, lp, length_norm="response")
    np.testing.assert_allclose(float(loss.value), expect, rtol=1e-12)
    np.testing.assert_allclose(m["clip_frac"], 2 / 6)
    np.testing.assert_allclose(m["ratio_max"], 10.0, rtol=1e-12)
    np.testing.assert_allclose(m["ratio_min"], 0.1, rtol=1e-12)
    expect_grad = [[0, -1 / 6, -1 / 12], [0, 1 / 12, 1 / 24]]  # −ρA / 3 tokens / 2 rows, kept only
    np.testing.assert_allclose(g[:2, PROMPT : PROMPT + 3], expect_grad, atol=1e-12)


# --------------------------------------------------------------------------- learned log Z


def test_learned_logz_matches_vargrad_at_the_optimum_and_learns_the_table():
    rng = np.random.default_rng(6)
    rows = random_group(4, 0, rng, pid=1) + random_group(4, 1, rng, pid=3)
    beta = 0.05
    batch, lp, pids = build(rows, beta)
    spec = get_objective("tb_learned_logz")
    cfg = spec.make_config()
    assert cfg.aux_lr_scale > 0 and spec.init_aux(cfg, 6)["log_z"].shape == (6,)

    delta = np.array([r.pol.sum() - r.ref.sum() - r.reward / beta for r in rows])
    dbar = {p: delta[[i for i, r in enumerate(rows) if r.pid == p]].mean() for p in (1, 3)}
    best = TABLE.copy()
    best[1], best[3] = -dbar[1], -dbar[3]

    @jax.jit
    def loss_grads(x, table):
        f = lambda x, t: spec(batch, x, cfg, gather_aux({"log_z": t}, pids))[0].value  # noqa: E731
        return f(x, table), jax.grad(f, argnums=(0, 1))(x, table)

    tb_loss, _, g_tb = value_grad("tb", batch, lp)
    loss, (g_lp, g_z) = loss_grads(lp, jnp.asarray(best))
    np.testing.assert_allclose(float(loss), float(tb_loss.value), rtol=1e-10)
    np.testing.assert_allclose(g_lp, g_tb, atol=1e-9)
    np.testing.assert_allclose(g_z, 0, atol=1e-9)
    # away from the optimum: dL/dlogZ_p = 2 (log Z_p + δ̄_p) / (2 groups); unused prompts get 0
    _, (_, g_z) = loss_grads(lp, jnp.asarray(TABLE))
    expect = np.zeros(6)
    for p in (1, 3):
        expect[p] = TABLE[p] + dbar[p]
    np.testing.assert_allclose(g_z, expect, rtol=1e-10)
    with pytest.raises(ValueError, match="needs per-row aux"):
        spec(batch, lp, cfg)


# --------------------------------------------------------------------------- registry & config


def test_registry_names_and_overrides():
    assert set(OBJECTIVES) == {"tb", "tb_learned_logz", "tb_logz_head", "tba_prime", "tba_prime_paper", "dr_grpo", "grpo", "rloo",
                               "reinforce", "online_dpo", "icepop"}
    with pytest.raises(ValueError, match=r"unknown objective 'trpo'.*'dr_grpo'.*'tb'"):
        get_objective("trpo")
    assert get_objective("grpo").make_config({"clip_eps": 0.1}) == GRPOConfig(clip_eps=0.1)
    with pytest.raises(ValueError, match=r"unknown GRPOConfig fields \['clip'\].*clip_eps"):
        get_objective("grpo").make_config({"clip": 0.1})
    assert get_objective("tbajax.objectives.policy_gradient:dr_grpo").loss is OBJECTIVES["dr_grpo"].loss.function
    with pytest.raises(ValueError, match="cannot import objective"):
        get_objective("tbajax.objectives:nope")
    with pytest.raises(ValueError, match="no Python file"):
        get_objective("/nonexistent/losses.py:f")
    with pytest.raises(ValueError, match="aux_lr_scale"):
        ObjectiveSpec(loss=lambda b, x, c, a: None, init_aux=lambda c, n: {})


def test_user_objective_from_a_file_as_in_the_package_docstring(tmp_path):
    import tbajax.objectives as objectives

    doc = objectives.__doc__
    code = textwrap.dedent(doc[doc.index("    # my_project/losses.py") : doc.index("and pass its path")])
    path = tmp_path / "losses.py"
    path.write_text(code)
    spec = get_objective(f"{path}:my_loss")
    assert spec.name == "my_loss" and spec.config_cls.__name__ == "MyConfig"
    rng = np.random.default_rng(0)
    rows = random_group(3, 1, rng) + random_group(3, 4, rng)
    batch, lp, pids = build(rows, 0.1)
    f = jax.jit(lambda b, x, c: spec(b, x, c)[0].value, static_argnums=2)  # configs are static
    # with scale = 1 it is REINFORCE without the KL term; the scale multiplies the loss
    expect = value_grad("reinforce", batch, lp, pids, kl_in_reward=False)[0].value
    np.testing.assert_allclose(f(batch, lp, spec.make_config()), expect, rtol=1e-12)
    np.testing.assert_allclose(f(batch, lp, spec.make_config({"scale": 3.0})), 3 * expect, rtol=1e-12)

    def bare(batch, logprobs, config):  # no annotation: config=None, no overrides
        loss = Ratio(-(batch.reward * (logprobs * batch.row_mask()).sum(-1)).sum(), jnp.asarray(1.0))
        return loss, {"loss": loss}

    spec = get_objective(bare)
    assert spec.make_config() is None and np.isfinite(float(spec(batch, lp, None)[0].value))
    with pytest.raises(ValueError, match="no config class"):
        spec.make_config({"x": 1})
    with pytest.raises(ValueError, match="takes no per-row aux"):
        spec(batch, lp, None, {"log_z": jnp.zeros(B)})


# --------------------------------------------------------------------------- float32, collate


def test_every_objective_on_a_collated_float32_batch():
    """The trainer's path: collate -> validate -> jit(grad) in float32 through token_logprobs."""
    from tbajax.batch import token_logprobs
    from tbajax.training.collate import collate
    from tbajax.trajectory import Trajectory

    rng = np.random.default_rng(0)

    def traj(g, r):
        n = int(rng.integers(1, 6))
        return Trajectory(prompt_id=g, group_id=g, prompt_tokens=rng.integers(3, 50, 3),
                          response_tokens=rng.integers(3, 50, n),
                          behavior_logprobs=rng.normal(-2, 1, n).astype(np.float32), reward=r,
                          reference_logprobs=rng.normal(-2, 1, n).astype(np.float32))

    groups = [[traj(g, r) for r in (1.0, 0.0, 0.0, 1.0)] for g in range(3)]
    with enable_x64(False):
        host = collate(groups, beta=0.05, num_rows=16, length_bucket=8)
        logits = jnp.asarray(rng.normal(0, 1, host.tokens.shape + (50,)), jnp.float32)
        batch = jax.tree.map(jnp.asarray, host)
        pids = jnp.zeros((16,), jnp.int32)
        specs = {name: get_objective(name) for name in NAMES}
        for spec in specs.values():
            validate_batch(host, spec)

        @functools.partial(jax.jit, compiler_options=FAST_COMPILE)  # one compile for all objectives
        def f(logits, batch):
            def loss(x, spec):
                lp = token_logprobs(x, batch.tokens, 0.7)
                b, aux = with_log_z(spec, batch, pids, jnp.zeros(3))
                return spec(b, lp, spec.make_config(), aux)[0].value

            return {n: jax.value_and_grad(loss)(logits, spec) for n, spec in specs.items()}

        for name, (value, grad) in f(logits, batch).items():
            assert value.dtype == jnp.float32 and np.isfinite(float(value)), name
            assert np.all(np.isfinite(np.asarray(grad))) and np.any(np.asarray(grad) != 0), name


# --------------------------------------------------------------------------- validation


def test_validate_batch_reports_bad_input():
    rng = np.random.default_rng(0)
    rows = random_group(3, 0, rng) + random_group(2, 1, rng)
    batch, lp, _ = build(rows, 0.1)
    validate_batch(batch, "tb", lp)  # fine

    lone = build(random_group(3, 0, rng) + random_group(1, 1, rng) + [pad_row(1, rng)], 0.1)[0]
    with pytest.raises(ValueError, match=r"fewer than 2 real samples.*\{1: 1\}"):
        validate_batch(lone)
    with pytest.raises(ValueError, match="reward has shape"):
        validate_batch(dataclasses.replace(batch, reward=batch.reward[:3]))
    with pytest.raises(ValueError, match="logprobs has shape"):
        validate_batch(batch, "tb", lp[:, :-1])
    with pytest.raises(ValueError, match=r"reward has 1 non-finite.*rows \[2\]"):
        validate_batch(dataclasses.replace(batch, reward=batch.reward.at[2].set(jnp.nan)))
    with pytest.raises(ValueError, match="behavior_logprobs has 1 non-finite"):
        bad = batch.behavior_logprobs.at[0, 3].set(-jnp.inf)
        validate_batch(dataclasses.replace(batch, behavior_logprobs=bad))
    with pytest.raises(ValueError, match=r"^logprobs has 1 non-finite"):
        validate_batch(batch, "dr_grpo", lp.at[4, 1].set(jnp.nan))
    zero = dataclasses.replace(batch, beta=jnp.asarray(0.0))
    with pytest.raises(ValueError, match="'tb' needs beta > 0"):
        validate_batch(zero, "tb")
    validate_batch(zero, "dr_grpo")  # β = 0 is fine without a KL term
    with pytest.raises(ValueError, match="beta must be >= 0"):
        validate_batch(dataclasses.replace(batch, beta=jnp.asarray(-0.1)), "grpo")
    with pytest.raises(ValueError, match="group_id must lie in"):
        validate_batch(dataclasses.replace(batch, group_id=batch.group_id.at[0].set(99)))
    with pytest.raises(ValueError, match="unknown objective"):
        validate_batch(batch, "tbb")


# --------------------------------------------------------------------------- learned log Z head


def test_logz_head_loss_and_gradients_by_hand():
    """log Z(x) = w·h(x) + b on hand-made prompt features; L = mean over groups of mean_i
    (log Z + δ_i)². By hand: ∂L/∂b = Σ_groups (2/G) mean_i(log Z_g + δ_i), ∂L/∂w the same
    weighted by h(x_g); the policy's gradient is tb_learned_logz's with log Z held fixed, and no
    gradient reaches the features."""
    rng = np.random.default_rng(11)
    rows = random_group(3, 0, rng, pid=1) + random_group(3, 1, rng, pid=4)
    beta = 0.2
    batch, lp, pids = build(rows, beta)
    spec = get_objective("tb_logz_head")
    cfg = spec.make_config()
    assert spec.aux_scope == "shared" and spec.inputs_for(cfg).prompt_features
    assert spec.inputs_for(spec.make_config({"reference": False})).reference_logprobs is False
    head = spec.init_aux(cfg, 3)
    assert head["w"].shape == (1, 3) and head["b"].shape == (1,)
    feats = np.zeros((B, 3))
    feats[:3], feats[3:6] = [1.0, 2.0, 0.0], [0.0, -1.0, 3.0]  # one prompt state per group
    feats[6:] = rng.normal(0, 5, (B - 6, 3))  # padding rows: must not matter
    batch = dataclasses.replace(batch, prompt_features=jnp.asarray(feats))
    w, b = np.array([0.5, -0.25, 1.0]), 0.75
    log_z = {0: feats[0] @ w + b, 1: feats[3] @ w + b}  # 0.75 and 4.0
    delta = np.array([r.pol.sum() - r.ref.sum() - r.reward / beta for r in rows])
    gid = np.array([r.gid for r in rows])
    per_group = [np.mean((log_z[g] + delta[gid == g]) ** 2) for g in (0, 1)]

    def f(x, head, features):
        return spec(dataclasses.replace(batch, prompt_features=features), x, cfg, head)[0].value

    with enable_x64():
        head = {"w": jnp.asarray(w[None]), "b": jnp.asarray([b])}
        loss, (g_lp, g_head, g_feat) = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(
            lp, head, jnp.asarray(feats))
        table = jnp.asarray([0, log_z[0], 0, 0, log_z[1], 0])  # by prompt id: 1 and 4
        g_table_lp = jax.grad(lambda x: get_objective("tb_learned_logz")(
            batch, x, get_objective("tb_learned_logz").make_config(), gather_aux({"log_z": table}, pids))[0].value)(lp)
    np.testing.assert_allclose(float(loss), np.mean(per_group), rtol=1e-10)
    resid = {g: np.mean(log_z[g] + delta[gid == g]) for g in (0, 1)}  # 2/2 groups · mean residual
    np.testing.assert_allclose(float(g_head["b"][0]), resid[0] + resid[1], rtol=1e-10)
    np.testing.assert_allclose(np.asarray(g_head["w"][0]), resid[0] * feats[0] + resid[1] * feats[3], rtol=1e-10)
    np.testing.assert_allclose(np.asarray(g_feat), 0.0)  # stop-gradient: nothing flows into h(x)
    np.testing.assert_allclose(np.asarray(g_lp), np.asarray(g_table_lp), atol=1e-12)
    with pytest.raises(ValueError, match="prompt_features"):
        spec(dataclasses.replace(batch, prompt_features=None), lp, cfg, head)
