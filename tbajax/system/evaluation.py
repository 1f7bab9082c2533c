"""Greedy held-out accuracy of the trainer's current policy (run inside the trainer process, so
searchers never stall; the sampler's compiled programs are kept across evaluations)."""

from __future__ import annotations

import dataclasses
import logging
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
    def __init__(self, config: ExperimentConfig, model: CausalLM, mesh: Any = None, reward_pool: Any = None):
        task = load_task(config)
        self.batch_size = config.eval.batch_size
        self.rollouts = Rollouts(config, model, load_tokenizer_for(config), task, mesh=mesh, reward_pool=reward_pool)
        problems = list(task.load("eval"))[: config.eval.num_problems]
        self.problems = [p for p in problems if self.rollouts.fits(p, "eval")]
        if len(self.problems) < len(problems):
            log.warning("eval: %d of %d problems have prompts over rollout.max_prompt_tokens and are skipped",
                        len(problems) - len(self.problems), len(problems))
        if not self.problems:
            raise ValueError(f"task {task.name!r} has no eval problems that fit rollout.max_prompt_tokens")
        self.sampling = dataclasses.replace(
            config.rollout.sampling,
            num_samples=1,
            greedy=True,
            max_new_tokens=config.eval.max_new_tokens or config.rollout.sampling.max_new_tokens,
            min_new_tokens=0,
        )
        self.task = task

    @property
    def metric(self) -> str:
        """The task's headline eval metric (what `eval_score` holds)."""
        return self.task.headline_metric

    def run(self, model: CausalLM) -> dict[str, float]:
        """{"eval_score": the headline metric, "eval_<name>": every metric of the task}.

        Tasks with an `eval_fn` see every eval sample with its scores and extras (attack success,
        diversity, win rate); others get accuracy / mean reward / pass@k of their rewards."""
        self.rollouts.set_params(nnx.state(model, nnx.Param))
        key = jax.random.PRNGKey(0)  # greedy: the key is unused but required
        samples, scores = [], []
        for start in range(0, len(self.problems), self.batch_size):
            chunk = self.problems[start : start + self.batch_size]
            _, batch, scored = self.rollouts.sample_and_score(chunk, self.sampling, key, split="eval")
            samples.append(batch)
            scores.append(scored)
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
