"""The trainer: tail the searchers' stores into the replay buffer, train, publish every k steps.

`Learner` is the in-memory core (groups of trajectories -> one update), shared verbatim by the
asynchronous trainer process and the synchronous mode, so both train the same objective with
the same code. `run_trainer` is the process: waiting for data, syncs, evaluation, checkpoints,
resume, the final summary.
"""

from __future__ import annotations

import collections
import dataclasses
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
from tbajax.system.metrics import MetricsWriter, machine_info, plot_learning_curve, read_metrics
from tbajax.system.searcher import Rollouts, build_rollouts, make_reward_pool
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
    # sync mode: generation and evaluation share one Rollouts (one scorer: a victim LM loads once)
    inline = build_rollouts(config, 0, mesh, model=learner.trainer.policy(), reward_pool=reward_pool) \
        if config.system.mode == "sync" else None
    evaluator = Evaluator(config, learner.trainer.policy(), mesh, reward_pool, rollouts=inline)
    buffer = make_buffer(config)
    checkpoints = Checkpointer(run_dir / "checkpoints", max_to_keep=config.train.keep_checkpoints)
    metrics = MetricsWriter(run_dir, "trainer")
    run_id = _run_id(run_dir, resume)
    publisher = ParamPublisher(param_store_url(store), run_id, dtype=config.system.publish_dtype,
                               keep=config.system.keep_param_versions)
    counters = RunCounters(start_time=time.time())
    summary_start: dict[str, Any] = {}
    version = publisher.latest_version() or 0
    if resume:
        summary_start = _restore(run_dir, store, checkpoints, learner, buffer, counters)
        restored_syncs = list(buffer.state_dict()["sync_versions"])
        if config.system.mode == "sync":  # on-policy: the version is the step (params handed over in memory)
            version = learner.step
        elif publisher.latest_version() is not None:
            # Searchers may hold params newer than the restored step (published after the last
            # checkpoint): give them the restored params at once, under a new (higher) version.
            version = publisher.publish(nnx.to_pure_dict(learner.trainer.state.params), step=learner.step)
            buffer.mark_sync(version)
            log.info("resumed at step %d; republished its params as version %d", learner.step, version)
        metrics.write(learner.step, {"event": "resume", "from_step": learner.step, "version": version,
                                     "restored_sync_versions": restored_syncs,
                                     "skipped_checkpoints": [k for k, _ in checkpoints.skipped]})
    source = (
        InlineRollouts(config, run_dir, store, inline) if inline is not None
        else StoreTail(store, model.config.vocab_size)
    )
    log.info("trainer: %s, %s objective, %d steps of %d groups x K=%d, mesh %s", config.name,
             config.train.objective, config.train.steps, config.train.groups_per_step,
             config.buffer.samples_per_group, dict(mesh.shape))
    if not summary_start:
        acc = evaluator.run(learner.trainer.policy())
        log.info("eval before training: %s %.3f", evaluator.metric, acc["eval_score"])
        summary_start = {"eval_score_start": acc["eval_score"], "eval_start": acc}
        if "eval_accuracy" in acc:
            summary_start["eval_accuracy_start"] = acc["eval_accuracy"]
        metrics.write(learner.step, {**acc, "version": version, "elapsed_s": counters.elapsed()})
        rundir.write_status(run_dir, "trainer", {"step": learner.step, "phase": "waiting for data", **acc})
    # checkpoints written before eval_score existed hold only eval_accuracy_start
    last = {"eval_score": summary_start.get("eval_score_start", summary_start.get("eval_accuracy_start"))}
    stalled_since, next_stall_warning = 0.0, 60.0
    while learner.step < config.train.steps and not stop():
        source.fill(buffer, version)
        try:
            groups = buffer.sample(np.random.default_rng((config.seed, learner.step)),
                                   config.train.groups_per_step, current_version=version)
        except BufferEmptyError as e:
            t0 = time.time()
            time.sleep(0.05)
            counters.wait_s += time.time() - t0
            stalled_since = stalled_since or t0
            if t0 - stalled_since > next_stall_warning:
                log.warning("no trainable batch for %.0f s (%s); are the searchers running? see logs/searcher-*.log",
                            t0 - stalled_since, e)
                next_stall_warning *= 2
            rundir.write_status(run_dir, "trainer", {**last, "step": learner.step, "phase": "waiting for data",
                                                     "buffer_rows": len(buffer), **source.invalid_status()})
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
                  "buffer_mean_staleness": stats["mean_staleness"], "trainer_wait_s": counters.wait_s,
                  "invalid_rows_skipped": source.invalid_total(), "elapsed_s": counters.elapsed()}
        if config.eval.every and step % config.eval.every == 0 and step < config.train.steps:
            record.update(evaluator.run(learner.trainer.policy()))
            log.info("step %d: eval %s %.3f", step, evaluator.metric, record["eval_score"])
        if step % 10 == 0:
            log.info("step %d: loss %.4g reward %.3f lag %.1f buffer %d rows (%.2fs/step)", step, record.get("loss", float("nan")),
                     record["reward_mean"], record["policy_lag_mean"], record["buffer_rows"], record["step_time_s"])
        if step % config.train.log_every == 0 or "eval_score" in record:
            metrics.write(step, record)
        last = {k: record[k] for k in ("reward_mean", "eval_score") if k in record} | {
            "eval_score": record.get("eval_score", last.get("eval_score"))}
        rundir.write_status(run_dir, "trainer", {**last, "step": step, "phase": "training",
                                                 "buffer_rows": record["buffer_rows"],
                                                 "policy_lag": step_metrics["policy_lag_mean"],
                                                 **source.invalid_status()})
        if step % config.train.checkpoint_every == 0:
            _checkpoint(checkpoints, learner, buffer, summary_start, counters)
    stopped_early = learner.step < config.train.steps
    # Checkpoint before the final evaluation: a stop request gives us a grace period, and a slow
    # evaluation must not cost the steps since the last checkpoint.
    if stopped_early:
        log.warning("stop requested at step %d of %d: checkpointing first", learner.step, config.train.steps)
        rundir.write_status(run_dir, "trainer", {**last, "step": learner.step, "phase": "checkpointing (stopping)"})
    checkpoints.wait()
    if checkpoints.latest_step() != learner.step:
        _checkpoint(checkpoints, learner, buffer, summary_start, counters, force=True)
        checkpoints.wait()
    publisher.wait()
    if learner.step % config.system.sync_every:
        version = publisher.publish(nnx.to_pure_dict(learner.trainer.state.params), step=learner.step)
    publisher.close()
    rundir.write_status(run_dir, "trainer", {**last, "step": learner.step, "phase": "final evaluation"})
    final = evaluator.run(learner.trainer.policy())
    log.info("final eval %s %.3f after %d steps", evaluator.metric, final["eval_score"], learner.step)
    wall = counters.elapsed()
    metrics.write(learner.step, {**final, "version": version, "elapsed_s": wall})
    lags = [(r["policy_lag_mean"], r["policy_lag_max"]) for r in read_metrics(run_dir, "trainer") if "policy_lag_mean" in r]
    summary = {
        "experiment": config.name,
        "objective": config.train.objective,
        "mode": config.system.mode,
        "eval_metric": evaluator.metric,  # the task's headline metric: eval_score_* is this
        **summary_start,
        "eval_score_end": final["eval_score"],
        "eval_end": final,
        **({"eval_accuracy_end": final["eval_accuracy"]} if "eval_accuracy" in final else {}),
        "trainer_steps": learner.step,
        "samples_generated": committed_rows(store),  # durable: survives searcher restarts and resumes
        "tokens_trained": learner.tokens_trained,
        "wall_time_s": wall,
        "trainer_wait_s": counters.wait_s,
        "final_version": version,
        # over trained rows: trainer's param version minus the version that sampled the row
        "policy_lag_mean": float(np.mean([a for a, _ in lags])) if lags else 0.0,
        "policy_lag_max": int(max((b for _, b in lags), default=0)),
        "invalid_rows_skipped": source.invalid_total(),
        "invalid_rows_by_reason": dict(source.invalid_rows),
        "stopped_early": stopped_early,
        "stopped_at_step": learner.step if stopped_early else None,
        "machine": machine_info(),  # absolute times mean something only next to its matmul rate
    }
    if stopped_early:
        summary["resume_with"] = f"python -m tbajax.main --run-dir={run_dir} --resume"
        log.warning("stopped at step %d of %d (checkpointed); continue with: %s", learner.step,
                    config.train.steps, summary["resume_with"])
    rundir.write_json_atomic(run_dir / "summary.json", summary)
    metrics.close()
    if reward_pool is not None:
        reward_pool.close()
    plot_learning_curve(run_dir, metric=evaluator.metric)
    rundir.write_status(run_dir, "trainer", {**last, **final, "step": learner.step, "phase": "done"})
    return summary


@dataclasses.dataclass
class RunCounters:
    """Run totals that must survive a trainer restart (kept in the checkpoint's extra state)."""

    start_time: float  # wall-clock start, shifted back by the elapsed time of earlier sessions
    wait_s: float = 0.0  # time the trainer waited for a trainable batch

    def elapsed(self) -> float:
        return time.time() - self.start_time


def _restore(run_dir: Path, store: str, checkpoints: Checkpointer, learner: Learner, buffer: TrajectoryBuffer,
             counters: RunCounters) -> dict[str, Any]:
    """Restore the newest readable checkpoint; returns its summary_start ({} when there is none)."""
    if checkpoints.latest_step() is None:
        rows = committed_rows(store)
        log.warning("--resume: no complete checkpoint under %s; STARTING AGAIN FROM STEP 0 with the initial "
                    "params, rebuilding the replay buffer from the %d rows already in the trajectory stores",
                    checkpoints.directory, rows)
        rundir.write_status(run_dir, "trainer", {"step": 0, "phase": "no checkpoint to resume: restarting at step 0"})
        return {}
    learner.trainer.state, extra = checkpoints.restore(learner.trainer.state)
    buffer.load_state_dict(extra["buffer"])
    counters.start_time -= float(extra.get("elapsed_s", 0.0))
    counters.wait_s = float(extra.get("trainer_wait_s", 0.0))
    learner.tokens_trained = int(extra.get("tokens_trained", 0))
    if checkpoints.skipped:
        log.warning("resumed from checkpoint %d; skipped unreadable newer checkpoint(s) %s",
                    learner.step, [s for s, _ in checkpoints.skipped])
    return dict(extra.get("summary_start", {}))


def committed_rows(store: str) -> int:
    """Rows committed to all trajectory stores of a run (durable, unlike per-process counters)."""
    return sum(TrajectoryReader(url).committed_rows() for url in discover_searcher_stores(store).values())


def check_row(traj: Trajectory, vocab_size: int) -> str | None:
    """Why a row read from a store cannot be trained on, or None when it can.

    A store is durable, so one bad row (a grader bug that slipped a NaN through, a corrupted
    token id) would stop every resume of the run forever if the trainer died on it."""
    if not np.isfinite(traj.reward):
        return "non-finite reward"
    for name in ("prompt_tokens", "response_tokens"):
        ids = getattr(traj, name)
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            return f"{name} outside [0, vocab_size)"
    if len(traj.behavior_logprobs) != len(traj.response_tokens):
        return "behavior_logprobs length differs from the response's"
    if not np.isfinite(traj.behavior_logprobs).all():
        return "non-finite behavior log-probs"
    if traj.reference_logprobs is not None and not np.isfinite(traj.reference_logprobs).all():
        return "non-finite reference log-probs"
    return None


class StoreTail:
    """Async data source: new rows from every searcher's store (searchers may appear late).

    Rows that cannot be trained on (`check_row`) are skipped and counted here, before they reach
    the buffer: the count says how many, and by which reason."""

    rediscover_every_s = 5.0  # listing the store directory is cheap, but not free on a bucket

    def __init__(self, store: str, vocab_size: int):
        self.store = store
        self.vocab_size = vocab_size
        self.tailer = Tailer([])
        self.known: set[int] = set()
        self.last_discovery = -float("inf")
        self.invalid_rows: collections.Counter[str] = collections.Counter()

    def fill(self, buffer: TrajectoryBuffer, version: int) -> None:
        if time.time() - self.last_discovery > self.rediscover_every_s or not self.known:
            self.last_discovery = time.time()
            for sid, url in discover_searcher_stores(self.store).items():
                if sid not in self.known:
                    self.known.add(sid)
                    self.tailer.add_source(TrajectoryReader(url))
                    log.info("tailing searcher %d's trajectories (%s)", sid, url)
        self.tailer.poll(_CheckedRows(buffer, self))

    def invalid_total(self) -> int:
        return sum(self.invalid_rows.values())

    def invalid_status(self) -> dict[str, int]:
        return {"invalid_rows_skipped": self.invalid_total()} if self.invalid_rows else {}


class _CheckedRows:
    """What the tailer adds rows to: the buffer, minus the rows `check_row` rejects."""

    def __init__(self, buffer: TrajectoryBuffer, tail: StoreTail):
        self.buffer = buffer
        self.tail = tail

    def add(self, rows: Sequence[Trajectory]) -> None:
        good = []
        for t in rows:
            reason = check_row(t, self.tail.vocab_size)
            if reason is None:
                good.append(t)
                continue
            self.tail.invalid_rows[reason] += 1
            n = self.tail.invalid_total()
            if n in (1, 10, 100, 1000) or n % 10000 == 0:
                log.warning("skipped %d invalid store rows so far (%s); latest: searcher %d group %d (%s)",
                            n, dict(self.tail.invalid_rows), t.searcher_id, t.group_id, reason)
        self.buffer.add(good)


class InlineRollouts:
    """Sync data source: generate one batch with the current params in this process, then train.

    The same `Rollouts` the searcher process uses; rows are also written to a trajectory store
    so a sync run's data is as durable and inspectable as an async one's."""

    def __init__(self, config: ExperimentConfig, run_dir: Path, store: str, rollouts: Rollouts):
        from tbajax.stores import TrajectoryWriter, trajectory_store_url
        from tbajax.system.searcher import PromptStream

        self.config = config
        self.run_dir = run_dir
        self.rollouts = rollouts
        self.writer = TrajectoryWriter(trajectory_store_url(store, 0), 0)
        self.stream = PromptStream(self.rollouts.task.load("train"), 0, 1, config.seed,
                                   start=self.writer.committed_rows() // config.rollout.sampling.num_samples)
        self.key = jax.random.PRNGKey(config.seed + 1000)
        self.invalid_rows: collections.Counter[str] = collections.Counter()  # rows come straight from the sampler
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
        if self.rollouts.grades.all_failed():
            from tbajax.system.searcher import stop_failing_grader

            stop_failing_grader(self.rollouts, 0)
        buffer.add(rows)
        self.samples += len(rows)
        self.last_generate_s = time.time() - t0
        self.generate_s += self.last_generate_s
        rundir.write_status(self.run_dir, "searcher-0", {"samples": self.samples, "busy_s": self.generate_s,
                                                         "version": version})

    def set_params(self, learner: Learner) -> None:
        self.rollouts.set_params(learner.trainer.state.params)

    def invalid_total(self) -> int:
        return 0

    def invalid_status(self) -> dict[str, int]:
        return {}



def _checkpoint(checkpoints: Checkpointer, learner: Learner, buffer: TrajectoryBuffer,
                summary_start: dict[str, Any], counters: RunCounters, force: bool = False) -> None:
    checkpoints.save(
        learner.trainer.state,
        {"buffer": buffer.state_dict(), "summary_start": summary_start, "elapsed_s": counters.elapsed(),
         "trainer_wait_s": counters.wait_s, "tokens_trained": learner.tokens_trained},
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
