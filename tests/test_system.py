"""End to end: real processes, real stores, the shipped tiny checkpoint.

Small on purpose (a few trainer steps each) so the whole file stays around two minutes on two
CPU cores; they check the plumbing (who trains on what, versions, restarts, resume), not learning.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROLE_XLA_FLAGS

from tbajax.stores import ParamReader, TrajectoryReader, discover_searcher_stores, param_store_url
from tbajax.system.metrics import eval_records, read_metrics
from tbajax.trajectory import RewardStatus

pytestmark = pytest.mark.processes

REPO = Path(__file__).resolve().parent.parent
SMALL = [
    "--set", "eval.num_problems=16",
    "--set", "eval.batch_size=16",
    "--set", "rollout.prompts_per_call=4",
    "--set", "train.groups_per_step=4",
    "--set", "train.log_every=1",
]


def _main(run_dir: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["XLA_FLAGS"] = ROLE_XLA_FLAGS  # each role: one CPU device, as a user's run
    return subprocess.Popen(
        [sys.executable, "-m", "tbajax.main", f"--run-dir={run_dir}", "--quiet", *SMALL, *args],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the launcher stops its roles cleanly
        try:
            out, _ = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        raise AssertionError(f"run did not finish within {timeout}s:\n{out[-3000:]}") from None
    return out


def _status(run_dir: Path, role: str) -> dict:
    try:
        return json.loads((run_dir / "status" / f"{role}.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_async_run_with_two_searchers(tmp_path):
    run = tmp_path / "run"
    out = _finish(_main(run, "--set", "train.steps=6", "--set", "system.num_searchers=2",
                        "--set", "train.checkpoint_every=3", "--set", "system.sync_every=2",
                        "--set", "system.wandb.mode=offline"))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["trainer_steps"] == 6, out
    trainer = [r for r in read_metrics(run, "trainer") if "loss" in r]
    assert len(trainer) == 6
    # every role's records also went to its own W&B run (offline files under RUN/wandb)
    from tbajax.config import WandbSpec
    from tbajax.system.wandb_logging import wandb_names
    from tests.conftest import wandb_history

    logged = {role: wandb_history(run, wandb_names(run, role, WandbSpec())[1])
              for role in ("trainer", "searcher-0", "searcher-1")}
    assert [(r["step"], r["loss"]) for r in logged["trainer"] if "loss" in r] == [
        (r["step"], r["loss"]) for r in trainer]
    for i in (0, 1):
        mine = read_metrics(run, f"searcher-{i}")
        assert [r["samples"] for r in logged[f"searcher-{i}"]] == [r["samples"] for r in mine] != []
    # both searchers' trajectories were trained on
    for i in (0, 1):
        assert sum(r.get(f"rows_from_searcher_{i}", 0) for r in trainer) > 0, f"searcher {i} never trained on"
    # versions advance every sync (k = 2) and the searchers pick them up
    assert [r["version"] for r in trainer] == [0, 1, 1, 2, 2, 3]
    # the static sampler gives every token its call's version: token lags are the sample lags
    assert [r["token_lag_max"] for r in trainer] == [r["policy_lag_max"] for r in trainer]
    loaded = {r["version"] for r in read_metrics(run) if r["role"].startswith("searcher")}
    assert max(loaded) >= 1, "no searcher ever loaded published params"
    assert ParamReader(param_store_url(str(run)), "test").latest_version() == 3
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["3", "6"]
    assert (run / "plots" / "learning_curve.png").exists()
    assert {"config.json", "tokenizer.json", "source.json"} <= {p.name for p in (run / "model").iterdir()}
    assert list((run / "tensorboard" / "trainer").glob("events.*"))
    assert set(discover_searcher_stores(str(run))) == {0, 1}
    # the final policy exported (`python -m tbajax.export`) and scored by `python -m tbajax.evaluate`
    # with the run's config reproduces the trainer's own final evaluation
    from tbajax.export import export_policy

    exported = export_policy(run)
    assert (exported.source, exported.step) == ("trainer checkpoint 6", 6)
    env = {**os.environ, "XLA_FLAGS": ROLE_XLA_FLAGS}
    scored = subprocess.run(
        [sys.executable, "-m", "tbajax.evaluate", f"--run-dir={run}", f"--model={exported.directory}",
         f"--json={tmp_path / 'eval.json'}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert scored.returncode == 0, scored.stdout + scored.stderr
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["eval_problems"] == 16 and result["eval_metric"] == summary["eval_metric"]
    assert result["eval_score"] == summary["eval_score_end"], (result, summary["eval_score_end"])


def test_sync_mode_uses_the_same_trainer_and_user_objective(tmp_path):
    """A user's objective from their own file, run in sync mode: one process, on-policy, with the
    trainer choosing each batch's layout (pack_groups=auto: rows, packed or strided groups; the
    objective cannot tell)."""
    objective = tmp_path / "my_objective.py"
    objective.write_text(
        "from tbajax.objectives import groups_of, row_mean, seq_sums\n\n"
        "def mean_baseline_pg(batch, logprobs, config):\n"
        "    g = groups_of(batch, logprobs.dtype)\n"
        "    loss = row_mean(g, -g.centered(batch.reward) * seq_sums(batch, logprobs).policy)\n"
        "    return loss, {'loss': loss}\n"
    )
    # ... and the user's own task with a batched scorer (tbajax.tasks.scoring) and its own eval metrics
    task = tmp_path / "my_task.py"
    task.write_text(
        "import dataclasses\n"
        "import numpy as np\n"
        "from tbajax.tasks import get_task\n"
        "from tbajax.tasks.scoring import Scores\n\n"
        "class OddLength:\n"
        "    def __init__(self, task, context):\n"
        "        assert context.tokenizer is not None and context.config.name\n"
        "    def score(self, samples, key):\n"
        "        n = np.array([len(t) for t in samples.response_tokens])\n"
        "        return Scores(reward=(n % 2).astype(float), status=np.zeros(len(n), int),\n"
        "                      extras={'length': n.tolist(), 'text': list(samples.texts)})\n"
        "    def close(self):\n"
        "        pass\n\n"
        "def odd_share(samples, scores):\n"
        "    return {'odd_share': float(np.mean(scores.reward)), 'mean_length': float(np.mean(scores.extras['length']))}\n\n"
        "def make_task(**options):\n"
        "    return dataclasses.replace(get_task('arithmetic', **options), name='odd_length', scorer=OddLength,\n"
        "                               eval_fn=odd_share, headline_metric='odd_share')\n"
    )
    run = tmp_path / "run"
    out = _finish(_main(run, "--mode=sync", f"--objective={objective}:mean_baseline_pg", "--set", "train.steps=3",
                        "--set", "train.trainer.pack_groups=auto", "--set", f"task.name={task}:make_task"))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["mode"] == "sync" and summary["trainer_steps"] == 3, out
    trainer = [r for r in read_metrics(run, "trainer") if "loss" in r]
    # on-policy: every trained row was generated by the params of that very step
    assert [r["policy_lag_max"] for r in trainer] == [0, 0, 0]
    assert all(r["batch_layout"] in (0, 1, 2) for r in trainer)  # rows, packed, strided
    assert not (run / "logs" / "searcher-0.log").exists()  # no searcher process in sync mode
    # the scorer's rewards and per-sample extras are what the store holds; eval uses the task's metrics
    assert summary["eval_metric"] == "odd_share" and 0.0 <= summary["eval_score_end"] <= 1.0
    assert summary["eval_end"]["eval_mean_length"] >= 1.0
    evals = eval_records(run)  # each names its metric (`python -m tbajax.status` shows it while running)
    assert evals and all(r["eval_metric"] == "odd_share" for r in evals)
    reader = TrajectoryReader(discover_searcher_stores(str(run))[0])
    rows = reader.read(0, reader.committed_rows())
    assert rows and all(r.extras["length"] == len(r.response_tokens) for r in rows)
    assert all(r.reward == len(r.response_tokens) % 2 for r in rows)


@pytest.mark.slow  # tests/test_chaos.py kills the searcher three times (mid-append too) in the default run
def test_killed_searcher_is_restarted_and_nothing_committed_is_lost(tmp_path):
    run = tmp_path / "run"
    proc = _main(run, "--set", "train.steps=40", "--set", "system.num_searchers=1")
    _wait_for(lambda: _status(run, "searcher-0").get("calls", 0) >= 2, 180, "searcher to append twice")
    url = discover_searcher_stores(str(run))[0]
    before = TrajectoryReader(url).committed_rows()
    os.kill(_status(run, "searcher-0")["pid"], signal.SIGKILL)  # possibly in the middle of an append
    out = _finish(proc)
    assert "searcher-0 exited with -9; restarting" in out, out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["trainer_steps"] == 40
    reader = TrajectoryReader(url)
    rows = reader.read(0, reader.committed_rows())
    assert len(rows) >= before + 1  # the restarted searcher appended after the committed rows
    assert all(len(r.behavior_logprobs) == len(r.response_tokens) for r in rows)
    assert all(np.isfinite(r.behavior_logprobs).all() for r in rows)


def _checkpoint_steps(run: Path) -> list[int]:
    return sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()
                  and (p / "commit_success.txt").exists())


def _counts(tree, path=()) -> list[tuple[tuple, int]]:
    """(path, value) of every scalar leaf named like an optimizer step count in a raw orbax tree."""
    if isinstance(tree, dict):
        return [c for k, v in tree.items() for c in _counts(v, (*path, k))]
    if isinstance(tree, (list, tuple)):
        return [c for i, v in enumerate(tree) for c in _counts(v, (*path, i))]
    if "count" in str(path[-1:]) and np.ndim(tree) == 0:
        return [(path, int(tree))]
    return []


def assert_exact_resume(run: Path, *, checkpoint_step: int, checkpoint_extra: dict, version_before: int) -> None:
    """A resume, not a restart (checked on a finished run whose trainer was killed once and
    resumed from the checkpoint at `checkpoint_step`): the first step after it is the checkpoint's
    + 1, the optimizer and buffer state come back, the restored params are republished at once as a
    new version, and versions, counters and metrics stay consistent across the two sessions."""
    import orbax.checkpoint as ocp

    summary = json.loads((run / "summary.json").read_text())
    total = json.loads((run / "config.json").read_text())["train"]["steps"]
    assert summary["trainer_steps"] == total and summary["stopped_early"] is False
    raw = read_metrics(run, "trainer", superseded=True)
    marker_at = next(i for i, r in enumerate(raw) if r.get("event") == "resume")
    marker = raw[marker_at]
    assert marker["from_step"] == checkpoint_step
    after = [r for r in raw[marker_at + 1:] if "loss" in r]
    assert [r["step"] for r in after] == list(range(checkpoint_step + 1, total + 1))  # not 1..N: a resume
    # buffer state: the restored sync versions are the checkpoint's
    assert marker["restored_sync_versions"] == checkpoint_extra["buffer"]["sync_versions"]
    # params republished at once under a new version, above anything searchers could have loaded
    assert marker["version"] > version_before
    versions = [r["version"] for r in raw if "version" in r]
    assert versions == sorted(versions)
    assert after[0]["version"] >= marker["version"]
    # optimizer state: Adam's step count in the final checkpoint covers every update
    state = ocp.StandardCheckpointer().restore(run / "checkpoints" / str(total) / "state")
    counts = _counts(state["opt_state"])
    assert counts and all(c == total for _, c in counts), counts
    # each step once in the deduplicated metrics; counters carried over
    steps = [r["step"] for r in read_metrics(run, "trainer") if "loss" in r]
    assert steps == list(range(1, total + 1))
    assert summary["trainer_wait_s"] >= checkpoint_extra["trainer_wait_s"]
    assert summary["wall_time_s"] >= checkpoint_extra["elapsed_s"]
    stored = sum(TrajectoryReader(u).committed_rows() for u in discover_searcher_stores(str(run)).values())
    # searchers run on until the launcher stops them after the trainer exits (it plots the curve
    # first): rows their calls committed after summary.json was written are not in its count
    config = json.loads((run / "config.json").read_text())
    one_call = config["rollout"]["prompts_per_call"] * config["rollout"]["sampling"]["num_samples"]
    written = (run / "summary.json").stat().st_mtime
    after, last = 0, {}
    for r in read_metrics(run):  # each searcher record: `step` = its store's rows after an append
        if r["role"].startswith("searcher-") and "calls" in r:
            if r["time"] > written:
                after += r["step"] - last.get(r["role"], r["step"] - one_call)
            last[r["role"]] = r["step"]
    # ... and one call per searcher may commit between the count and the write
    assert summary["samples_generated"] <= stored <= summary["samples_generated"] + after + one_call * max(len(last), 1)


@pytest.mark.slow  # the default run's chaos test resumes its killed trainer and checks the same (assert_exact_resume)
def test_killed_trainer_resumes_exactly_from_its_checkpoint(tmp_path):
    run = tmp_path / "run"
    args = ["--set", "train.steps=8", "--set", "train.checkpoint_every=2"]
    proc = _main(run, *args)
    _wait_for(lambda: _status(run, "trainer").get("step", 0) >= 5, 180, "trainer to pass step 5")
    os.kill(_status(run, "trainer")["pid"], signal.SIGKILL)
    out = _finish(proc)
    assert proc.returncode != 0 and "trainer failed" in out, out
    version_before = ParamReader(param_store_url(str(run)), "test").latest_version()
    ckpt = _checkpoint_steps(run)[-1]
    assert ckpt >= 4
    extra = json.loads((run / "checkpoints" / str(ckpt) / "extra" / "metadata").read_text())
    trained_before = [r["step"] for r in read_metrics(run, "trainer") if "loss" in r]
    assert max(trained_before) > ckpt  # steps after the checkpoint were lost: they must be redone
    _finish(_main(run, *args, "--resume"))
    assert_exact_resume(run, checkpoint_step=ckpt, checkpoint_extra=extra, version_before=version_before)


@pytest.mark.slow  # the pool's TIMEOUT/ERROR handling is unit-tested in tests/test_tasks.py; this is the whole-run check
def test_hanging_and_raising_reward_functions_cost_only_their_samples(tmp_path):
    task = tmp_path / "flaky_task.py"
    task.write_text(
        "import time\n"
        "from tbajax.tasks.arithmetic import arithmetic_reward, arithmetic_task\n\n"
        "def flaky_reward(completion, answer):\n"
        "    if completion.endswith('7'):\n"
        "        time.sleep(3600)\n"
        "    if completion.endswith('3'):\n"
        "        raise RuntimeError('grader bug')\n"
        "    return arithmetic_reward(completion, answer)\n\n"
        "def make(**kwargs):\n"
        "    import dataclasses\n"
        "    return dataclasses.replace(arithmetic_task(**kwargs), reward_fn=flaky_reward, cheap_reward=False)\n"
    )
    run = tmp_path / "run"
    out = _finish(_main(run, "--mode=sync", "--set", f"task.name={task}:make", "--set", "train.steps=2",
                        "--set", "rollout.reward_workers=2", "--set", "rollout.reward_timeout_s=1.0"))
    assert json.loads((run / "summary.json").read_text())["trainer_steps"] == 2, out
    reader = TrajectoryReader(discover_searcher_stores(str(run))[0])
    statuses = {r.reward_status for r in reader.read(0, reader.committed_rows())}
    assert RewardStatus.TIMEOUT in statuses and RewardStatus.ERROR in statuses


def test_a_grader_that_always_raises_stops_the_searcher_with_the_reason(tmp_path):
    task = tmp_path / "broken_task.py"
    task.write_text(
        "import dataclasses\n"
        "from tbajax.tasks.arithmetic import arithmetic_task\n\n"
        "def broken_reward(completion, answer):\n"
        "    raise KeyError('no such answer field')\n\n"
        "def make(**kwargs):\n"
        "    return dataclasses.replace(arithmetic_task(**kwargs), name='broken', reward_fn=broken_reward,\n"
        "                               cheap_reward=True)\n"
    )
    run = tmp_path / "run"
    proc = _main(run, "--set", f"task.name={task}:make", "--set", "train.steps=50",
                 "--set", "rollout.fail_fast_grades=8", "--set", "system.max_searcher_restarts=0")
    out = _finish(proc, 240)
    assert proc.returncode != 0, out
    log = (run / "logs" / "searcher-0.log").read_text()
    for text in (out, log):  # the launcher's tail shows the reason
        assert "the last 8 grades of task 'broken' all failed" in text, text[-3000:]
        assert "KeyError: 'no such answer field'" in text, text[-3000:]
    assert "searcher-0 exited with code 3; giving up after 0 restarts" in out


def test_stop_request_checkpoints_before_the_final_evaluation(tmp_path):
    """Ctrl-C: the trainer checkpoints first, then evaluates (slowly here), and the summary says
    where it stopped and how to continue."""
    run = tmp_path / "run"
    task = tmp_path / "slow_eval_task.py"
    task.write_text(  # grading is slow once a stop was requested, i.e. in the final evaluation
        "import dataclasses, os, time\n"
        "from tbajax.tasks.arithmetic import arithmetic_reward, arithmetic_task\n\n"
        "def slow_reward(completion, answer):\n"
        f"    if os.path.exists({str(run / 'control' / 'stop')!r}):\n"
        "        time.sleep(0.5)\n"
        "    return arithmetic_reward(completion, answer)\n\n"
        "def make(**kwargs):\n"
        "    return dataclasses.replace(arithmetic_task(**kwargs), reward_fn=slow_reward, cheap_reward=True)\n"
    )
    proc = _main(run, "--mode=sync", "--set", f"task.name={task}:make", "--set", "train.steps=50",
                 "--set", "train.checkpoint_every=100", "--set", "rollout.prompts_per_call=2",
                 "--set", "train.groups_per_step=2", "--set", "eval.num_problems=8")
    _wait_for(lambda: _status(run, "trainer").get("step", 0) >= 2 or proc.poll() is not None, 240, "step 2")
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    proc.send_signal(signal.SIGINT)
    out = _finish(proc, 240)
    summary = json.loads((run / "summary.json").read_text())
    at = summary["stopped_at_step"]
    assert summary["stopped_early"] is True and 2 <= at < 50, out
    assert summary["resume_with"].endswith("--resume") and summary["trainer_steps"] == at
    assert _checkpoint_steps(run) == [at]  # no periodic checkpoint: this one was taken on the stop
    final_eval = [r for r in read_metrics(run, "trainer") if "eval_accuracy" in r][-1]
    saved = (run / "checkpoints" / str(at) / "commit_success.txt").stat().st_mtime
    assert final_eval["time"] - saved > 8 * 0.5 * 0.8  # the checkpoint was committed before the eval ran


@pytest.mark.parametrize("bad, message", [
    (["--set", "train.stpes=3"], "Did you mean 'train.steps'"),
    (["--set", "model.checkpoint=/nonexistent/ckpt"], "neither a local directory nor a hub id"),
])
def test_bad_input_exits_with_a_clear_error(tmp_path, bad, message):
    proc = _main(tmp_path / "run", *bad)
    out = _finish(proc, 120)
    assert proc.returncode != 0 and message in out, out
