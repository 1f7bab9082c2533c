"""The training batch every objective consumes, and the log-prob function that scores it.

Layout: each row is one sampled trajectory, `prompt tokens + response tokens + padding`, in a
[batch, seq] array. Per-token arrays are aligned with `tokens`: entry t belongs to token t
(predicted from tokens < t), so `loss_mask[:, t] = 1` exactly where token t is a response token
that the loss scores. Rows of one group (same prompt, K samples) share `group_id`; groups are
found by id, never by reshaping, so any row order works.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from tbajax.trajectory import Trajectory

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
    prompt_id: Array  # [B] int32: the prompt's id in its dataset (0 for padding rows); indexes
    #   per-prompt trainable tables such as a learned log Z
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


def collate(
    groups: Sequence[Sequence["Trajectory"]],
    beta: float,
    *,
    seq_len: int | None = None,
    num_rows: int | None = None,
    score_stop_token: bool = True,
    length_bucket: int = 32,
) -> Batch:
    """Pad groups of trajectories into one host-side (numpy) Batch.

    seq_len: pad/validate to this length (default: the longest row rounded up to
    `length_bucket`, so a long run compiles a handful of shapes, not one per batch).
    num_rows: pad with masked-out rows up to this many (fixed micro-batch shapes).
    score_stop_token: whether a finished response's final stop token is in the loss.
    """
    rows = [t for g in groups for t in g]
    if not rows:
        raise ValueError("collate needs at least one trajectory")
    lengths = [len(t.prompt_tokens) + len(t.response_tokens) for t in rows]
    longest = max(lengths)
    if seq_len is None:
        seq_len = -(-longest // length_bucket) * length_bucket
    if longest > seq_len:
        raise ValueError(f"a trajectory has {longest} tokens, more than seq_len={seq_len}")
    n = num_rows or len(rows)
    if n < len(rows):
        raise ValueError(f"num_rows={n} is smaller than the {len(rows)} trajectories given")
    tokens = np.zeros((n, seq_len), np.int32)
    attn = np.zeros((n, seq_len), bool)
    loss = np.zeros((n, seq_len), bool)
    blp = np.zeros((n, seq_len), np.float32)
    rlp = np.zeros((n, seq_len), np.float32)
    reward = np.zeros((n,), np.float32)
    gid = np.zeros((n,), np.int32)
    version = np.zeros((n,), np.int32)
    prompt_id = np.zeros((n,), np.int32)
    i = 0
    for g, group in enumerate(groups):
        for t in group:
            p, r = len(t.prompt_tokens), len(t.response_tokens)
            tokens[i, :p] = t.prompt_tokens
            tokens[i, p : p + r] = t.response_tokens
            attn[i, : p + r] = True
            scored = r - (1 if (t.finished and not score_stop_token and r > 0) else 0)
            loss[i, p : p + scored] = True
            blp[i, p : p + r] = t.behavior_logprobs
            if t.reference_logprobs is not None:
                rlp[i, p : p + r] = t.reference_logprobs
            reward[i] = t.reward
            gid[i] = g
            version[i] = t.policy_version
            prompt_id[i] = _int32_id(t.prompt_id)
            i += 1
    sample_mask = np.arange(n) < len(rows)
    gid[len(rows) :] = np.arange(len(groups), len(groups) + n - len(rows))  # padding: own groups
    blp *= loss
    rlp *= loss
    return Batch(
        tokens=tokens,
        attention_mask=attn,
        loss_mask=loss,
        behavior_logprobs=blp,
        reference_logprobs=rlp,
        reward=reward,
        group_id=gid,
        sample_mask=sample_mask,
        policy_version=version,
        prompt_id=prompt_id,
        beta=np.float32(beta),
    )


def _int32_id(prompt_id: int) -> int:
    if not np.iinfo(np.int32).min <= prompt_id <= np.iinfo(np.int32).max:
        raise ValueError(
            f"prompt_id {prompt_id} does not fit in int32; number the dataset's prompts 0, 1, 2, ..."
        )
    return int(prompt_id)
