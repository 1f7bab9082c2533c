"""The trainer: tail the searchers' stores into the replay buffer, train, publish every k steps.

`Learner` is the in-memory core (groups of trajectories -> one update), shared verbatim by the
asynchronous trainer process and the synchronous mode, so both train the same objective with
the same code. `run_trainer` is the process: waiting for data, syncs, evaluation, checkpoints,
resume, the final summary.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from tbajax.batch import Batch
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
from tbajax.system.distributed import (
    STOP,
    Stop,
    NullMetrics,
    PrimaryEvaluation,
    StepAgreement,
    is_primary,
    primary_only,
)
from tbajax.system.evaluation import Evaluator
from tbajax.system.evaluator import PIN_PURPOSE, eval_only, eval_pin, eval_requests, eval_steps, final_eval, \
    missing_eval_steps
from tbajax.system.metrics import MetricsWriter, eval_records, machine_info, plot_learning_curve, read_metrics
from tbajax.system.pipeline import BackgroundPublish, PollBackoff, Prefetcher, UpdateClock
from tbajax.system.publishing import params_to_publish
from tbajax.system.run_model import keep_model_files
from tbajax.system.searcher import Rollouts, build_rollouts, make_reward_pool
from tbajax.system.wandb_logging import open_wandb
from tbajax.training import Checkpointer, PolicyUpdater
from tbajax.training.collate import UnpackableGroups, collate
from tbajax.training.layout import LAYOUTS, batch_layout, cheapest
from tbajax.training.state import policy_params
from tbajax.trajectory import Trajectory

log = logging.getLogger(__name__)


class Learner:
    """Groups of trajectories in, one optimizer update out."""

    def __init__(self, config: ExperimentConfig, model: CausalLM, mesh: Any = None, *,
                 compiler_options: dict[str, Any] | None = None):
        self.config = config
        self.objective, self.objective_config = resolve_objective(
            config.train.objective, overrides=dict(config.train.objective_options)
        )
        self.trainer = PolicyUpdater(model, config.train.trainer, self.objective, self.objective_config, mesh=mesh,
                                     lora=config.model.lora, compiler_options=compiler_options)
        self.model_config = model.config
        self.rows = config.train.groups_per_step * config.buffer.samples_per_group
        self.tokens_trained = 0
        self._warned_unpackable = False  # pack_groups="auto" met groups that do not share a prompt

    @property
    def step(self) -> int:
        return self.trainer.updates_applied

    def prepare(self, groups: Sequence[Sequence[Trajectory]], current_version: int = 0) -> Batch:
        """Collate and validate one step's groups (host side; safe in a background thread);
        `current_version` goes into the batch (objectives measure token staleness against it)."""
        trainer = self.config.train.trainer

        def in_layout(layout: str) -> Batch:
            return collate(
                groups,
                beta=_beta_placeholder(self.config),
                num_rows=self.rows,
                score_stop_token=self.config.train.score_stop_token,
                length_bucket=self.config.train.length_bucket,
                pack_microbatches=None if layout == "rows" else trainer.num_microbatches,
                pack_row_multiple=self.trainer.batch_shards,
                pack_strided=layout == "strided",
                current_version=current_version,
            )

        layouts = self.trainer.layouts
        if len(layouts) == 1:
            batch = in_layout(layouts[0])
        else:  # pack_groups="auto": each layout that can hold the groups, the cheapest kept
            batches = []
            for layout in layouts:
                try:
                    batches.append(in_layout(layout))
                except UnpackableGroups as e:
                    if not self._warned_unpackable:
                        log.warning("pack_groups=auto scores a batch in rows: %s", e)
                        self._warned_unpackable = True
            batch = cheapest(batches, self.model_config, trainer.layout_attention_weight)
        validate_batch(batch, self.objective, objective_config=self.objective_config,
                       reference_from_trainer=trainer.compute_reference_logprobs)
        return batch

    @staticmethod
    def batch_metrics(groups: Sequence[Sequence[Trajectory]], batch: Batch, current_version: int) -> dict[str, float]:
        """What a step's record says about its data; `current_version`: the trainer's param version
        when the groups were sampled (the lag is measured against it). policy_lag_*: per sample,
        from its oldest version; token_lag_*: per response token, from `token_versions` (they
        differ when the searcher swapped params mid-sequence)."""
        rows = [t for g in groups for t in g]
        per_searcher = np.bincount([t.searcher_id for t in rows], minlength=1)
        rewards = np.array([t.reward for t in rows], np.float64)
        lags = np.array([current_version - t.policy_version for t in rows])
        return dict(
            **token_lag_metrics(rows, current_version),
            reward_mean=float(rewards.mean()),
            reward_std_within_group=float(np.mean([np.std([t.reward for t in g]) for g in groups])),
            response_length=float(np.mean([len(t.response_tokens) for t in rows])),
            policy_lag_mean=float(lags.mean()),
            policy_lag_max=float(lags.max()),
            train_tokens=int(np.asarray(batch.loss_mask).sum()),
            # the step's layout (`training.layout`): 0 rows, 1 packed, 2 strided groups
            batch_layout=LAYOUTS.index(batch_layout(batch)),
            **{f"rows_from_searcher_{i}": int(n) for i, n in enumerate(per_searcher)},
        )


def token_lag_metrics(rows: Sequence[Trajectory], current_version: int) -> dict[str, float]:
    """token_lag_mean / token_lag_max: current_version − token version over every response token
    of `rows` (0 when no row has a response token)."""
    versions = np.concatenate([np.asarray(t.token_versions, np.int64) for t in rows] or [np.zeros(0, np.int64)])
    if not versions.size:
        return dict(token_lag_mean=0.0, token_lag_max=0.0)
    lags = current_version - versions
    return dict(token_lag_mean=float(lags.mean()), token_lag_max=float(lags.max()))


def _beta_placeholder(config: ExperimentConfig) -> float:
    """β written into the host batch; the trainer's β schedule replaces it inside the step."""
    beta = config.train.trainer.beta
    return beta.start if beta is not None else 0.0


def make_buffer(config: ExperimentConfig) -> TrajectoryBuffer:
    # sync mode consumes exactly the groups just generated, once; the red-teaming heap mixes them
    # with replay by its own rule (its online set is the batch just generated)
    if config.system.mode == "sync" and config.buffer.mode != "reward_heap":
        return buffer_for(
            BufferConfig(mode="fifo_once", async_level=0, samples_per_group=config.buffer.samples_per_group)
        )
    return buffer_for(config.buffer)


def run_trainer(run_dir: Path, *, resume: bool = False, store_url: str | None = None) -> dict[str, Any]:
    """The trainer process. Returns the run summary (also written to summary.json)."""
    config = rundir.load_config(run_dir)
    store = store_url or str(run_dir)
    # several trainer processes: process 0 decides every batch and alone writes (tbajax.system.distributed)
    agreement, primary = StepAgreement(), is_primary()
    write_status = primary_only(rundir.write_status)
    stop = rundir.StopFlag(run_dir)
    mesh = make_mesh(config.system.trainer_mesh)
    model = load_model(config.model.checkpoint, mesh=mesh, param_dtype=config.model.param_dtype,
                       dtype=config.model.dtype, remat=config.model.remat,
                       scan_layers=config.model.scan_layers, attention=config.model.attention,
                       head_chunk_tokens=config.model.head_chunk_tokens)
    learner = Learner(config, model, mesh)
    reward_pool = make_reward_pool(config)  # shared by evaluation and (sync mode) generation
    # sync mode: generation and evaluation share one Rollouts (one scorer: a victim LM loads once);
    # a multi-process trainer (async only) evaluates on process 0's own devices
    inline = build_rollouts(config, 0, mesh, model=learner.trainer.policy(), reward_pool=reward_pool) \
        if config.system.mode == "sync" else None
    by_process = evaluates_in_process(config)  # eval.mode=process: the evaluator role evaluates what we pin
    evaluator = None if by_process else PrimaryEvaluation(
        lambda policy, on: Evaluator(config, policy, on, reward_pool, rollouts=inline), learner.trainer.policy(), mesh,
        lambda: make_mesh(config.system.searcher_mesh, devices=jax.local_devices()), agreement)
    buffer = make_buffer(config)
    checkpoints = Checkpointer(run_dir / "checkpoints", max_to_keep=config.train.keep_checkpoints)
    metrics = MetricsWriter(run_dir, "trainer", wandb=open_wandb(config, run_dir, "trainer")) \
        if primary else NullMetrics()
    run_id = agreement.share("run_id", lambda: _run_id(run_dir, resume))
    if primary:  # what export / evaluate / samples read where the base checkpoint is not reachable
        keep_model_files(run_dir, config)
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
        elif agreement.share("republish", lambda: publisher.latest_version() is not None):
            # Searchers may hold params newer than the restored step (published after the last
            # checkpoint): give them the restored params at once, under a new (higher) version.
            version = publisher.publish(*params_to_publish(config, learner.trainer), step=learner.step)
            buffer.mark_sync(version)
            log.info("resumed at step %d; republished its params as version %d", learner.step, version)
        metrics.write(learner.step, {"event": "resume", "from_step": learner.step, "version": version,
                                     "restored_sync_versions": restored_syncs,
                                     "skipped_checkpoints": [k for k, _ in checkpoints.skipped]})
        if by_process and primary:
            drop_rolled_back_pins(publisher, learner.step)
    source = (
        InlineRollouts(config, run_dir, store, inline) if inline is not None
        else StoreTail(store, model.config.vocab_size)
    )
    log.info("trainer: %s, %s objective, %d steps of %d groups x K=%d, mesh %s", config.name,
             config.train.objective, config.train.steps, config.train.groups_per_step,
             config.buffer.samples_per_group, dict(mesh.shape))
    if evaluator is not None and not summary_start:
        acc = evaluator.run(learner.trainer.policy())
        log.info("eval before training: %s %.3f", evaluator.metric, acc["eval_score"])
        summary_start = {"eval_score_start": acc["eval_score"], "eval_start": acc}
        if "eval_accuracy" in acc:
            summary_start["eval_accuracy_start"] = acc["eval_accuracy"]
        metrics.write(learner.step, {**acc, "eval_metric": evaluator.metric, "version": version,
                                     "elapsed_s": counters.elapsed()})
        write_status(run_dir, "trainer", {"step": learner.step, "phase": "waiting for data", **acc})
    # checkpoints written before eval_score existed hold only eval_accuracy_start
    last = {"eval_score": summary_start.get("eval_score_start", summary_start.get("eval_accuracy_start"))}
    publishing = BackgroundPublish(publisher, threaded=config.train.pipeline and jax.process_count() == 1)
    pinned: dict[int, int] = {}  # step -> version pinned for the evaluator in this session

    def pins_after(step: int) -> bool:
        """eval.mode=process: the params after `step` are published and pinned for the evaluator."""
        return by_process and (is_eval_step(config, step) or step == config.train.steps)

    def publish(step: int) -> int:
        """Publish the params after update `step` (right after it was dispatched); its version."""
        pin = eval_pin(counters.elapsed(), final=step == config.train.steps) if pins_after(step) else None
        version = publishing.publish(*params_to_publish(config, learner.trainer), step=step, pin=pin)
        if pin is not None:
            pinned[step] = version
            if primary:
                _note_eval_backlog(publisher, step)
        return version

    def on_step(step: int, record: dict[str, Any]) -> None:
        """A finished update's record; the learner's params are those after `step` when the loop
        paused after it (`pauses_after`: evaluation and checkpoint steps)."""
        nonlocal last
        if evaluator is not None and is_eval_step(config, step):
            record.update(evaluator.run(learner.trainer.policy()), eval_metric=evaluator.metric)
            log.info("step %d: eval %s %.3f", step, evaluator.metric, record["eval_score"])
        if step % 10 == 0 and primary:
            log.info("step %d: loss %.4g reward %.3f lag %.1f buffer %d rows (%.2fs/step)", step, record.get("loss", float("nan")),
                     record["reward_mean"], record["policy_lag_mean"], record["buffer_rows"], record["step_time_s"])
        if step % config.train.log_every == 0 or "eval_score" in record:
            metrics.write(step, record)
        last = {k: record[k] for k in ("reward_mean", "eval_score") if k in record} | {
            "eval_score": record.get("eval_score", last.get("eval_score"))}
        write_status(run_dir, "trainer", {**last, "step": step, "phase": "training",
                                          "buffer_rows": record["buffer_rows"],
                                          "policy_lag": record["policy_lag_mean"],
                                          **loop.invalid_status})
        if step % config.train.checkpoint_every == 0:
            _checkpoint(checkpoints, learner, buffer, summary_start, counters)

    def pauses_after(step: int) -> bool:  # eval.mode=process: evaluation reads published params, no pause
        evaluates = evaluator is not None and is_eval_step(config, step)
        return evaluates or step % config.train.checkpoint_every == 0

    def on_stall(error: BufferEmptyError) -> None:
        write_status(run_dir, "trainer", {**last, "step": loop.step, "phase": "waiting for data",
                                          "buffer_rows": len(buffer), **loop.invalid_status})

    loop = StepLoop(config, learner, buffer, source, counters, version=version, publish=publish,
                    on_step=on_step, pauses_after=pauses_after, stop=stop, on_stall=on_stall,
                    agreement=agreement, publishes_after=pins_after)
    try:
        loop.run()
    finally:
        try:
            publishing.close()
        except Exception:  # noqa: BLE001 - do not hide the error that ended the loop
            log.exception("publishing the last params failed")
    version = loop.version
    stopped_early = learner.step < config.train.steps
    # Checkpoint before the final evaluation: a stop request gives us a grace period, and a slow
    # evaluation must not cost the steps since the last checkpoint.
    if stopped_early:
        log.warning("stop requested at step %d of %d: checkpointing first", learner.step, config.train.steps)
        write_status(run_dir, "trainer", {**last, "step": learner.step, "phase": "checkpointing (stopping)"})
    checkpoints.wait()
    if checkpoints.latest_step() != learner.step:
        _checkpoint(checkpoints, learner, buffer, summary_start, counters, force=True)
        checkpoints.wait()
    publisher.wait()
    final_pin = None
    if by_process and not stopped_early:
        # the evaluator's eval_end: the params after the last step, pinned (a resume at the end
        # of a finished run, or one that changed train.steps, has not pinned them in this session)
        final_pin = pinned.get(learner.step)
        if final_pin is None:
            pin = eval_pin(counters.elapsed(), final=True)
            final_pin = version = publisher.publish(*params_to_publish(config, learner.trainer),
                                                    step=learner.step, pin=pin)
    if learner.step % config.system.sync_every and final_pin is None:
        version = publisher.publish(*params_to_publish(config, learner.trainer), step=learner.step)
    publisher.close()
    if evaluator is not None:
        write_status(run_dir, "trainer", {**last, "step": learner.step, "phase": "final evaluation"})
        final = evaluator.run(learner.trainer.policy())
    if not primary:  # the summary, plots and status are process 0's
        if reward_pool is not None:
            reward_pool.close()
        return {"process_index": jax.process_index(), "trainer_steps": learner.step,
                **({} if evaluator is None else {"eval_end": final})}
    wall = counters.elapsed()
    process_evals: dict[str, Any] = {}
    if evaluator is None:
        write_status(run_dir, "trainer", {**last, "step": learner.step, "phase": "waiting for the evaluator"})
        summary_start, final, process_evals = _evaluator_results(config, run_dir, final_pin, learner.step,
                                                                 stop)
        metric = process_evals.pop("eval_metric")
    else:
        metric = evaluator.metric
        log.info("final eval %s %.3f after %d steps", metric, final["eval_score"], learner.step)
        metrics.write(learner.step, {**final, "eval_metric": metric, "version": version, "elapsed_s": wall})
    lags = [(r["policy_lag_mean"], r["policy_lag_max"]) for r in read_metrics(run_dir, "trainer") if "policy_lag_mean" in r]
    summary = {
        "experiment": config.name,
        "objective": config.train.objective,
        "mode": config.system.mode,
        "eval_metric": metric,  # the task's headline metric: eval_score_* is this
        "eval_mode": "process" if evaluator is None else "inline",
        **summary_start,
        "eval_score_end": final["eval_score"],
        "eval_end": final,
        **({"eval_accuracy_end": final["eval_accuracy"]} if "eval_accuracy" in final else {}),
        **process_evals,  # eval.mode=process: which step eval_end is of, eval steps without a result
        "trainer_steps": learner.step,
        "samples_generated": committed_rows(store),  # durable: survives searcher restarts and resumes
        "tokens_trained": learner.tokens_trained,
        "wall_time_s": wall,
        "trainer_wait_s": counters.wait_s,
        "train_loop": "pipelined" if loop.pipelined else "serial",
        # device idle between updates / the step loop's wall time (StepLoop, UpdateClock); in
        # sync mode the inline generation between updates counts as idle (no update in flight)
        "trainer_idle_share": counters.idle_share if counters.loop_wall_s > 0 else None,
        "trainer_idle_s": counters.idle_s,
        "loop_wall_s": counters.loop_wall_s,
        "batch_prep_s": counters.prep_s,  # host time drawing batches (overlapped when pipelined)
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
    plot_learning_curve(run_dir, metric=metric)
    rundir.write_status(run_dir, "trainer", {**last, **final, "step": learner.step, "phase": "done"})
    return summary


def evaluates_in_process(config: ExperimentConfig) -> bool:
    """Whether the evaluator role evaluates (eval.mode=process, async); sync mode always
    evaluates inline, in its one process (logged, since the config asked otherwise)."""
    if config.eval.mode != "process":
        return False
    if config.system.mode == "sync":
        log.warning("eval.mode=process: sync mode runs everything in one process, so it evaluates inline "
                    "(between updates); set eval.mode=inline to silence this")
        return False
    return True


def is_eval_step(config: ExperimentConfig, step: int) -> bool:
    """A periodic evaluation step (`eval.every`); the last step's evaluation is the final one."""
    return bool(config.eval.every) and step % config.eval.every == 0 and step < config.train.steps


def drop_rolled_back_pins(publisher: ParamPublisher, step: int) -> None:
    """A resumed trainer continues from `step`: eval pins of later steps hold params it rolled
    back (the steps are trained again and pinned again, under new versions)."""
    for r in eval_requests(publisher.pins()):
        if r.step > step:
            publisher.unpin(r.version)
            log.info("resume: dropped the eval request of rolled-back step %d (version %d)", r.step,
                     r.version)


_BACKLOG_WARN = 3  # eval versions waiting for the evaluator before the trainer says it falls behind


def _note_eval_backlog(publisher: ParamPublisher, step: int) -> None:
    """Warn when the evaluator falls behind: every waiting eval version stays on disk."""
    waiting = [r for r in publisher.pins() if r.get("purpose") == PIN_PURPOSE]
    if len(waiting) > _BACKLOG_WARN:
        log.warning("step %d: %d eval versions wait for the evaluator (steps %s); each stays in the param "
                    "store until evaluated: evaluate less often (eval.every) or on fewer problems "
                    "(eval.num_problems)",
                    step, len(waiting), [r["step"] for r in waiting])


def wait_for_eval(run_dir: Path, version: int, timeout_s: float, stop: Callable[[], bool],
                  poll_s: float = 1.0) -> Mapping[str, Any] | None:
    """The evaluator's record of `version`, waiting for it while the evaluator makes progress:
    None once it has written nothing new for `timeout_s` (or a stop was requested)."""
    seen, last_progress = -1, time.time()
    while True:
        records = read_metrics(run_dir, "evaluator", superseded=True)
        found = final_eval(records, version)
        if found is not None:
            return found
        if len(records) != seen:
            seen, last_progress = len(records), time.time()
        if time.time() - last_progress > timeout_s or stop():
            return None
        time.sleep(poll_s)


def _evaluator_results(config: ExperimentConfig, run_dir: Path, final_version: int | None, last_step: int,
                       stop: Callable[[], bool]) -> tuple[dict[str, Any], dict[str, float], dict[str, Any]]:
    """eval.mode=process: (summary_start, eval_end, more summary fields) from the evaluator's
    records, after waiting for its evaluation of `final_version` (None: stopped early, no wait)."""
    t0 = time.time()
    found = None
    if final_version is not None:
        log.info("waiting for the evaluator's final evaluation (step %d, version %d); giving up after %.0f s "
                 "without a new evaluator result (eval.wait_timeout_s)", last_step, final_version,
                 config.eval.wait_timeout_s)
        found = wait_for_eval(run_dir, final_version, config.eval.wait_timeout_s, stop)
        if found is None:
            log.warning("no final evaluation from the evaluator (step %d, version %d) after waiting %.0f s "
                        "(eval.wait_timeout_s=%g%s); summary.json gets the newest evaluation there is: see "
                        "eval_end_step, and logs/evaluator.log", last_step, final_version, time.time() - t0,
                        config.eval.wait_timeout_s, ", stop requested" if stop() else "")
        else:
            log.info("final eval %s %.3f after %d steps (waited %.1f s for the evaluator)",
                     found.get("eval_metric"), found["eval_score"], last_step, time.time() - t0)
    records = eval_records(run_dir)
    start = next((r for r in records if int(r["step"]) == 0), None)
    end = found or (records[-1] if records else None)
    missing = missing_eval_steps(eval_steps(config.eval.every, last_step), records)
    if missing:
        log.warning("eval steps without an evaluation result: %s (see logs/evaluator.log)", missing)
    nan = {"eval_score": float("nan")}
    start_eval = eval_only(start) if start is not None else nan
    end_eval = eval_only(end) if end is not None else nan
    summary_start = {"eval_score_start": start_eval["eval_score"], "eval_start": start_eval}
    if "eval_accuracy" in start_eval:
        summary_start["eval_accuracy_start"] = start_eval["eval_accuracy"]
    metric = next((r["eval_metric"] for r in reversed(records) if "eval_metric" in r), "eval_score")
    more = {"eval_metric": metric, "eval_end_step": None if end is None else int(end["step"]),
            "eval_end_version": None if end is None else int(end["version"]),
            "eval_end_is_final": found is not None, "eval_steps_missing": missing,
            "eval_wait_s": time.time() - t0}
    return summary_start, end_eval, more


@dataclasses.dataclass
class RunCounters:
    """Run totals that must survive a trainer restart (kept in the checkpoint's extra state)."""

    start_time: float  # wall-clock start, shifted back by the elapsed time of earlier sessions
    wait_s: float = 0.0  # time the trainer waited for a trainable batch
    idle_s: float = 0.0  # device idle between updates (`UpdateClock`: sum of idle_n)
    loop_wall_s: float = 0.0  # wall time of the step loop (`UpdateClock`: sum of cycle_n)
    prep_s: float = 0.0  # host time drawing batches (tail/generate, sample, collate, validate)

    @property
    def idle_share(self) -> float:
        """The trainer's idle share: the fraction of the step loop's wall time (evaluation and
        checkpoint pauses and each session's first, compiling update excluded) in which no
        update was in flight on the device; see `tbajax.system.pipeline.UpdateClock`."""
        return self.idle_s / self.loop_wall_s if self.loop_wall_s > 0 else float("nan")

    def elapsed(self) -> float:
        return time.time() - self.start_time


@dataclasses.dataclass
class DrawnBatch:
    """One step's batch as `draw_batch` made it."""

    step: int  # the update it is for (1-based)
    version: int  # the trainer's param version when it was sampled (its lag is measured against it)
    groups: list[list[Trajectory]]
    batch: Batch
    data: dict[str, float]  # Learner.batch_metrics
    prep_s: float  # host seconds: new rows in (tail / generate), sample, collate, validate


def draw_batch(config: ExperimentConfig, learner: Learner, buffer: TrajectoryBuffer, source: Any, version: int,
               step: int, lock: threading.Lock | None = None, *, agreement: StepAgreement | None = None,
               stop: Callable[[], bool] = lambda: False) -> DrawnBatch | Stop:
    """THE place a step's batch is drawn: bring new rows in (tail the stores / generate), sample
    with the step's own generator (seed, step - 1) (a resumed run draws what it would have),
    collate and validate. Raises BufferEmptyError (nothing consumed, no random number drawn).
    Returns STOP when a stop was requested (checked here so that, with several trainer
    processes, process 0 alone decides it: `agreement` hands its groups or STOP to the others,
    which wait for that decision instead of sampling).

    Runs in the prefetch thread of the pipelined loop: `lock` guards the buffer and the source
    against the main thread's `mark_sync` / `stats` (which, by the loop's order, never overlap)."""
    t0 = time.perf_counter()

    def decision() -> Any:  # process 0's (or the only process's) decision for this step
        if stop():
            return STOP
        with lock or contextlib.nullcontext():
            source.fill(buffer, version)
            try:
                return buffer.sample(np.random.default_rng((config.seed, step - 1)), config.train.groups_per_step,
                                     current_version=version)
            except BufferEmptyError as e:
                return e

    groups = (agreement or StepAgreement()).decide(step, decision)
    if groups is STOP:
        return STOP
    if isinstance(groups, BufferEmptyError):
        raise groups
    batch = learner.prepare(groups, current_version=version)
    data = learner.batch_metrics(groups, batch, version)
    if isinstance(source, InlineRollouts):
        data["generate_s"] = source.last_generate_s
    return DrawnBatch(step, version, groups, batch, data, time.perf_counter() - t0)


@dataclasses.dataclass
class _InFlight:
    drawn: DrawnBatch
    host: dict[str, Any]  # the buffer/version snapshot taken right after the update was dispatched
    wait_s: float  # how long the loop waited for the batch


class StepLoop:
    """The trainer's step loop: draw a batch, update, publish, record; serial or pipelined.

    Serial (`train.pipeline=false`, and always in sync mode): draw batch n, dispatch update n,
    wait for it, publish, record, draw n+1. Sync mode must stay serial: its next batch is
    *generated* with update n's params, so there is nothing to overlap.

    Pipelined: the next batch is drawn in a background thread while the device runs the update
    before it, and update n+1 is dispatched before update n is checked:

        get batch n -> dispatch n -> publish n's params, mark the sync, snapshot buffer stats
        -> start drawing batch n+1 (thread) -> check update n-1, record it -> get batch n+1 ...

    Both loops give the same updates, in the same order, from the same batches: batch n+1 is
    drawn after update n's sync is marked, with the version current then and the generator
    (seed, n), exactly as in the serial loop; the buffer is never touched by both threads at once.
    Consequences of checking one update late:
    - A refused update (NonFiniteLossError, not applied) raises when the update after it has
      been dispatched, naming the same update and groups; the run stops as in the serial loop
      (the update in flight is never recorded, published or checkpointed; the refused update's
      unchanged params may have been published once more).
    - Evaluation and checkpoint steps (`pauses_after`) are checked before the next batch is
      drawn and before the next update is dispatched: `on_step` sees the params and the buffer
      after exactly that update. At other steps `on_step` runs while the next update is in flight
      and the batch after it is being drawn: it may write records, not read params or the buffer.
    - A stop request is seen between updates; a batch already drawn is trained on first (its
      draw changed the buffer), so the final checkpoint's buffer and params agree.

    Timings per record (see `tbajax.system.pipeline.UpdateClock` for the idle definition):
    `device_idle_s` (no update in flight before this one), `batch_prep_s` (host time drawing this
    batch), `batch_wait_s` (the loop waited for it), `step_time_s` (wall time since the previous
    update's record, evaluation/checkpoints and data waits excluded; in sync mode it includes the
    generation of the step's batch, also reported alone as `generate_s`).
    """

    def __init__(self, config: ExperimentConfig, learner: Learner, buffer: TrajectoryBuffer, source: Any,
                 counters: RunCounters, *, version: int, publish: Callable[[int], int],
                 on_step: Callable[[int, dict[str, Any]], None], pauses_after: Callable[[int], bool] = lambda s: False,
                 stop: Callable[[], bool] = lambda: False, on_stall: Callable[[BufferEmptyError], None] | None = None,
                 agreement: StepAgreement | None = None,
                 publishes_after: Callable[[int], bool] = lambda s: False):
        self.config = config
        self.learner = learner
        self.buffer = buffer
        self.source = source
        self.counters = counters
        self.version = version
        self.publish = publish
        self.on_step = on_step
        self.pauses_after = pauses_after
        self.publishes_after = publishes_after  # steps published off the sync_every grid (eval.mode=process)
        self.stop = stop
        self.on_stall = on_stall
        self.agreement = agreement or StepAgreement()
        self.pipelined = config.train.pipeline and config.system.mode != "sync"
        self.lock = threading.Lock()
        self.step = 0  # updates dispatched (== applied once the loop returns)
        self.invalid_status: dict[str, int] = {}
        self.clock = UpdateClock()
        self._idle_base, self._wall_base = counters.idle_s, counters.loop_wall_s  # earlier sessions
        self._excluded = 0.0  # evaluation/checkpoint/data-wait seconds since the last record
        self._last_record = 0.0
        self._stalled_since, self._next_stall_warning = 0.0, 60.0
        self._poll = PollBackoff()  # waiting for data: retry within milliseconds, then less often
        self._stall_reported = 0.0  # when on_stall last ran (it writes the status file)

    def run(self) -> None:
        """Train until `train.steps` or a stop request; every dispatched update is checked and
        recorded when this returns (or it raises the error that refused one)."""
        updater, steps = self.learner.trainer, self.config.train.steps
        self.step = self.learner.step  # nothing is in flight: one cheap device read
        self._last_record = time.perf_counter()
        prefetch = Prefetcher("draw-batch", inline=not self.pipelined)
        previous: _InFlight | None = None  # dispatched, not yet checked (pipelined only)
        try:
            if self.step < steps:
                self._request(prefetch)
            while prefetch.outstanding:
                t0 = time.perf_counter()
                drawn = prefetch.get()
                wait_s = time.perf_counter() - t0
                if drawn is STOP:  # a stop request, decided where batches are drawn (draw_batch)
                    break
                if isinstance(drawn, BufferEmptyError):
                    if previous is not None:  # record it before waiting for data
                        self._finish(previous, updater.flush())
                        previous = None
                    self._stalled(drawn)
                    self._request(prefetch)
                    continue
                self._stalled_since, self._next_stall_warning = 0.0, 60.0
                self._poll.reset()
                n = self.step = drawn.step
                if not self.pipelined:
                    updater.submit(drawn.batch)  # nothing else in flight: returns None
                    metrics = updater.flush()
                    self.clock.dispatched(n, *updater.last_dispatch)
                    self._finish(_InFlight(drawn, self._after_update(n), wait_s), metrics)
                    if n < steps:
                        self._request(prefetch)
                    continue
                updater.submit(drawn.batch, check_previous=False)
                self.clock.dispatched(n, *updater.last_dispatch)
                current = _InFlight(drawn, self._after_update(n), wait_s)
                if n >= steps or self.pauses_after(n) or self.stop():
                    if previous is not None:
                        self._finish(previous, updater.check_previous())
                    self._finish(current, updater.flush())
                    previous = None
                    if n < steps:
                        self._request(prefetch)
                    continue
                self._request(prefetch)  # batch n+1 is drawn while the device runs update n
                if previous is not None:
                    self._finish(previous, updater.check_previous())
                previous = current
            if previous is not None:  # a stop request came while it was in flight
                self._finish(previous, updater.flush())
        finally:
            prefetch.close()
            self.clock.close()

    def _request(self, prefetch: Prefetcher) -> None:
        step, version = self.step + 1, self.version

        def job() -> DrawnBatch | BufferEmptyError:
            try:
                return draw_batch(self.config, self.learner, self.buffer, self.source, version, step, self.lock,
                                  agreement=self.agreement, stop=self.stop)
            except BufferEmptyError as e:
                return e

        prefetch.request(job)

    def _after_update(self, step: int) -> dict[str, Any]:
        """Right after update `step` was dispatched (serial: finished): publish its params, mark the
        sync, snapshot what its record says about the buffer. No batch is being drawn now."""
        if self.config.system.mode == "sync":  # on-policy: the params are handed over in memory
            self.version = step
            self.source.set_params(self.learner)
        elif step % self.config.system.sync_every == 0 or self.publishes_after(step):
            self.version = self.publish(step)
            with self.lock:
                self.buffer.mark_sync(self.version)
        with self.lock:
            stats = self.buffer.stats(current_version=self.version)
            self.invalid_status = self.source.invalid_status()
            invalid = self.source.invalid_total()
        return {"version": self.version, "buffer_rows": stats["num_rows"], "buffer_prompts": stats["num_prompts"],
                "buffer_recent_prompts": stats["num_recent_prompts"],
                "buffer_mean_staleness": stats["mean_staleness"], "invalid_rows_skipped": invalid,
                # a buffer's own counters (e.g. the red-team heap's accepted / near-duplicate drops)
                **{f"buffer_{k}": v for k, v in stats.get("extra_metrics", {}).items()}}

    def _finish(self, done: _InFlight, metrics: dict[str, float] | None) -> None:
        """Update `done.drawn.step` was checked (applied): count it and hand its record to on_step."""
        assert metrics is not None
        step = done.drawn.step
        idle = self.clock.finished(step)
        now = time.perf_counter()
        step_time = max(0.0, now - self._last_record - self._excluded)
        self.learner.tokens_trained += int(done.drawn.data["train_tokens"])
        self.counters.prep_s += done.drawn.prep_s
        self.counters.idle_s = self._idle_base + self.clock.idle_s
        self.counters.loop_wall_s = self._wall_base + self.clock.wall_s
        record = {**metrics, **done.drawn.data, **done.host, "step_time_s": step_time, "device_idle_s": idle,
                  "batch_prep_s": done.drawn.prep_s, "batch_wait_s": done.wait_s,
                  "trainer_wait_s": self.counters.wait_s, "elapsed_s": self.counters.elapsed()}
        paused = self.pauses_after(step)
        self.on_step(step, record)
        end = time.perf_counter()
        if paused:
            self.clock.pause(end - now)
        self._last_record, self._excluded = (end, 0.0) if paused else (now, 0.0)

    def _stalled(self, error: BufferEmptyError) -> None:
        t0 = time.time()
        self._poll.sleep()
        waited = time.time() - t0
        self.counters.wait_s += waited
        self._excluded += waited
        first = not self._stalled_since
        self._stalled_since = self._stalled_since or t0
        if t0 - self._stalled_since > self._next_stall_warning:
            log.warning("no trainable batch for %.0f s (%s); are the searchers running? see logs/searcher-*.log",
                        t0 - self._stalled_since, error)
            self._next_stall_warning *= 2
        if first or t0 - self._stall_reported >= 1.0:  # the status file: once a wait, then each second
            self._stall_reported = t0
            with self.lock:
                self.invalid_status = self.source.invalid_status()
            if self.on_stall is not None:
                self.on_stall(error)


def _restore(run_dir: Path, store: str, checkpoints: Checkpointer, learner: Learner, buffer: TrajectoryBuffer,
             counters: RunCounters) -> dict[str, Any]:
    """Restore the newest readable checkpoint; returns its summary_start ({} when there is none)."""
    if checkpoints.latest_step() is None:
        rows = committed_rows(store)
        log.warning("--resume: no complete checkpoint under %s; STARTING AGAIN FROM STEP 0 with the initial "
                    "params, rebuilding the replay buffer from the %d rows already in the trajectory stores",
                    checkpoints.directory, rows)
        primary_only(rundir.write_status)(run_dir, "trainer",
                                          {"step": 0, "phase": "no checkpoint to resume: restarting at step 0"})
        return {}
    learner.trainer.state, extra = checkpoints.restore(learner.trainer.state)
    buffer.load_state_dict(extra["buffer"])
    counters.start_time -= float(extra.get("elapsed_s", 0.0))
    counters.wait_s = float(extra.get("trainer_wait_s", 0.0))
    counters.idle_s = float(extra.get("trainer_idle_s", 0.0))
    counters.loop_wall_s = float(extra.get("loop_wall_s", 0.0))
    counters.prep_s = float(extra.get("batch_prep_s", 0.0))
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
        self.rollouts.set_params(policy_params(learner.trainer.state, learner.trainer.lora))  # LoRA: merged

    def invalid_total(self) -> int:
        return 0

    def invalid_status(self) -> dict[str, int]:
        return {}



def _checkpoint(checkpoints: Checkpointer, learner: Learner, buffer: TrajectoryBuffer,
                summary_start: dict[str, Any], counters: RunCounters, force: bool = False) -> None:
    checkpoints.save(
        learner.trainer.state,
        {"buffer": buffer.state_dict(), "summary_start": summary_start, "elapsed_s": counters.elapsed(),
         "trainer_wait_s": counters.wait_s, "tokens_trained": learner.tokens_trained,
         "trainer_idle_s": counters.idle_s, "loop_wall_s": counters.loop_wall_s, "batch_prep_s": counters.prep_s},
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
