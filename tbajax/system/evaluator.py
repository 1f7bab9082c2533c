"""The evaluator role (eval.mode=process): evaluation in its own process, so training never
waits for it.

The trainer publishes its params at every eval step (and after its last step) with a *pin* in
the param store (`ParamPublisher.publish(pin=...)`): `pins/<version>.json` names the trainer
step and the purpose, and garbage collection keeps a pinned version however many newer ones are
published. This process evaluates the pinned versions in version order, writes one record per
version (role "evaluator": step, version, the `eval_*` metrics) to metrics.jsonl, then unpins it.

Step <-> version bookkeeping, the contract the learning curve relies on:
- the record's step is the step in the pin, checked against the step in the version's manifest
  (a mismatch is an error, not a guess);
- step 0 is the initial policy: this process's own load of model.checkpoint (version 0, never
  published; LoRA adapters start at zero, so the merged policy is the base);
- a restarted evaluator skips (and unpins) every version already in its records: it resumes
  after the last one it finished; a restarted trainer unpins the versions of steps it rolled
  back, and `read_metrics` drops records of such versions the evaluator had already written;
- a pin whose version is gone (deleted by hand, a store that lost it) is reported: logged, an
  `eval_missing` record, counted in the status, and the trainer's summary lists eval steps
  without a result (`eval_steps_missing`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tbajax.config import ConfigError
from tbajax.system import rundir

log = logging.getLogger(__name__)

PIN_PURPOSE = "eval"  # the `purpose` of the trainer's eval pins (other pins are not ours)
POLL_S = 0.5


@dataclasses.dataclass(frozen=True)
class EvalRequest:
    """One pinned version to evaluate: the trainer's params after `step`."""

    version: int
    step: int
    time: float  # when the trainer published it (the learning curve's wall-time axis)
    elapsed_s: float | None  # the trainer's run time then (what inline records call elapsed_s)
    final: bool  # the params after the last step of the session (the summary's eval_end)


def eval_pin(elapsed_s: float, *, final: bool) -> dict[str, Any]:
    """What the trainer puts into the pin of an eval step's version."""
    return {"purpose": PIN_PURPOSE, "elapsed_s": float(elapsed_s), "final": bool(final)}


def eval_requests(pins: Iterable[Mapping[str, Any]]) -> list[EvalRequest]:
    """The eval pins among a store's pin records, by version."""
    out = []
    for p in pins:
        if p.get("purpose") != PIN_PURPOSE:
            continue
        if not isinstance(p.get("step"), int):
            raise ValueError(f"eval pin of version {p.get('version')} has no step ({dict(p)!r}); delete it")
        elapsed = None if p.get("elapsed_s") is None else float(p["elapsed_s"])
        out.append(EvalRequest(int(p["version"]), int(p["step"]), float(p.get("time", 0.0)), elapsed,
                               bool(p.get("final"))))
    return sorted(out, key=lambda r: r.version)


def evaluated_versions(records: Iterable[Mapping[str, Any]]) -> set[int]:
    """Versions the evaluator has a result for (or reported missing), from its own records."""
    return {int(r["version"]) for r in records if r.get("role") == "evaluator" and "version" in r
            and ("eval_score" in r or r.get("event") == "eval_missing")}


def split_requests(requests: Sequence[EvalRequest], done: set[int],
                   latest: int | None) -> tuple[list[EvalRequest], list[EvalRequest]]:
    """(to evaluate now, already evaluated: only their pins are left to delete). A pin is written
    just before its version's pointer, so a version above `latest` (the pointer's) is not
    published yet: it waits, it is not missing."""
    ready = [r for r in requests if r.version not in done and latest is not None and r.version <= latest]
    return ready, [r for r in requests if r.version in done]


def eval_steps(every: int, last_step: int) -> list[int]:
    """The trainer steps an evaluation belongs to: 0, every multiple of `every` below the last
    step, and the last step."""
    steps = {0, last_step} | (set(range(every, last_step, every)) if every else set())
    return sorted(steps)


def missing_eval_steps(expected: Iterable[int], records: Iterable[Mapping[str, Any]]) -> list[int]:
    """Expected eval steps that no (non-superseded) eval record covers."""
    have = {int(r["step"]) for r in records if "eval_score" in r}
    return sorted(set(expected) - have)


def final_eval(records: Sequence[Mapping[str, Any]], version: int) -> Mapping[str, Any] | None:
    """The evaluator's record of `version` (the trainer's final params), or None yet."""
    found = [r for r in records if r.get("role") == "evaluator" and int(r.get("version", -1)) == version
             and "eval_score" in r]
    return found[-1] if found else None


def eval_only(record: Mapping[str, Any]) -> dict[str, float]:
    """The eval_* metrics of an eval record (what inline evaluation returns)."""
    return {k: v for k, v in record.items() if k.startswith("eval_") and k not in _BOOKKEEPING}


_BOOKKEEPING = ("eval_s", "eval_backlog", "eval_missing_total", "eval_metric")


def run_evaluator(run_dir: Path, store_url: str | None = None) -> None:
    """The evaluator process: evaluate step 0, then every pinned eval version, until told to stop."""
    from flax import nnx

    from tbajax.models import load_model
    from tbajax.sharding import make_mesh
    from tbajax.stores import ParamReader, ParamVersionError, param_store_url
    from tbajax.stores.params import ParamStoreError
    from tbajax.system.evaluation import Evaluator
    from tbajax.system.metrics import MetricsWriter, read_metrics
    from tbajax.system.publishing import SearcherParams
    from tbajax.system.searcher import make_reward_pool
    from tbajax.system.wandb_logging import open_wandb

    config = rundir.load_config(run_dir)
    if config.eval.mode != "process" or config.system.mode != "async":
        raise ConfigError(f"--role=evaluator runs eval.mode=process in async mode; this run has eval.mode="
                          f"{config.eval.mode!r}, system.mode={config.system.mode!r} "
                          "(its trainer evaluates inline)")
    store = store_url or str(run_dir)
    stop = rundir.StopFlag(run_dir)
    mesh = make_mesh(config.system.searcher_mesh)
    model = load_model(config.model.checkpoint, mesh=mesh, param_dtype=config.model.param_dtype,
                       dtype=config.model.dtype, attention=config.model.attention)
    initial = nnx.state(model, nnx.Param)
    reward_pool = make_reward_pool(config)
    evaluator = Evaluator(config, model, mesh, reward_pool)
    resident = SearcherParams(initial, mesh, config.model.lora)
    reader = ParamReader(param_store_url(store), "evaluator")
    metrics = MetricsWriter(run_dir, "evaluator", wandb=open_wandb(config, run_dir, "evaluator"))
    mine = read_metrics(run_dir, "evaluator", superseded=True)  # before a restart too: never evaluated twice
    done = evaluated_versions(mine)
    counts = {"evaluated": 0, "missing": sum(1 for r in mine if r.get("event") == "eval_missing")}
    log.info("evaluator: %d eval problems, %s; %d versions already evaluated", len(evaluator.problems),
             evaluator.metric, len(done))

    def status(phase: str, **extra: Any) -> None:
        rundir.write_status(run_dir, "evaluator", {"phase": phase, "evaluated": counts["evaluated"],
                                                   "eval_missing_total": counts["missing"], **extra})

    def record(step: int, version: int, out: dict[str, float], t0: float, **extra: Any) -> None:
        metrics.write(step, {**out, "version": version, "eval_s": time.time() - t0,
                             "eval_metric": evaluator.metric, **extra})
        counts["evaluated"] += 1
        log.info("step %d (version %d): eval %s %.3f in %.1f s", step, version, evaluator.metric,
                 out["eval_score"], time.time() - t0)
        status("evaluated", step=step, version=version, eval_score=out["eval_score"])

    try:
        if 0 not in done and not stop():
            t0 = time.time()
            status("evaluating", step=0, version=0)
            record(0, 0, evaluator.run_params(initial), t0, elapsed_s=0.0, params_time=t0)
            done.add(0)
        while not stop():
            pins = eval_requests(reader.pins())  # before the pointer: a pin is written before it
            todo, finished = split_requests(pins, done, reader.latest_version())
            for r in finished:  # evaluated before a restart, unpinned not yet
                reader.unpin(r.version)
            if not todo:
                status("waiting for eval versions")
                time.sleep(POLL_S)
                continue
            req = todo[0]
            t0 = time.time()
            status("evaluating", step=req.step, version=req.version, eval_backlog=len(todo) - 1)
            try:
                stored_step = reader.version_step(req.version)
                params = resident.load(reader, req.version)
            except ParamVersionError as e:
                counts["missing"] += 1
                log.error("eval of step %d skipped: its param version %d is gone from the store (%s); "
                          "%d eval steps lost so far", req.step, req.version, e, counts["missing"])
                metrics.write(req.step, {"event": "eval_missing", "version": req.version,
                                         "eval_missing_total": counts["missing"]})
                done.add(req.version)
                reader.unpin(req.version)
                continue
            if stored_step is not None and stored_step != req.step:
                raise ParamStoreError(f"param version {req.version} holds the params of step {stored_step}, "
                                      f"its eval pin says step {req.step}: the store is inconsistent")
            out = evaluator.run_params(params)
            record(req.step, req.version, out, t0, elapsed_s=req.elapsed_s, params_time=req.time,
                   eval_backlog=len(todo) - 1, final=req.final)
            done.add(req.version)
            reader.unpin(req.version)
    finally:
        metrics.close()
        if reward_pool is not None:
            reward_pool.close()
    status("stopped")
    log.info("evaluator: stopping after %d evaluations (%d eval versions missing)", counts["evaluated"],
             counts["missing"])
