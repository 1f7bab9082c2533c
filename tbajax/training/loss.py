"""The loss of one micro-batch as the step differentiates it: score the batch under the policy
(and, when the objective reads them, under the reference), hand both to the objective.

Only what the objective declares (`ObjectiveSpec.inputs`) is computed and checked: an objective
that never reads reference log-probs (`dr_grpo`, `grpo` without its KL term) costs one forward,
not two.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

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
from tbajax.models.config import ModelConfig
from tbajax.models.decoder import CausalLM, packed_mask
from tbajax.models.layers import StridedGroups
from tbajax.models.moe import CountRouting, load_balancing_loss
from tbajax.objectives.base import Metrics, Ratio
from tbajax.objectives.registry import EVERYTHING, ObjectiveInputs, ObjectiveSpec, aux_for_loss
from tbajax.training.config import TrainerConfig
from tbajax.training.state import LoraBase

Array = jax.Array
PyTree = Any


def sequence_logprobs(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, temperature: float) -> Array:
    """Per-token log-probs [B, T] of `batch.tokens` under (graphdef, params) at `temperature`;
    through `batch.packed` when present, else over `batch.scored` when present (then on
    loss-masked tokens only: 0 elsewhere)."""
    return _score(nnx.merge(graphdef, params), batch, temperature).logprobs


class Scored(NamedTuple):
    """What one forward of the policy gives the loss: per-token log-probs [B, T], the prompt
    features when asked for ([B, D]), the router's load-balancing loss when asked for (scalar)."""

    logprobs: Array
    prompt_features: Array | None = None
    router_balance: Array | None = None


def _score(model: CausalLM, batch: Batch, temperature: float, *, prompt_features: bool = False,
           router_balance: bool = False) -> Scored:
    """`sequence_logprobs`, and from the same forward the prompt features / the router's
    load-balancing loss (`moe.load_balancing_loss` over the real tokens the forward runs)."""
    if batch.packed is not None:
        if prompt_features:
            raise ValueError("an objective that reads prompt_features (a log Z head) needs the row layout: "
                             "set train.trainer.pack_groups=false")
        pk = batch.packed
        if pk.prompt_real is None:
            mask, real = packed_mask(pk.segments), pk.segments >= 0
        else:
            mask = StridedGroups(pk.prompt_real, pk.response_real)
            responses = pk.response_real.reshape(pk.response_real.shape[0], -1)
            real = jnp.concatenate([pk.prompt_real, responses], 1)
        routing = CountRouting(real) if router_balance else None
        hidden, counts = model.hidden_states(pk.tokens, pk.positions, mask, routing)
        logprobs = packed_hidden_logprobs(hidden, model.head_weight(), batch, temperature,
                                          model.config.head_chunk_tokens, model.logit_softcap)
        return Scored(logprobs, None, load_balancing_loss(counts, real.sum()) if router_balance else None)
    routing = CountRouting(batch.attention_mask) if router_balance else None
    hidden, counts = model.hidden_states(batch.tokens, attention_mask=batch.attention_mask, cache=routing)
    logprobs = _row_logprobs(hidden, model, batch, temperature)
    balance = load_balancing_loss(counts, batch.attention_mask.sum()) if router_balance else None
    if not prompt_features:
        return Scored(logprobs, None, balance)
    prompt = batch.attention_mask.astype(bool) & (jnp.cumsum(batch.loss_mask.astype(jnp.int32), axis=-1) == 0)
    weights = prompt.astype(jnp.float32)
    pooled = jnp.einsum("bt,btd->bd", weights, hidden.astype(jnp.float32))
    return Scored(logprobs, pooled / jnp.maximum(weights.sum(-1, keepdims=True), 1.0), balance)


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
    scored = _score(nnx.merge(graphdef, params), batch, temperature, prompt_features=True)
    return scored.logprobs, scored.prompt_features


def router_aux_loss_coef(model_config: ModelConfig, config: TrainerConfig) -> float:
    """The weight of the router's load-balancing loss in this training (0: not added): the
    trainer's `router_aux_loss_coef`, or where that is None the checkpoint's, as transformers adds it."""
    coef = config.router_aux_loss_coef
    if coef is None:
        return model_config.router_aux_loss_coef if model_config.output_router_logits else 0.0
    if coef > 0 and model_config.num_experts is None:
        raise ValueError(f"train.trainer.router_aux_loss_coef={coef} for a {model_config.model_type} "
                         "policy, which has no router (a mixture-of-experts model has): set it to null or 0")
    return coef


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
    model = nnx.merge(graphdef, policy)
    balance_coef = router_aux_loss_coef(model.config, config)
    scored = _score(model, batch, config.temperature, prompt_features=inputs.prompt_features,
                    router_balance=balance_coef > 0)
    logprobs = scored.logprobs
    if inputs.prompt_features:
        batch = dataclasses.replace(batch, prompt_features=jax.lax.stop_gradient(scored.prompt_features))
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
    total, count = loss.total, jax.lax.stop_gradient(loss.count)
    if scored.router_balance is not None:  # weighted by the micro-batch's share of the loss count
        total = total + balance_coef * scored.router_balance * count
        balance = jax.lax.stop_gradient(scored.router_balance)
        metrics = {**metrics, "router_aux_loss": Ratio(balance * count, count)}
    return total, (count, metrics, row_ok)
