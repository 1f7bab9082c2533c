"""The loss of one micro-batch as the step differentiates it: score the batch under the policy
(and, when the objective reads them, under the reference), hand both to the objective.

Only what the objective declares (`ObjectiveSpec.inputs`) is computed and checked: an objective
that never reads reference log-probs (`dr_grpo`, `grpo` without its KL term) costs one forward,
not two.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tbajax import op_scopes as S
from tbajax.batch import (
    Batch,
    hidden_token_logprobs,
    packed_hidden_logprobs,
    windowed_hidden_logprobs,
)
from tbajax.models.decoder import CausalLM, packed_mask
from tbajax.models.layers import StridedGroups
from tbajax.objectives.base import Metrics
from tbajax.objectives.registry import EVERYTHING, ObjectiveInputs, ObjectiveSpec, aux_for_loss
from tbajax.training.config import TrainerConfig
from tbajax.training.state import LoraBase

Array = jax.Array
PyTree = Any


def sequence_logprobs(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, temperature: float) -> Array:
    """Per-token log-probs [B, T] of `batch.tokens` under (graphdef, params) at `temperature`;
    through `batch.packed` when present, else over `batch.scored` when present (then on
    loss-masked tokens only: 0 elsewhere)."""
    model = nnx.merge(graphdef, params)
    if batch.packed is not None:
        pk = batch.packed
        mask = (packed_mask(pk.segments) if pk.prompt_real is None
                else StridedGroups(pk.prompt_real, pk.response_real))
        hidden, _ = model.hidden_states(pk.tokens, pk.positions, mask)
        return packed_hidden_logprobs(hidden, model.head_weight(), batch, temperature,
                                      model.config.head_chunk_tokens, model.logit_softcap)
    hidden, _ = model.hidden_states(batch.tokens, attention_mask=batch.attention_mask)
    return _row_logprobs(hidden, model, batch, temperature)


def _row_logprobs(hidden: Array, model: CausalLM, batch: Batch, temperature: float) -> Array:
    head, chunk, softcap = model.head_weight(), model.config.head_chunk_tokens, model.logit_softcap
    if batch.scored is not None:
        return windowed_hidden_logprobs(hidden, head, batch, temperature, chunk, softcap)
    return hidden_token_logprobs(hidden, head, batch.tokens, temperature, chunk, softcap)


def logprobs_and_prompt_features(
    graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, temperature: float
) -> tuple[Array, Array]:
    """`sequence_logprobs` plus the final hidden state mean-pooled over each row's prompt tokens
    ([B, D] f32, the real tokens before the first loss-masked one), from the same forward."""
    if batch.packed is not None:
        raise ValueError("an objective that reads prompt_features (a log Z head) needs the row layout: "
                         "set train.trainer.pack_groups=false")
    model = nnx.merge(graphdef, params)
    hidden, _ = model.hidden_states(batch.tokens, attention_mask=batch.attention_mask)
    logprobs = _row_logprobs(hidden, model, batch, temperature)
    prompt = batch.attention_mask.astype(bool) & (jnp.cumsum(batch.loss_mask.astype(jnp.int32), axis=-1) == 0)
    weights = prompt.astype(jnp.float32)
    pooled = jnp.einsum("bt,btd->bd", weights, hidden.astype(jnp.float32))
    return logprobs, pooled / jnp.maximum(weights.sum(-1, keepdims=True), 1.0)


def objective_inputs(objective: Any, objective_config: Any) -> ObjectiveInputs:
    """The inputs `objective` reads: its spec's declaration, everything for a bare function."""
    if isinstance(objective, ObjectiveSpec):
        return objective.inputs_for(objective_config)
    return EVERYTHING


def scores_reference(objective: Any, objective_config: Any, config: TrainerConfig) -> bool:
    """Whether the step runs the reference forward: the trainer owns the reference
    (`compute_reference_logprobs`) and the objective reads its log-probs."""
    return config.compute_reference_logprobs and objective_inputs(objective, objective_config).reference_logprobs


def rows_finite(batch: Batch, logprobs: Array, inputs: ObjectiveInputs = EVERYTHING) -> Array:
    """[B] False for a real row whose reward, log-probs or stored log-probs the objective reads
    are NaN/inf."""

    def ok(x: Array, mask: Array) -> Array:
        return jnp.isfinite(jnp.where(mask, x, 0.0)).all(-1)

    good = jnp.isfinite(batch.reward) & ok(logprobs, batch.attention_mask)
    if inputs.reference_logprobs:
        good = good & ok(batch.reference_logprobs, batch.loss_mask)
    if inputs.behavior_logprobs:
        good = good & ok(batch.behavior_logprobs, batch.loss_mask)
    return good | ~batch.sample_mask


def microbatch_loss(
    trainable: tuple[nnx.State, PyTree | None],
    ref_params: nnx.State | None,
    batch: Batch,
    *,
    graphdef: nnx.GraphDef,
    objective: Any,
    objective_config: Any,
    config: TrainerConfig,
) -> tuple[Array, tuple[Array, Metrics, Array]]:
    """(loss sum, (loss count, metrics, row_finite)): the sum is what gets differentiated,
    with respect to `trainable` = (params, aux table or None).

    `ref_params` is a `LoraBase` under LoRA: then `params` are the adapters, the policy is the
    base with them merged in, and the reference the base itself (no second copy of the weights).
    """
    params, aux = trainable
    inputs = objective_inputs(objective, objective_config)
    if isinstance(ref_params, LoraBase):
        frozen = jax.lax.stop_gradient(ref_params)
        policy, reference = frozen.policy(params), frozen.reference
    else:
        policy, reference = params, lambda: ref_params
    if inputs.prompt_features:
        logprobs, features = logprobs_and_prompt_features(graphdef, policy, batch, config.temperature)
        batch = dataclasses.replace(batch, prompt_features=jax.lax.stop_gradient(features))
    else:
        logprobs = sequence_logprobs(graphdef, policy, batch, config.temperature)
    if scores_reference(objective, objective_config, config):
        ref = sequence_logprobs(graphdef, jax.lax.stop_gradient(reference()), batch, config.temperature)
        batch = dataclasses.replace(
            batch, reference_logprobs=jnp.where(batch.loss_mask, jax.lax.stop_gradient(ref), 0.0)
        )
    with jax.named_scope(S.OBJECTIVE):
        if aux is None:
            loss, metrics = objective(batch, logprobs, objective_config)
        else:
            loss, metrics = objective(batch, logprobs, objective_config, aux_for_loss(objective, aux, batch.prompt_id))
    row_ok = rows_finite(batch, jax.lax.stop_gradient(logprobs), inputs)
    return loss.total, (jax.lax.stop_gradient(loss.count), metrics, row_ok)
