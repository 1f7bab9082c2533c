"""Greedy held-out accuracy of a policy: the trainer's current one (eval.mode=inline, in the
trainer process, so searchers never stall) or a published version (eval.mode=process, in the
evaluator role: `tbajax.system.evaluator`). The sampler's compiled programs are kept across
evaluations.

A task whose `eval_fn` has `samples_per_problem = n > 0` (red-teaming: every eval problem is the
same prompt, so greedy decoding would be one attack) is evaluated on n *sampled* completions per
eval problem instead, at the training sampling settings and a fixed key (comparable across evals)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from tbajax.config import ExperimentConfig
from tbajax.models import CausalLM
from tbajax.system.assets import load_task, load_tokenizer_for
from tbajax.system.searcher import Rollouts
from tbajax.tasks.scoring import concat_samples, concat_scores

log = logging.getLogger(__name__)


class Evaluator:
    def __init__(self, config: ExperimentConfig, model: CausalLM, mesh: Any = None, reward_pool: Any = None,
                 rollouts: Rollouts | None = None):
        """rollouts: an existing `Rollouts` of this model to share (sync mode: one scorer, so a
        model-backed scorer's victim/classifier is loaded once per process)."""
        task = load_task(config) if rollouts is None else rollouts.task
        self.batch_size = config.eval.batch_size
        self.rollouts = rollouts or Rollouts(config, model, load_tokenizer_for(config), task, mesh=mesh,
                                             reward_pool=reward_pool)
        problems = list(task.load("eval"))[: config.eval.num_problems]
        self.problems = [p for p in problems if self.rollouts.fits(p, "eval")]
        if len(self.problems) < len(problems):
            log.warning("eval: %d of %d problems have prompts over rollout.max_prompt_tokens and are skipped",
                        len(problems) - len(self.problems), len(problems))
        if not self.problems:
            raise ValueError(f"task {task.name!r} has no eval problems that fit rollout.max_prompt_tokens")
        samples_per_problem = int(getattr(task.eval_fn, "samples_per_problem", 0) or 0)
        self.sampled = samples_per_problem > 0
        self.sampling = dataclasses.replace(
            config.rollout.sampling,
            num_samples=samples_per_problem if self.sampled else 1,
            greedy=not self.sampled,
            max_new_tokens=config.eval.max_new_tokens or config.rollout.sampling.max_new_tokens,
            min_new_tokens=config.rollout.sampling.min_new_tokens if self.sampled else 0,
        )
        self.task = task

    @property
    def metric(self) -> str:
        """The task's headline eval metric (what `eval_score` holds)."""
        return self.task.headline_metric

    def run(self, model: CausalLM, on_batch: Callable[[int], None] | None = None) -> dict[str, float]:
        """{"eval_score": the headline metric, "eval_<name>": every metric of the task}.

        Tasks with an `eval_fn` see every eval sample with its scores and extras (attack success,
        diversity, win rate); others get accuracy / mean reward / pass@k of their rewards.
        on_batch(problems done so far) is called after each batch (a progress display)."""
        return self.run_params(nnx.state(model, nnx.Param), on_batch)

    def run_params(self, params: nnx.State, on_batch: Callable[[int], None] | None = None
                   ) -> dict[str, float]:
        """`run` on params of this model's shape (the evaluator role's loaded versions)."""
        self.rollouts.set_params(params)
        key = jax.random.PRNGKey(0)  # fixed: sampled evals draw the same noise every time
        samples, scores = [], []
        for start in range(0, len(self.problems), self.batch_size):
            chunk = self.problems[start : start + self.batch_size]
            chunk_key = jax.random.fold_in(key, start) if self.sampled else key
            _, batch, scored = self.rollouts.sample_and_score(chunk, self.sampling, chunk_key, split="eval")
            samples.append(batch)
            scores.append(scored)
            if on_batch is not None:
                on_batch(start + len(chunk))
        if self.task.eval_fn is not None:
            metrics = self.task.eval_fn(concat_samples(samples), concat_scores(scores))
        else:
            metrics = self.task.evaluate([[float(r)] for s in scores for r in s.reward])
        if self.metric not in metrics:
            raise ValueError(f"task {self.task.name!r}: its eval metrics {sorted(metrics)} lack its "
                             f"headline_metric {self.metric!r}")
        out = {f"eval_{k}": float(v) for k, v in metrics.items()}
        out["eval_score"] = float(metrics[self.metric])
        return out
