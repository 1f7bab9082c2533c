"""The training batch every objective consumes, and the log-prob function that scores it.

Layout: each row is one sampled trajectory, `prompt tokens + response tokens + padding`, in a
[batch, seq] array. Per-token arrays are aligned with `tokens`: entry t belongs to token t
(predicted from tokens < t), so `loss_mask[:, t] = 1` exactly where token t is a response token
that the loss scores. Rows of one group (same prompt, K samples) share `group_id`; groups are
found by id, never by reshaping, so any row order works.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    tokens: Array  # [B, T] int32: prompt + response, right-padded
    attention_mask: Array  # [B, T] bool: real (prompt or response) tokens
    loss_mask: Array  # [B, T] bool: response tokens the loss scores
    behavior_logprobs: Array  # [B, T] f32: log-probs under the policy that sampled (0 off-mask)
    reference_logprobs: Array  # [B, T] f32: log-probs under the reference policy (0 off-mask)
    reward: Array  # [B] f32
    group_id: Array  # [B] int32 in [0, B): rows with equal id are one group
    sample_mask: Array  # [B] bool: False for padding rows (e.g. to fill a micro-batch)
    policy_version: Array  # [B] int32: param version the sample was generated with
    beta: Array  # [] f32: KL coefficient at the trainer's current step

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    def row_mask(self) -> Array:
        """loss_mask restricted to real rows, as float32."""
        return (self.loss_mask & self.sample_mask[:, None]).astype(jnp.float32)


def token_logprobs(logits: Array, tokens: Array, temperature: float = 1.0) -> Array:
    """log softmax(logits / T) of each next token, aligned with `tokens` ([B, T]; entry 0 is 0).

    logits[:, t] predicts tokens[:, t + 1]. The temperature is the sampling temperature: TBA
    scores trajectories under the same tempered distribution they were sampled from.
    """
    logits = logits[:, :-1].astype(jnp.float32) / temperature
    targets = tokens[:, 1:]
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.pad(picked - logz, ((0, 0), (1, 0)))
