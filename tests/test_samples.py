"""`python -m tbajax.samples`: a run's stored trajectories as text, newest first across searchers,
filtered, decoded with the run's tokenizer as the searchers decode them for grading."""

from __future__ import annotations

import json

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
