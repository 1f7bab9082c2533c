"""Reading a run: `python -m tbajax.samples` (its stored trajectories as text, newest first across
searchers, filtered, decoded with the run's tokenizer as the searchers decode them for grading) and
`python -m tbajax.status` (where it stands, from its directory's files)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from tbajax import samples as samples_module
from tbajax.main import load_experiment
from tbajax.samples import main, read_samples
from tbajax.stores import TrajectoryWriter, trajectory_store_url
from tbajax.system.assets import load_tokenizer_for
from tbajax.trajectory import RewardStatus, Trajectory


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory whose two searchers stored 30 and 20 arithmetic samples, interleaved in
    time: row r of searcher i was generated at time 2 r + i, with version r // 10 and reward 1 for
    even rows."""
    config = load_experiment("tiny_arithmetic")
    tokenizer = load_tokenizer_for(config)
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "config.json").write_text(config.to_json())
    for searcher, rows in ((0, 30), (1, 20)):
        writer = TrajectoryWriter(trajectory_store_url(str(run_dir), searcher), searcher)
        batch = []
        for r in range(rows):
            prompt = np.asarray(tokenizer(f"{r}+{searcher}=")["input_ids"], np.int32)
            response = np.asarray(tokenizer(str(r + searcher), add_special_tokens=False)["input_ids"] + [2],
                                  np.int32)  # + eos
            batch.append(Trajectory(
                prompt_id=r, group_id=r, prompt_tokens=prompt, response_tokens=response,
                behavior_logprobs=np.zeros(len(response), np.float32), reward=float(r % 2 == 0),
                reward_status=RewardStatus.OK if r % 2 == 0 else RewardStatus.WRONG,
                policy_version=r // 10, searcher_id=searcher, wall_time=float(2 * r + searcher)))
        writer.append(batch)
    return run_dir


def test_newest_samples_across_searchers_as_text(run, monkeypatch):
    monkeypatch.setattr(samples_module, "FIRST_READ", 2)  # several reads per store: 2, 4, 5, 5, ...
    monkeypatch.setattr(samples_module, "READ_CHUNK", 5)
    got = read_samples(run, 5)
    assert [(s.searcher, s.row) for s in got] == [(0, 29), (0, 28), (0, 27), (0, 26), (0, 25)]
    got = read_samples(run, 4, min_reward=1.0, version=1)  # rows 10-19 of each, even ones
    assert [(s.searcher, s.row) for s in got] == [(1, 18), (0, 18), (1, 16), (0, 16)]
    first = got[1]
    assert (first.prompt, first.response, first.reward, first.status) == ("18+0=", "18", 1.0, "ok")
    assert first.finished and first.response_tokens == 3
    assert [s.row for s in read_samples(run, 3, searcher=1, status="wrong")] == [19, 17, 15]
    assert len(read_samples(run, 100)) == 50


def test_the_command_line(run, capsys):
    assert main([str(run), "-n", "2", "--searcher", "1"]) == 0
    printed = capsys.readouterr().out
    assert "searcher 1 row 19 · version 1 · reward 0.000 (wrong) · 3 tokens, finished" in printed
    assert "  prompt:   '19+1='\n  response: '20'" in printed
    assert main([str(run), "-n", "1", "--json", "--status", "ok"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert (record["searcher"], record["row"], record["response"]) == (0, 28, "28")
    assert main([str(run), "--version", "7"]) == 0
    assert capsys.readouterr().out.strip() == "no samples match"
    assert main([str(run), "--searcher", "5"]) == 2
    assert "no trajectory store of searcher 5" in capsys.readouterr().err


def test_a_run_without_trajectories_says_so(tmp_path, capsys):
    (tmp_path / "config.json").write_text(load_experiment("tiny_arithmetic").to_json())
    assert main([str(tmp_path)]) == 2
    assert "no trajectories are stored under" in capsys.readouterr().err
    assert main([str(tmp_path / "elsewhere")]) == 2
    assert "config.json does not exist" in capsys.readouterr().err


def test_status_of_a_run_from_its_files(tmp_path, capsys):
    from tbajax.config import apply_overrides
    from tbajax.status import describe, run_state
    from tbajax.status import main as status_main
    from tbajax.system import rundir
    from tbajax.system.metrics import MetricsWriter

    run = tmp_path / "run"
    run.mkdir()
    config = apply_overrides(load_experiment("tiny_arithmetic"), ["train.steps=10"])
    (run / "config.json").write_text(config.to_json())
    assert run_state(run).state == "not started"
    rundir.write_status(run, "trainer", {"phase": "training", "step": 4})  # this (live) process
    rundir.write_status(run, "searcher-0", {"version": 2, "samples": 96, "tokens_per_s": 812.4})
    metrics = MetricsWriter(run, "trainer", tensorboard=False)
    metrics.write(0, {"eval_score": 0.25, "eval_metric": "accuracy"})  # as the trainer writes them
    metrics.write(4, {"eval_score": 0.5, "eval_metric": "accuracy"})
    metrics.close()
    (run / "checkpoints" / "4").mkdir(parents=True)
    state = run_state(run)
    assert (state.state, state.step, state.checkpoints) == ("running", 4, [4])
    assert state.evals == [(0, 0.25), (4, 0.5)]
    text = describe(state)
    assert "running: trainer step 4 of 10 (40%)" in text
    assert "accuracy: 0.250 (step 0) → 0.500 (step 4)" in text  # the task's metric, named while it runs
    assert re.search(r"searcher-0 +- +- +2 +96 +812 +\d+ s ago", text), text
    # its processes have exited: stopped, and how to continue it
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True)
    for role in ("trainer", "searcher-0"):
        path = run / "status" / f"{role}.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "pid": int(gone.stdout)}))
    state = run_state(run)
    assert state.state == "stopped" and [r.alive for r in state.roles] == [False, False]
    assert f"python -m tbajax.main --run-dir {run} --resume" in describe(state)
    (run / "summary.json").write_text(json.dumps({"trainer_steps": 10, "eval_metric": "accuracy"}))
    assert run_state(run).state == "finished"
    assert status_main([str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "finished"
    assert status_main([str(tmp_path / "no-run")]) == 2
    assert "does not exist" in capsys.readouterr().err
