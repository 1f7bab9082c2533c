"""Eager checks of a host batch before it reaches a jitted objective (where errors turn into NaN)."""

from __future__ import annotations

from typing import Any

import numpy as np

from tbajax.batch import Batch
from tbajax.objectives.registry import EVERYTHING, ObjectiveInputs, ObjectiveSpec, get_objective

_PER_TOKEN = ("attention_mask", "loss_mask", "behavior_logprobs", "reference_logprobs", "token_versions")
_PER_ROW = ("reward", "group_id", "sample_mask", "policy_version", "prompt_id")


def _inputs(spec: ObjectiveSpec | None, config: Any) -> ObjectiveInputs:
    """What to check: the objective's declared inputs; everything when they depend on a config
    that was not given (a check too many is harmless, one too few is not)."""
    if spec is None:
        return EVERYTHING
    if isinstance(spec.inputs, ObjectiveInputs):
        return spec.inputs
    return EVERYTHING if config is None else spec.inputs_for(config)


def validate_batch(
    batch: Batch,
    objective: str | ObjectiveSpec | Any | None = None,
    logprobs: Any | None = None,
    *,
    objective_config: Any = None,
    reference_from_trainer: bool = False,
    min_group_size: int = 2,
) -> None:
    """Raise ValueError naming the field if the batch cannot give a meaningful loss.

    Checks shapes (token_versions per token and current_version a scalar, both integers),
    finiteness of rewards / β / log-probs (including `logprobs` if given), group ids in [0, B),
    at least `min_group_size` real rows per group (group baselines need >= 2), and β >= 0 (> 0
    for objectives whose spec has `positive_beta`, such as TB). Behaviour and reference log-probs
    are checked for finiteness only when the objective reads them (`ObjectiveSpec.inputs`, under
    `objective_config` when they depend on it), and reference log-probs not at all when
    `reference_from_trainer` (the trainer scores them itself).
    """
    spec = None if objective is None else get_objective(objective)
    inputs = _inputs(spec, objective_config)
    finite = ["reward", "beta"]
    if inputs.behavior_logprobs:
        finite.append("behavior_logprobs")
    if inputs.reference_logprobs and not reference_from_trainer:
        finite.append("reference_logprobs")
    scalars = ("beta", "current_version")
    arr = {f: np.asarray(getattr(batch, f)) for f in ("tokens", *_PER_TOKEN, *_PER_ROW, *scalars)}
    if logprobs is not None:
        arr["logprobs"] = np.asarray(logprobs)
    if arr["tokens"].ndim != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {arr['tokens'].shape}")
    bt = arr["tokens"].shape
    for f in (*_PER_TOKEN, *(("logprobs",) if logprobs is not None else ())):
        if arr[f].shape != bt:
            raise ValueError(f"{f} has shape {arr[f].shape}, but tokens are {bt}: align them")
    for f in _PER_ROW:
        if arr[f].shape != bt[:1]:
            raise ValueError(f"{f} has shape {arr[f].shape}, expected ({bt[0]},): one per row")
    if arr["beta"].shape != ():
        raise ValueError(f"beta must be a scalar, got shape {arr['beta'].shape}")
    if arr["current_version"].shape != ():
        raise ValueError(f"current_version must be a scalar, got shape {arr['current_version'].shape}")
    for f in ("token_versions", "current_version"):
        if arr[f].dtype.kind not in "iu":
            raise ValueError(f"{f} must hold integer param versions, got dtype {arr[f].dtype}")

    for f in (*finite, *(("logprobs",) if logprobs is not None else ())):
        bad = ~np.isfinite(arr[f])
        if bad.any():
            rows = sorted({int(i) for i in np.argwhere(bad)[:, 0]}) if bad.ndim else []
            raise ValueError(
                f"{f} has {int(bad.sum())} non-finite value(s) (NaN/inf)"
                + (f" in rows {rows[:10]}" if rows else "")
                + "; fix or drop those samples before training"
            )

    if batch.scored is not None:
        _check_scored_window(np.asarray(batch.scored), arr["loss_mask"].astype(bool))

    real = arr["sample_mask"].astype(bool)
    if not real.any():
        raise ValueError("sample_mask is all False: the batch has no real rows")
    gid = arr["group_id"]
    if gid.min() < 0 or gid.max() >= bt[0]:
        raise ValueError(f"group_id must lie in [0, {bt[0]}), got range [{gid.min()}, {gid.max()}]")
    ids, sizes = np.unique(gid[real], return_counts=True)
    small = {int(i): int(n) for i, n in zip(ids, sizes) if n < min_group_size}
    if small:
        raise ValueError(
            f"groups with fewer than {min_group_size} real samples (group id: size) {small}; "
            "group baselines need several samples per prompt: sample more or drop those groups"
        )

    beta = float(arr["beta"])
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if spec is not None:
        if spec.positive_beta and beta <= 0:
            raise ValueError(
                f"objective {spec.name!r} needs beta > 0 (TB divides the reward by beta; DPO "
                f"scales its margin by it), got {beta}"
            )


def _check_scored_window(scored: np.ndarray, loss_mask: np.ndarray) -> None:
    """`Batch.scored` must be consecutive slots in [1, seq) (the last may repeat at the row's end)
    covering every loss-masked token: a token outside it would silently get log-prob 0."""
    n, seq = loss_mask.shape
    if scored.ndim != 2 or scored.shape[0] != n or scored.dtype.kind not in "iu":
        raise ValueError(f"scored must be [batch, width] integer slots, got {scored.dtype} {scored.shape}")
    first = scored[:, :1]
    want = np.minimum(first + np.arange(scored.shape[1]), seq - 1)
    if (first < 1).any() or (scored != want).any():
        raise ValueError("scored must hold each row's consecutive slots from slot >= 1 on "
                         "(build it with tbajax.training.collate.scored_windows)")
    t = np.arange(seq)[None, :]
    outside = loss_mask & ((t < first) | (t >= first + scored.shape[1]))
    if outside.any():
        rows = sorted({int(i) for i in np.argwhere(outside)[:, 0]})
        raise ValueError(f"loss-masked tokens lie outside the scored window in rows {rows[:10]}; "
                         "rebuild it with tbajax.training.collate.scored_windows(loss_mask)")
