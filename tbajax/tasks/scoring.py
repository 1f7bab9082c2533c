"""The batched scorer contract: how a task turns one generation call's samples into rewards.

Most tasks grade each completion on its own with a plain Python function (`Task.reward_fn`): a
regex, a safe evaluator, math-verify. Other tasks need *models* to score: a reward model
(preference tuning), or a frozen victim LM that answers each attack plus a toxicity classifier
(red-teaming). Those models must be loaded once per process, live on that process's mesh, run
batched and jitted, and may sample. A `Scorer` is that: built once from a `ScorerContext`, it
scores a whole `Samples` batch and returns `Scores`, including per-sample `extras` (a victim's
answers, a classifier's probabilities) that travel with the trajectories for evaluation and
logging. The per-sample reward function is just the default scorer (`RewardFnScorer`), so the
searcher, the evaluator and the synchronous mode have one code path for every task.

A multi-turn task would fit the same contract: its scorer may hold an environment model and
sample from it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from tbajax.trajectory import RewardStatus

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Samples:
    """One generation call's samples, one entry per sample (K per prompt, prompt-major).

    problems: the `tbajax.tasks.Problem` each sample answers. texts: the decoded responses with
    their stop token removed. finished: the response ended with a stop token (False: it hit
    max_new_tokens). split: "train" (rollouts) or "eval" (held-out evaluation).
    """

    problems: Sequence[Any]
    prompt_tokens: Sequence[np.ndarray]
    response_tokens: Sequence[np.ndarray]
    texts: Sequence[str]
    finished: np.ndarray
    split: str = "train"

    def __post_init__(self) -> None:
        n = len(self.texts)
        for name in ("problems", "prompt_tokens", "response_tokens", "finished"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Samples.{name} has {len(getattr(self, name))} entries for {n} texts")

    def __len__(self) -> int:
        return len(self.texts)


@dataclasses.dataclass(frozen=True)
class Scores:
    """A scorer's answer: reward [N], status [N] (RewardStatus values) and per-sample extras.

    extras: name -> N JSON-serialisable values (numbers, strings, lists of them), e.g.
    {"victim_answers": [[...], ...], "toxicity": [...]}; they are stored with the trajectories.
    A failed sample has a failure status (TIMEOUT/ERROR) and reward 0, never NaN; `errors` holds
    the reason per sample (None where the grade succeeded), for logs and fail-fast messages.
    """

    reward: np.ndarray
    status: np.ndarray
    extras: Mapping[str, Sequence[Any]] = dataclasses.field(default_factory=dict)
    errors: Sequence[str | None] | None = None

    def __post_init__(self) -> None:
        n = len(self.reward)
        if len(self.status) != n:
            raise ValueError(f"Scores.status has {len(self.status)} entries for {n} rewards")
        if self.errors is not None and len(self.errors) != n:
            raise ValueError(f"Scores.errors has {len(self.errors)} entries for {n} rewards")
        for name, values in self.extras.items():
            if len(values) != n:
                raise ValueError(f"Scores.extras[{name!r}] has {len(values)} entries for {n} rewards")
        bad = [i for i, r in enumerate(self.reward) if not math.isfinite(float(r))]
        if bad:
            raise ValueError(
                f"Scores.reward is non-finite for samples {bad[:10]}: a scorer reports failures "
                "through status (TIMEOUT/ERROR, reward 0), never NaN/inf rewards"
            )

    def __len__(self) -> int:
        return len(self.reward)

    def extras_of(self, i: int) -> dict[str, Any]:
        """Sample i's extras as one JSON-serialisable dict (checked here, not at store time)."""
        out = {name: _plain(values[i]) for name, values in self.extras.items()}
        json.dumps(out)  # fail now, with the scorer on the stack, rather than inside the store
        return out

    def failed(self) -> np.ndarray:
        """[N] bool: the grade failed (TIMEOUT or ERROR), so the reward means nothing."""
        return np.asarray(self.status) >= int(RewardStatus.TIMEOUT)

    @classmethod
    def from_results(cls, results: Sequence[Any], **extras: Sequence[Any]) -> Scores:
        """From `tbajax.tasks.reward_pool.RewardResult`s (reward, status, error)."""
        return cls(
            reward=np.asarray([float(r.reward) for r in results], np.float64),
            status=np.asarray([int(r.status) for r in results], np.int64),
            extras=extras,
            errors=[r.error for r in results],
        )


class Scorer(Protocol):
    """Scores batches of samples. May hold models (loaded once) and sample from them with `key`.

    Optional hooks, looked up with getattr:
    - `set_policy_version(version)`, called before each training call with the param version
      that sampled it, for scorers whose reward follows a schedule (red-teaming's γ, τ);
    - `set_policy(model)`, called whenever the sampling policy's weights change with that policy
      (a `CausalLM`), for eval metrics that compare its distribution with another model's
      (preference tuning's full-vocabulary KL to the SFT model). Keep a reference, not a copy."""

    def score(self, samples: Samples, key: Any) -> Scores: ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class ScorerContext:
    """What a scorer factory gets to build itself, once per process.

    config: the resolved ExperimentConfig. tokenizer: the policy's tokenizer (to decode / re-encode).
    mesh: this process's device mesh (load scorer models onto it). reward_pool: the killable worker
    pool, or None for in-process grading. policy_checkpoint: the policy's initial checkpoint (e.g.
    the SFT model a red-team prior scores attacks under).
    """

    config: Any
    tokenizer: Any
    mesh: Any = None
    reward_pool: Any = None
    policy_checkpoint: str | None = None


ScorerFactory = Callable[[Any, ScorerContext], Scorer]  # (task, context) -> scorer


class RewardFnScorer:
    """The default scorer: the task's per-sample `reward_fn`, in a killable worker pool when one is
    given (slow or untrusted graders), else in-process with exactly the pool's statuses."""

    def __init__(self, task: Any, reward_pool: Any = None):
        self.task = task
        self.reward_pool = reward_pool

    def score(self, samples: Samples, key: Any = None) -> Scores:
        answers = [p.answer for p in samples.problems]
        if self.reward_pool is not None:
            return Scores.from_results(self.reward_pool.score_detailed(self.task, list(zip(samples.texts, answers))))
        return Scores.from_results(grade_in_process(self.task, samples.texts, answers))

    def close(self) -> None:
        """The pool belongs to whoever made it (it may be shared with the evaluator)."""


def grade_in_process(task: Any, completions: Sequence[str], answers: Sequence[Any]) -> list[Any]:
    """`RewardResult`s of the task's reward function run here, with exactly the worker pool's
    statuses (`call_reward`): a raise, a NaN/inf reward or a malformed return costs that sample an
    ERROR status (reward 0), never the caller."""
    from tbajax.tasks.reward_pool import call_reward

    results = [call_reward(task.reward, text, answer) for text, answer in zip(completions, answers)]
    for i, r in enumerate(results):
        if r.status == RewardStatus.ERROR:
            log.warning("task %s: reward of sample %d failed: %s", task.name, i, r.error)
    return results


def build_scorer(task: Any, context: ScorerContext) -> Scorer:
    """The task's own scorer when it has one (`Task.scorer`), else `RewardFnScorer`."""
    factory = getattr(task, "scorer", None)
    if factory is None:
        return RewardFnScorer(task, context.reward_pool)
    scorer = factory(task, context)
    if not callable(getattr(scorer, "score", None)):
        raise TypeError(f"task {task.name!r}: its scorer factory returned {type(scorer).__name__}, which has no score()")
    return scorer


def _plain(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def concat_samples(parts: Sequence[Samples]) -> Samples:
    """Several calls' samples as one batch (e.g. every eval chunk)."""
    if not parts:
        raise ValueError("concat_samples needs at least one Samples")
    return Samples(
        problems=[p for s in parts for p in s.problems],
        prompt_tokens=[t for s in parts for t in s.prompt_tokens],
        response_tokens=[t for s in parts for t in s.response_tokens],
        texts=[t for s in parts for t in s.texts],
        finished=np.concatenate([np.asarray(s.finished, bool) for s in parts]),
        split=parts[0].split,
    )


def concat_scores(parts: Sequence[Scores]) -> Scores:
    """Several calls' scores as one (extras keep only the names every part has)."""
    if not parts:
        raise ValueError("concat_scores needs at least one Scores")
    names = set(parts[0].extras).intersection(*(s.extras for s in parts[1:]))
    errors = None
    if any(s.errors is not None for s in parts):
        errors = [e for s in parts for e in (s.errors if s.errors is not None else [None] * len(s))]
    return Scores(
        reward=np.concatenate([np.asarray(s.reward, np.float64) for s in parts]),
        status=np.concatenate([np.asarray(s.status, np.int64) for s in parts]),
        extras={n: [v for s in parts for v in s.extras[n]] for n in sorted(names)},
        errors=errors,
    )
