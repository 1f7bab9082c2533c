"""Trajectory balance: the VarGrad form TBA uses by default, and a learned-log Z variant.

Per sample, δ_i = S_i − R_i − r_i/β (S, R: policy / reference log-prob sums over the response).
TB asks log Z(x) + δ_i = 0 for every response of prompt x. VarGrad replaces log Z by its best
per-group estimate −mean_group(δ) (stop-gradient), which leaves the within-group variance of δ.
Sequence sums: no length normalisation, no clipping, no importance weights.

Stale tokens: TB has no stale-token option and reads no `batch.token_versions`. Trajectory
balance is off-policy by construction (any sampling policy with full support gives the same
optimum), so a sample whose tokens come from older or several param versions trains like any
other; the behaviour log-probs (whatever version produced each token) are used as before, for
the off-policy diagnostics only (ratio_*, logprob_gap). The policy-gradient objectives are the
ones that mask or cap stale tokens (`tbajax.objectives.policy_gradient`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tbajax.batch import Batch
from tbajax.objectives.base import Metrics, Ratio
from tbajax.objectives.common import Groups, diagnostics, groups_of, seq_sums
from tbajax.objectives.configs import LearnedLogZConfig, LogZHeadConfig, TBConfig

Array = jax.Array


def tb_residual(batch: Batch, logprobs: Array) -> Array:
    """δ_i = S_i − R_i − r_i/β, [B]: the trajectory-balance residual without log Z."""
    beta = batch.beta.astype(logprobs.dtype)
    return seq_sums(batch, logprobs).log_ratio_ref - batch.reward.astype(logprobs.dtype) / beta


def _group_mean_square(g: Groups, residual: Array) -> Array:
    """Per-segment mean_i residual_i² over real rows."""
    return g.mean(residual * residual)


def _tb_metrics(batch, logprobs, g: Groups, per_group_sq, log_z_rows, loss: Ratio) -> Metrics:
    out = diagnostics(batch, logprobs)
    out.update(
        loss=loss,
        residual_std=Ratio(g.total(jnp.sqrt(jax.lax.stop_gradient(per_group_sq))), g.num),
        log_z=Ratio(g.total(g.mean(jax.lax.stop_gradient(log_z_rows))), g.num),
    )
    return out


def tb(batch: Batch, logprobs: Array, config: TBConfig = TBConfig()) -> tuple[Ratio, Metrics]:
    """VarGrad TB: L_group = mean_i (δ_i − δ̄)², log Ẑ = −δ̄ (stop-gradient); mean over groups.

    ∂L_group/∂S_i = (2/K)(δ_i − δ̄): REINFORCE with a mean baseline and a KL-regularised reward,
    scaled by 2/(Kβ). Metrics: residual_std (per-group RMS of δ − δ̄; the loss itself is huge when
    r/β is), log_z (mean log Ẑ), kl (mean S − R) and the shared diagnostics.
    """
    g = groups_of(batch, logprobs.dtype)
    delta = tb_residual(batch, logprobs)
    log_z = -jax.lax.stop_gradient(g.row(g.mean(delta)))
    per_group = _group_mean_square(g, delta + log_z)
    loss = Ratio(g.total(per_group), g.num)
    return loss, _tb_metrics(batch, logprobs, g, per_group, log_z, loss)


def tb_learned_logz(
    batch: Batch, logprobs: Array, config: LearnedLogZConfig, aux: dict[str, Array]
) -> tuple[Ratio, Metrics]:
    """TB with a learned log Z(x): L_group = mean_i (log Z_i + δ_i)², mean over groups.

    `aux["log_z"]` is [B]: each row's log Z, gathered by the trainer from the trainable table
    `init_log_z_table` made (see `ObjectiveSpec` and `gather_aux`); gradients flow into it.
    With log Z_i = −δ̄ held fixed this is exactly `tb`. Extra metric log_z_gap: mean over groups of
    learned log Z − the VarGrad estimate −δ̄ (how far the table lags).
    """
    g = groups_of(batch, logprobs.dtype)
    delta = tb_residual(batch, logprobs)
    log_z = aux["log_z"].astype(logprobs.dtype)
    per_group = _group_mean_square(g, delta + log_z)
    loss = Ratio(g.total(per_group), g.num)
    out = _tb_metrics(batch, logprobs, g, per_group, log_z, loss)
    gap = jax.lax.stop_gradient(g.mean(log_z + delta))
    out["log_z_gap"] = Ratio(g.total(gap), g.num)
    return loss, out


def init_log_z_table(config: LearnedLogZConfig, num_prompts: int) -> dict[str, Array]:
    """The trainable aux of `tb_learned_logz`: one log Z per prompt id."""
    return {"log_z": jnp.full((num_prompts,), config.init_log_z, jnp.float32)}


def log_z_from_head(head: dict[str, Array], features: Array) -> Array:
    """[B] log Z(x) = w · h(x) + b of the linear head on the pooled prompt states [B, D]."""
    w, b = head["w"][0], head["b"][0]
    dtype = jnp.result_type(features, w, jnp.float32)  # at least fp32, even for bf16 features
    return features.astype(dtype) @ w.astype(dtype) + b.astype(dtype)


def tb_logz_head(
    batch: Batch, logprobs: Array, config: LogZHeadConfig, aux: dict[str, Array]
) -> tuple[Ratio, Metrics]:
    """TB with log Z(x) from a linear head on the prompt's pooled hidden state (the red-teaming
    reference's log Z): L_group = mean_i (log Z(x) + δ_i)², mean over groups.

    `batch.prompt_features` is stop-gradient, so the head's loss trains only the head: the
    policy's gradient is exactly the one of `tb_learned_logz` with log Z held at the head's value.
    Unlike a per-prompt table the head generalises to prompts it has not seen (and needs no
    `aux_table_size`). Extra metric log_z_gap as for the table.
    """
    if batch.prompt_features is None:
        raise ValueError("tb_logz_head reads batch.prompt_features: declare "
                         "ObjectiveInputs(prompt_features=True) (its registered spec does)")
    if not config.reference:
        batch = dataclasses.replace(batch, reference_logprobs=jnp.zeros_like(batch.reference_logprobs))
    log_z = log_z_from_head(aux, jax.lax.stop_gradient(batch.prompt_features)).astype(logprobs.dtype)
    return tb_learned_logz(batch, logprobs, LearnedLogZConfig(config.aux_lr_scale), {"log_z": log_z})


def init_log_z_head(config: LogZHeadConfig, feature_dim: int) -> dict[str, Array]:
    """The trainable aux of `tb_logz_head`: one row holding w [D] and b."""
    return {"w": jnp.zeros((1, feature_dim), jnp.float32), "b": jnp.full((1,), config.init_log_z, jnp.float32)}
