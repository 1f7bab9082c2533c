"""The evaluator role (eval.mode=process): step <-> version bookkeeping, pins in the param store,
records that survive resumes, and real runs with a trainer and an evaluator process."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROLE_XLA_FLAGS

from tbajax.config import ConfigError, apply_overrides
from tbajax.main import load_experiment
from tbajax.stores import ParamPublisher, ParamReader, ParamVersionError, param_store_url
from tbajax.system import rundir
from tbajax.system.evaluator import (
    EvalRequest,
    eval_only,
    eval_pin,
    eval_requests,
    eval_steps,
    evaluated_versions,
    final_eval,
    missing_eval_steps,
    split_requests,
)
from tbajax.system.launcher import child_env, role_commands
from tbajax.system.metrics import drop_superseded, eval_records, read_metrics
from tbajax.system.pipeline import BackgroundPublish
from tbajax.system.trainer import drop_rolled_back_pins, evaluates_in_process, is_eval_step, wait_for_eval

REPO = Path(__file__).resolve().parent.parent


def _config(*overrides: str):
    return apply_overrides(load_experiment("tiny_arithmetic"), list(overrides))


def _params(value: float = 1.0) -> dict:
    return {"w": np.full((4, 3), value, np.float32), "b": np.arange(3, dtype=np.float32)}


# --- bookkeeping ----------------------------------------------------------------------------------


def test_eval_steps_are_zero_the_multiples_below_the_end_and_the_end():
    assert eval_steps(3, 6) == [0, 3, 6]
    assert eval_steps(4, 10) == [0, 4, 8, 10]
    assert eval_steps(0, 5) == [0, 5]  # eval.every=0: start and end only
    config = _config("train.steps=6", "eval.every=3")
    # the periodic ones; the last step's is the final evaluation
    assert [s for s in range(1, 7) if is_eval_step(config, s)] == [3]


def test_eval_requests_are_the_eval_pins_by_version():
    pins = [
        {"version": 9, "step": 6, "time": 3.0, "purpose": "eval", "elapsed_s": 30.0, "final": True},
        {"version": 4, "step": 3, "time": 2.0, "purpose": "eval", "elapsed_s": 12.5, "final": False},
        {"version": 5, "step": 4, "time": 2.5, "purpose": "snapshot"},  # someone else's pin
    ]
    assert eval_requests(pins) == [EvalRequest(4, 3, 2.0, 12.5, False), EvalRequest(9, 6, 3.0, 30.0, True)]
    with pytest.raises(ValueError, match="has no step"):
        eval_requests([{"version": 2, "step": None, "purpose": "eval"}])
    assert eval_pin(12.5, final=False) == {"purpose": "eval", "elapsed_s": 12.5, "final": False}


def test_a_restarted_evaluator_skips_what_its_records_hold():
    records = [
        {"role": "evaluator", "step": 0, "version": 0, "eval_score": 0.3},
        {"role": "evaluator", "step": 3, "version": 4, "eval_score": 0.4},
        {"role": "evaluator", "step": 6, "version": 8, "event": "eval_missing"},  # reported: not retried
        {"role": "trainer", "step": 3, "version": 4, "eval_score": 0.9},  # inline records are not ours
        {"role": "evaluator", "step": 9, "version": 12},  # no result
    ]
    done = evaluated_versions(records)
    assert done == {0, 4, 8}
    requests = [EvalRequest(4, 3, 0, 0, False), EvalRequest(12, 9, 0, 0, False),
                EvalRequest(15, 12, 0, 0, True)]
    todo, finished = split_requests(requests, done, latest=15)
    assert [r.version for r in todo] == [12, 15] and [r.version for r in finished] == [4]
    # a pin lands just before its version's pointer: a version above the pointer waits, it is not missing
    assert [r.version for r in split_requests(requests, done, latest=14)[0]] == [12]
    assert split_requests(requests, done, latest=None)[0] == []


def test_missing_eval_steps_and_the_final_record():
    records = [{"step": 0, "eval_score": 0.1}, {"step": 3, "eval_score": 0.2},
               {"step": 6, "event": "eval_missing"}]
    assert missing_eval_steps([0, 3, 6, 9], records) == [6, 9]
    evaluator = [{"role": "evaluator", "step": 6, "version": 7, "eval_score": 0.5, "eval_s": 1.0,
                  "eval_backlog": 0, "eval_metric": "accuracy", "eval_accuracy": 0.5}]
    assert final_eval(evaluator, 7)["eval_score"] == 0.5
    assert final_eval(evaluator, 6) is None
    assert eval_only(evaluator[0]) == {"eval_score": 0.5, "eval_accuracy": 0.5}  # bookkeeping left out


def test_a_resume_drops_evaluations_of_rolled_back_versions_whenever_they_were_written():
    """Trainer at step 5 (version 5) crashed, resumed from checkpoint step 3 as version 6: the
    evaluator's results for versions <= 5 of steps > 3 are of rolled-back params, also one
    written after the resume marker (the evaluator was behind); step 4's retrain (version 7) stays."""
    records = [
        {"role": "evaluator", "step": 0, "version": 0, "eval_score": 0.1},
        {"role": "evaluator", "step": 2, "version": 2, "eval_score": 0.2},
        {"role": "trainer", "step": 4, "version": 4, "loss": 1.0},
        {"role": "evaluator", "step": 4, "version": 4, "eval_score": 0.3},
        {"role": "trainer", "step": 3, "event": "resume", "from_step": 3, "version": 6},
        {"role": "evaluator", "step": 5, "version": 5, "eval_score": 0.4},  # stale, written late
        {"role": "evaluator", "step": 4, "version": 7, "eval_score": 0.5},
    ]
    kept = drop_superseded(records)
    assert [(r["role"], r["step"], r.get("version")) for r in kept] == [
        ("evaluator", 0, 0), ("evaluator", 2, 2), ("trainer", 3, 6), ("evaluator", 4, 7)]


def test_eval_records_merge_the_trainers_and_the_evaluators(tmp_path):
    lines = [
        {"role": "trainer", "step": 0, "time": 1.0, "eval_score": 0.1},
        {"role": "searcher-0", "step": 64, "time": 1.5, "reward_mean": 0.2},
        {"role": "trainer", "step": 1, "time": 2.0, "loss": 1.0},
        {"role": "evaluator", "step": 3, "time": 4.0, "eval_score": 0.3, "version": 3},
        {"role": "evaluator", "step": 3, "time": 5.0, "eval_score": 0.35, "version": 3},  # re-run (a crash)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert [(r["step"], r["eval_score"]) for r in eval_records(tmp_path)] == [(0, 0.1), (3, 0.35)]


# --- config, launcher -----------------------------------------------------------------------------


def test_eval_mode_is_validated_and_sync_mode_says_it_evaluates_inline(caplog):
    with pytest.raises(ConfigError, match="choose one of \\['inline', 'process'\\]"):
        _config("eval.mode=separate")
    with pytest.raises(ConfigError, match="eval.wait_timeout_s=0.0 must be > 0"):
        _config("eval.wait_timeout_s=0")
    assert evaluates_in_process(_config("eval.mode=process"))
    assert not evaluates_in_process(_config())
    with caplog.at_level(logging.WARNING):
        assert not evaluates_in_process(_config("eval.mode=process", "system.mode=sync"))
    assert "sync mode runs everything in one process, so it evaluates inline" in caplog.text


def test_the_launcher_starts_an_evaluator_only_for_eval_mode_process(tmp_path):
    roles = [r for r, _, _ in role_commands(_config("eval.mode=process", "system.num_searchers=2"), tmp_path,
                                                resume=False)]
    assert roles == ["trainer", "searcher-0", "searcher-1", "evaluator"]
    assert [r for r, _, _ in role_commands(_config(), tmp_path, resume=False)] == ["trainer", "searcher-0"]
    assert [r for r, _, _ in role_commands(_config("eval.mode=process", "system.mode=sync"), tmp_path,
                                           resume=False)] == ["trainer"]
    # split devices: the evaluator gets the GPU after the searchers'
    split = _config("eval.mode=process", "system.num_searchers=2", "system.devices=split",
                    "system.trainer_devices=2")
    (_, index, args), = [c for c in role_commands(split, tmp_path, resume=True) if c[0] == "evaluator"]
    assert "--role=evaluator" in args and "--resume" in args
    assert child_env(split, "evaluator", index)["CUDA_VISIBLE_DEVICES"] == "4"
    assert child_env(split, "searcher", 1)["CUDA_VISIBLE_DEVICES"] == "3"

def test_a_shared_gpu_is_split_over_the_evaluator_too(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    env = child_env(_config("eval.mode=process"), "evaluator", 1)
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == f"{0.9 / 3:.3f}"  # trainer + searcher + evaluator


def test_ray_places_the_evaluator_like_a_searcher():
    from tbajax.config import RaySpec
    from tbajax.system.ray_launcher import actor_options

    spec = RaySpec(searcher_cpus=2.0, searcher_gpus=0.5, searcher_resources={"gen": 1.0})
    assert actor_options(spec, "evaluator", max_restarts=3) == actor_options(spec, "searcher", max_restarts=3)


# --- the param store's pins -----------------------------------------------------------------------


def test_pinned_versions_outlive_keep_until_unpinned_and_carry_their_step(tmp_path):
    url = param_store_url(tmp_path)
    pub = ParamPublisher(url, "run-p", dtype=None, keep=1)
    reader = ParamReader(url, "evaluator")
    assert pub.publish(_params(0.0), step=1) == 1
    assert pub.publish(_params(1.0), step=2, pin=eval_pin(5.0, final=False)) == 2
    for step in (3, 4, 5):
        pub.publish(_params(float(step)), step=step)
    pub.wait()
    assert reader.versions() == [2, 5]  # keep=1, and the pinned one
    (pin,) = reader.pins()
    assert (pin["version"], pin["step"], pin["purpose"], pin["elapsed_s"]) == (2, 2, "eval", 5.0)
    assert reader.version_step(2) == 2 and reader.version_step(5) == 5  # in the version's own manifest
    restored = reader.restore(2, _params(), shardings=_one_device())
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.full((4, 3), 1.0, np.float32))
    reader.unpin(2)
    assert reader.pins() == []
    pub.publish(_params(6.0), step=6)
    pub.wait()
    assert reader.versions() == [6]
    assert not reader.is_available(2)
    with pytest.raises(ParamVersionError):
        reader.version_step(2)
    pub.close()


def test_background_publish_pins_and_a_resume_drops_rolled_back_pins(tmp_path, caplog):
    url = param_store_url(tmp_path)
    pub = ParamPublisher(url, "run-q", dtype=None, keep=1)
    publishing = BackgroundPublish(pub, threaded=True)
    for step in (1, 2, 3, 4):
        pin = eval_pin(float(step), final=False) if step % 2 == 0 else None
        publishing.publish(_params(float(step)), step=step, pin=pin)
    publishing.close()
    pub.wait()
    assert [(r.step, r.version) for r in eval_requests(pub.pins())] == [(2, 2), (4, 4)]
    with caplog.at_level(logging.INFO):
        drop_rolled_back_pins(pub, 3)  # resumed from step 3: step 4's params are rolled back
    assert [r.step for r in eval_requests(pub.pins())] == [2]
    assert "dropped the eval request of rolled-back step 4 (version 4)" in caplog.text
    pub.close()


def _one_device():
    import jax

    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def test_wait_for_eval_returns_the_record_or_gives_up_without_progress(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"role": "evaluator", "step": 3, "version": 3, "eval_score": 0.5}) + "\n")
    t0 = time.time()
    assert wait_for_eval(tmp_path, 7, timeout_s=0.3, stop=lambda: False, poll_s=0.05) is None
    assert 0.3 <= time.time() - t0 < 2.0
    with open(metrics, "a") as f:
        f.write(json.dumps({"role": "evaluator", "step": 6, "version": 7, "eval_score": 0.6}) + "\n")
    assert wait_for_eval(tmp_path, 7, timeout_s=0.3, stop=lambda: False)["eval_score"] == 0.6
    t0 = time.time()
    assert wait_for_eval(tmp_path, 9, timeout_s=60, stop=lambda: True) is None  # a stop ends the wait
    assert time.time() - t0 < 1.0


# --- real processes -------------------------------------------------------------------------------

SMALL = [arg for kv in ("eval.num_problems=16", "eval.batch_size=16", "rollout.prompts_per_call=4",
                        "train.groups_per_step=4", "train.log_every=1") for arg in ("--set", kv)]


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["XLA_FLAGS"] = ROLE_XLA_FLAGS  # each role: one CPU device, as a user's run
    return env


@pytest.mark.processes
def test_trainer_and_evaluator_processes_give_eval_records_at_the_eval_steps(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "tbajax.main", f"--run-dir={run}", "--quiet", *SMALL, "--set", "train.steps=6",
         "--set", "eval.every=3", "--set", "eval.mode=process", "--set", "train.checkpoint_every=6"],
        cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "+ an evaluator" in proc.stdout
    records = read_metrics(run)
    evals = [r for r in records if r["role"] == "evaluator" and "eval_score" in r]
    trainer = {r["step"]: r for r in records if r["role"] == "trainer" and "loss" in r}
    assert [r["step"] for r in evals] == [0, 3, 6]
    assert not any("eval_score" in r for r in trainer.values())  # the trainer did not evaluate
    # each record names the version the trainer published right after that step
    assert evals[0]["version"] == 0
    for r in evals[1:]:
        assert r["version"] == trainer[r["step"]]["version"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval_mode"] == "process" and summary["eval_end_is_final"] is True
    assert (summary["eval_end_step"], summary["eval_end_version"]) == (6, evals[-1]["version"])
    assert summary["eval_score_end"] == evals[-1]["eval_score"]
    assert summary["eval_score_start"] == evals[0]["eval_score"]
    assert summary["eval_end"]["eval_accuracy"] == evals[-1]["eval_accuracy"]
    assert summary["eval_steps_missing"] == []
    assert list((run / "params" / "pins").iterdir()) == []  # every pin released
    assert (run / "plots" / "learning_curve.png").exists()
    trainer_log = (run / "logs" / "trainer.log").read_text()
    assert "waiting for the evaluator's final evaluation (step 6" in trainer_log


@pytest.mark.processes
def test_a_restarted_evaluator_resumes_after_its_records_and_reports_lost_versions(tmp_path):
    """The evaluator alone on a prepared run: step 0 and version 2 were evaluated before a
    'crash' (their pin is still there), version 3 is to do, version 4's params are gone."""
    from flax import nnx

    from tbajax.models import load_model

    run = tmp_path / "run"
    config = _config("eval.mode=process", "eval.num_problems=8", "eval.batch_size=8")
    rundir.make_run_dir(run)
    rundir.write_json_atomic(run / "config.json", config.to_dict())
    params = nnx.to_pure_dict(nnx.state(load_model(config.model.checkpoint), nnx.Param))
    pub = ParamPublisher(param_store_url(run), "run-r", dtype=None, keep=1)
    for step in (1, 2, 3, 4):  # version == step; steps 2-4 are eval steps
        pin = eval_pin(float(step), final=step == 4) if step > 1 else None
        pub.publish(params, {"kind": "full"}, step=step, pin=pin)
    pub.close()
    shutil.rmtree(run / "params" / "4")  # a version lost (deleted by hand) despite its pin
    before = [{"role": "evaluator", "step": 0, "version": 0, "eval_score": 0.25, "time": 1.0},
              {"role": "evaluator", "step": 2, "version": 2, "eval_score": 0.5, "time": 2.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in before))
    proc = subprocess.Popen([sys.executable, "-m", "tbajax.main", "--role=evaluator", f"--run-dir={run}"],
                            cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and proc.poll() is None:
            if (run / "params" / "pins").exists() and not list((run / "params" / "pins").iterdir()):
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read()[-3000:]
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out[-3000:]
    mine = [r for r in read_metrics(run, "evaluator") if r["time"] > 10]
    # nothing evaluated twice
    assert [(r["step"], r["version"]) for r in mine if "eval_score" in r] == [(3, 3)]
    (lost,) = [r for r in mine if r.get("event") == "eval_missing"]
    assert (lost["step"], lost["version"], lost["eval_missing_total"]) == (4, 4, 1)
    assert "eval of step 4 skipped: its param version 4 is gone from the store" in out
    assert rundir.read_status(run)["evaluator"]["eval_missing_total"] == 1
