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

    def run(self, model: CausalLM) -> dict[str, float]:
        self.rollouts.set_params(nnx.state(model, nnx.Param))
        rewards: list[list[float]] = []
        key = jax.random.PRNGKey(0)  # greedy: the key is unused but required
        for start in range(0, len(self.problems), self.batch_size):
            chunk = self.problems[start : start + self.batch_size]
            _, _, scored = self.rollouts.sample_and_score(chunk, self.sampling, key, split="eval")
            rewards.extend([[r] for r, _ in scored])
        metrics = self.task.evaluate(rewards)
        return {"eval_accuracy": metrics["accuracy"], "eval_mean_reward": metrics["mean_reward"]}
