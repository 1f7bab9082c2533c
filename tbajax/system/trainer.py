"""The trainer: tail the searchers' stores into the replay buffer, train, publish every k steps.

`Learner` is the in-memory core (groups of trajectories -> one update), shared verbatim by the
asynchronous trainer process and the synchronous mode, so both train the same objective with
the same code. `run_trainer` is the process: waiting for data, syncs, evaluation, checkpoints,
resume, the final summary.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from tbajax.buffer import BufferConfig, BufferEmptyError, Tailer, TrajectoryBuffer
from tbajax.buffer import make_buffer as buffer_for
from tbajax.config import ExperimentConfig
from tbajax.models import CausalLM, load_model
from tbajax.objectives import resolve_objective
from tbajax.objectives.validate import validate_batch
from tbajax.sharding import make_mesh
from tbajax.stores import (
    ParamPublisher,
    TrajectoryReader,
    discover_searcher_stores,
    param_store_url,
)
from tbajax.system import rundir
from tbajax.system.evaluation import Evaluator
from tbajax.system.metrics import MetricsWriter, plot_learning_curve, read_metrics
from tbajax.system.searcher import make_reward_pool
from tbajax.training import Checkpointer, PolicyUpdater
from tbajax.training.collate import collate
from tbajax.trajectory import Trajectory

log = logging.getLogger(__name__)


class Learner:
    """Groups of trajectories in, one optimizer update out."""

    def __init__(self, config: ExperimentConfig, model: CausalLM, mesh: Any = None):
        self.config = config
        self.objective, self.objective_config = resolve_objective(
            config.train.objective, overrides=dict(config.train.objective_options)
        )
        self.trainer = PolicyUpdater(model, config.train.trainer, self.objective, self.objective_config, mesh=mesh)
        self.rows = config.train.groups_per_step * config.buffer.samples_per_group
        self.tokens_trained = 0

    @property
    def step(self) -> int:
        return self.trainer.updates_applied

    def train_on(self, groups: Sequence[Sequence[Trajectory]], current_version: int) -> dict[str, float]:
        t0 = time.time()
        trainer = self.config.train.trainer
        batch = collate(
            groups,
            beta=_beta_placeholder(self.config),
            num_rows=self.rows,
            score_stop_token=self.config.train.score_stop_token,
            length_bucket=self.config.train.length_bucket,
            pack_microbatches=trainer.num_microbatches if trainer.pack_groups else None,
            pack_row_multiple=self.trainer.batch_shards,
        )
        validate_batch(batch, self.objective, objective_config=self.objective_config,
                       reference_from_trainer=trainer.compute_reference_logprobs)
        metrics = self.trainer.step(batch)
        rows = [t for g in groups for t in g]
        per_searcher = np.bincount([t.searcher_id for t in rows], minlength=1)
        rewards = np.array([t.reward for t in rows], np.float64)
        lags = np.array([current_version - t.policy_version for t in rows])
        tokens = int(np.asarray(batch.loss_mask).sum())
        self.tokens_trained += tokens
        metrics.update(
            reward_mean=float(rewards.mean()),
            reward_std_within_group=float(np.mean([np.std([t.reward for t in g]) for g in groups])),
            response_length=float(np.mean([len(t.response_tokens) for t in rows])),
            policy_lag_mean=float(lags.mean()),
            policy_lag_max=float(lags.max()),
            train_tokens=tokens,
            **{f"rows_from_searcher_{i}": int(n) for i, n in enumerate(per_searcher)},
            step_time_s=time.time() - t0,
        )
        return metrics


def _beta_placeholder(config: ExperimentConfig) -> float:
    """β written into the host batch; the trainer's β schedule replaces it inside the step."""
    beta = config.train.trainer.beta
    return beta.start if beta is not None else 0.0


def make_buffer(config: ExperimentConfig) -> TrajectoryBuffer:
    if config.system.mode == "sync":  # consume exactly the groups just generated, once
        return buffer_for(
            BufferConfig(mode="fifo_once", async_level=0, samples_per_group=config.buffer.samples_per_group)
        )
    return buffer_for(config.buffer)


def run_trainer(run_dir: Path, *, resume: bool = False, store_url: str | None = None) -> dict[str, Any]:
    """The trainer process. Returns the run summary (also written to summary.json)."""
    config = rundir.load_config(run_dir)
    store = store_url or str(run_dir)
    stop = rundir.StopFlag(run_dir)
    mesh = make_mesh(config.system.trainer_mesh)
    model = load_model(config.model.checkpoint, mesh=mesh, param_dtype=config.model.param_dtype,
                       dtype=config.model.dtype, remat=config.model.remat)
    learner = Learner(config, model, mesh)
    reward_pool = make_reward_pool(config)  # shared by evaluation and (sync mode) generation
    evaluator = Evaluator(config, learner.trainer.policy(), mesh, reward_pool)
    buffer = make_buffer(config)
    checkpoints = Checkpointer(run_dir / "checkpoints", max_to_keep=config.train.keep_checkpoints)
    metrics = MetricsWriter(run_dir, "trainer")
    run_id = _run_id(run_dir, resume)
    publisher = ParamPublisher(param_store_url(store), run_id, dtype=config.system.publish_dtype,
                               keep=config.system.keep_param_versions)
    start_time = time.time()
    summary_start: dict[str, Any] = {}
    if resume and checkpoints.latest_step() is not None:
        learner.trainer.state, extra = checkpoints.restore(learner.trainer.state)
        buffer.load_state_dict(extra["buffer"])
        summary_start = extra.get("summary_start", {})
        start_time -= extra.get("elapsed_s", 0.0)
        log.info("resumed at step %d (version %s)", learner.step, publisher.latest_version())
    version = publisher.latest_version() or 0
    source = (
        InlineRollouts(config, run_dir, store, learner, mesh, reward_pool) if config.system.mode == "sync" else StoreTail(store)
    )
    log.info("trainer: %s, %s objective, %d steps of %d groups x K=%d, mesh %s", config.name,
             config.train.objective, config.train.steps, config.train.groups_per_step,
             config.buffer.samples_per_group, dict(mesh.shape))
    if not summary_start:
        acc = evaluator.run(learner.trainer.policy())
        log.info("eval before training: accuracy %.3f", acc["eval_accuracy"])
        summary_start = {"eval_accuracy_start": acc["eval_accuracy"]}
        metrics.write(learner.step, {**acc, "version": version, "elapsed_s": 0.0})
        rundir.write_status(run_dir, "trainer", {"step": learner.step, "phase": "waiting for data", **acc})
    last = {"eval_accuracy": summary_start["eval_accuracy_start"]}
    waited = 0.0
    stalled_since, next_stall_warning = 0.0, 60.0
    while learner.step < config.train.steps and not stop():
        source.fill(buffer, version)
        try:
            groups = buffer.sample(np.random.default_rng((config.seed, learner.step)),
                                   config.train.groups_per_step, current_version=version)
        except BufferEmptyError as e:
            t0 = time.time()
            time.sleep(0.05)
            waited += time.time() - t0
            stalled_since = stalled_since or t0
            if t0 - stalled_since > next_stall_warning:
                log.warning("no trainable batch for %.0f s (%s); are the searchers running? see logs/searcher-*.log",
                            t0 - stalled_since, e)
                next_stall_warning *= 2
            rundir.write_status(run_dir, "trainer", {**last, "step": learner.step, "phase": "waiting for data",
                                                     "buffer_rows": len(buffer)})
            continue
        stalled_since, next_stall_warning = 0.0, 60.0
        step_metrics = learner.train_on(groups, version)
        if config.system.mode == "sync":
            step_metrics["generate_s"] = source.last_generate_s
        step = learner.step
        if config.system.mode == "sync":  # on-policy: the params are handed over in memory
            version = step
            source.set_params(learner)
        elif step % config.system.sync_every == 0:
            version = publisher.publish(nnx.to_pure_dict(learner.trainer.state.params), step=step, wait=False)
            buffer.mark_sync(version)
        stats = buffer.stats(current_version=version)
        record = {**step_metrics, "version": version, "buffer_rows": stats["num_rows"],
                  "buffer_prompts": stats["num_prompts"], "buffer_recent_prompts": stats["num_recent_prompts"],
                  "buffer_mean_staleness": stats["mean_staleness"], "trainer_wait_s": waited,
                  "elapsed_s": time.time() - start_time}
        if config.eval.every and step % config.eval.every == 0 and step < config.train.steps:
            record.update(evaluator.run(learner.trainer.policy()))
            log.info("step %d: eval accuracy %.3f", step, record["eval_accuracy"])
        if step % 10 == 0:
            log.info("step %d: loss %.4g reward %.3f lag %.1f buffer %d rows (%.2fs/step)", step, record.get("loss", float("nan")),
                     record["reward_mean"], record["policy_lag_mean"], record["buffer_rows"], record["step_time_s"])
        if step % config.train.log_every == 0 or "eval_accuracy" in record:
            metrics.write(step, record)
        last = {k: record[k] for k in ("reward_mean", "eval_accuracy") if k in record} | {
            "eval_accuracy": record.get("eval_accuracy", last.get("eval_accuracy"))}
        rundir.write_status(run_dir, "trainer", {**last, "step": step, "phase": "training",
                                                 "buffer_rows": record["buffer_rows"],
                                                 "policy_lag": step_metrics["policy_lag_mean"]})
        if step % config.train.checkpoint_every == 0:
            _checkpoint(checkpoints, learner, buffer, summary_start, start_time)
    publisher.wait()
    final = evaluator.run(learner.trainer.policy())
    log.info("final eval accuracy %.3f after %d steps", final["eval_accuracy"], learner.step)
    checkpoints.wait()
    if checkpoints.latest_step() != learner.step:
        _checkpoint(checkpoints, learner, buffer, summary_start, start_time, force=True)
        checkpoints.wait()
    if learner.step % config.system.sync_every:
        version = publisher.publish(nnx.to_pure_dict(learner.trainer.state.params), step=learner.step)
    publisher.close()
    wall = time.time() - start_time
    metrics.write(learner.step, {**final, "version": version, "elapsed_s": wall})
    searchers = rundir.read_status(run_dir)
    samples = sum(s.get("samples", 0) for k, s in searchers.items() if k.startswith("searcher"))
    lags = [(r["policy_lag_mean"], r["policy_lag_max"]) for r in read_metrics(run_dir, "trainer") if "policy_lag_mean" in r]
    summary = {
        "experiment": config.name,
        "objective": config.train.objective,
        "mode": config.system.mode,
        **summary_start,
        "eval_accuracy_end": final["eval_accuracy"],
        "trainer_steps": learner.step,
        "samples_generated": int(samples),
        "tokens_trained": learner.tokens_trained,
        "wall_time_s": wall,
        "trainer_wait_s": waited,
        "final_version": version,
        # over trained rows: trainer's param version minus the version that sampled the row
        "policy_lag_mean": float(np.mean([a for a, _ in lags])) if lags else 0.0,
        "policy_lag_max": int(max((b for _, b in lags), default=0)),
        "stopped_early": learner.step < config.train.steps,
    }
    rundir.write_json_atomic(run_dir / "summary.json", summary)
    metrics.close()
    if reward_pool is not None:
        reward_pool.close()
    plot_learning_curve(run_dir)
    rundir.write_status(run_dir, "trainer", {**last, **final, "step": learner.step, "phase": "done"})
    return summary


class StoreTail:
    """Async data source: new rows from every searcher's store (searchers may appear late)."""

    rediscover_every_s = 5.0  # listing the store directory is cheap, but not free on a bucket

    def __init__(self, store: str):
        self.store = store
        self.tailer = Tailer([])
        self.known: set[int] = set()
        self.last_discovery = -float("inf")

    def fill(self, buffer: TrajectoryBuffer, version: int) -> None:
        if time.time() - self.last_discovery > self.rediscover_every_s or not self.known:
            self.last_discovery = time.time()
            for sid, url in discover_searcher_stores(self.store).items():
                if sid not in self.known:
                    self.known.add(sid)
                    self.tailer.add_source(TrajectoryReader(url))
                    log.info("tailing searcher %d's trajectories (%s)", sid, url)
        self.tailer.poll(buffer)



class InlineRollouts:
    """Sync data source: generate one batch with the current params in this process, then train.

    The same `Rollouts` the searcher process uses; rows are also written to a trajectory store
    so a sync run's data is as durable and inspectable as an async one's."""

    def __init__(self, config: ExperimentConfig, run_dir: Path, store: str, learner: Learner, mesh: Any,
                 reward_pool: Any):
        from tbajax.stores import TrajectoryWriter, trajectory_store_url
        from tbajax.system.searcher import PromptStream, build_rollouts

        self.config = config
        self.run_dir = run_dir
        self.rollouts = build_rollouts(config, 0, mesh, model=learner.trainer.policy(), reward_pool=reward_pool)
        self.writer = TrajectoryWriter(trajectory_store_url(store, 0), 0)
        self.stream = PromptStream(self.rollouts.task.load("train"), 0, 1, config.seed,
                                   start=self.writer.committed_rows() // config.rollout.sampling.num_samples)
        self.key = jax.random.PRNGKey(config.seed + 1000)
        self.samples = 0
        self.generate_s = self.last_generate_s = 0.0

    def fill(self, buffer: TrajectoryBuffer, version: int) -> None:
        t0 = time.time()
        rows = self.rollouts.generate(
            self.rollouts.take_fitting(self.stream, self.config.train.groups_per_step),
            jax.random.fold_in(self.key, self.writer.committed_rows()),
            version=version,
            first_group_id=self.writer.committed_rows(),
        )
        self.writer.append(rows)
        buffer.add(rows)
        self.samples += len(rows)
        self.last_generate_s = time.time() - t0
        self.generate_s += self.last_generate_s
        rundir.write_status(self.run_dir, "searcher-0", {"samples": self.samples, "busy_s": self.generate_s,
                                                         "version": version})

    def set_params(self, learner: Learner) -> None:
        self.rollouts.set_params(learner.trainer.state.params)



def _checkpoint(checkpoints: Checkpointer, learner: Learner, buffer: TrajectoryBuffer,
                summary_start: dict[str, Any], start_time: float, force: bool = False) -> None:
    checkpoints.save(
        learner.trainer.state,
        {"buffer": buffer.state_dict(), "summary_start": summary_start, "elapsed_s": time.time() - start_time},
        force=force,
    )


def _run_id(run_dir: Path, resume: bool) -> str:
    """A run id that survives trainer restarts (stored beside the config)."""
    path = run_dir / "run_id"
    if path.exists():
        return path.read_text().strip()
    if resume:
        log.warning("no run_id file in %s; starting a new param-version lineage", run_dir)
    run_id = uuid.uuid4().hex[:12]
    path.write_text(run_id)
    return run_id
