"""Faults and recovery: corrupt files, bad rows, failing graders, and an async run whose searcher
and trainer are killed at random moments (incl. mid-append) and resumed."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from tbajax.training import Checkpointer
from tbajax.training.state import TrainState


def _state(step: int) -> TrainState:
    return TrainState(params={"w": jnp.full(3, float(step))}, opt_state=(), ref_params=None,
                      step=jnp.int32(step), rng=jnp.zeros(2, jnp.uint32))


def test_truncated_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    ckpt = Checkpointer(tmp_path / "ckpt", max_to_keep=None)
    for step in (2, 4):
        ckpt.save(_state(step), {"step": step})
    ckpt.wait()
    for f in (tmp_path / "ckpt" / "4" / "state").rglob("*"):
        if f.is_file() and f.name != "commit_success.txt":
            f.write_bytes(f.read_bytes()[:7])  # a disk that filled up mid-save, say
    with caplog.at_level(logging.WARNING):
        state, extra = Checkpointer(tmp_path / "ckpt").restore(_state(0))
    assert int(state.step) == 2 and extra == {"step": 2}
    np.testing.assert_array_equal(np.asarray(state.params["w"]), [2.0, 2.0, 2.0])
    assert "ckpt/4 cannot be read" in caplog.text and "skipping unreadable newer checkpoint(s) [4]" in caplog.text
    for f in (tmp_path / "ckpt" / "2" / "state").rglob("*"):
        if f.is_file() and f.name != "commit_success.txt":
            f.write_bytes(b"")
    with pytest.raises(RuntimeError, match=r"none of the checkpoints .* step 4: .*step 2: .*Move the checkpoints"):
        Checkpointer(tmp_path / "ckpt").restore(_state(0))


def test_resume_without_a_checkpoint_says_it_restarts_from_step_0(tmp_path, caplog):
    from tbajax.stores import TrajectoryWriter, trajectory_store_url
    from tbajax.system.trainer import RunCounters, _restore

    TrajectoryWriter(trajectory_store_url(tmp_path, 0), 0).append([_row(i) for i in range(3)])
    with caplog.at_level(logging.WARNING):
        got = _restore(tmp_path, str(tmp_path), Checkpointer(tmp_path / "checkpoints"), None, None, RunCounters(0.0))
    assert got == {}  # nothing restored: the caller evaluates and trains from step 0
    assert "no complete checkpoint" in caplog.text and "STARTING AGAIN FROM STEP 0" in caplog.text
    assert "from the 3 rows already in the trajectory stores" in caplog.text
    status = json.loads((tmp_path / "status" / "trainer.json").read_text())
    assert status["phase"] == "no checkpoint to resume: restarting at step 0"


# ------------------------------------------------------------------ bad rows and bad grades


def _row(i: int, **over) -> "Trajectory":
    from tbajax.trajectory import RewardStatus, Trajectory

    fields = dict(prompt_id=i, group_id=i, prompt_tokens=np.array([1, 2, 3], np.int32),
                  response_tokens=np.array([4, 63], np.int32), behavior_logprobs=np.array([-0.5, -1.0], np.float32),
                  reward=1.0, reward_status=RewardStatus.OK, searcher_id=0)
    return Trajectory(**{**fields, **over})


def test_check_row_names_what_makes_a_row_untrainable():
    from tbajax.system.trainer import check_row

    assert check_row(_row(0), vocab_size=64) is None
    assert check_row(_row(0, reward=float("nan")), 64) == "non-finite reward"
    assert check_row(_row(0, response_tokens=np.array([4, 64], np.int32)), 64) == "response_tokens outside [0, vocab_size)"
    assert check_row(_row(0, prompt_tokens=np.array([-1], np.int32)), 64) == "prompt_tokens outside [0, vocab_size)"
    assert check_row(_row(0, behavior_logprobs=np.array([-0.5, np.inf], np.float32)), 64) == "non-finite behavior log-probs"
    assert check_row(_row(0, reference_logprobs=np.array([np.nan, 0.0], np.float32)), 64) == "non-finite reference log-probs"


def test_store_tail_skips_and_counts_durable_bad_rows(tmp_path):
    """A NaN reward and a corrupted token id are durable in the store: the trainer's tail skips
    them (every resume re-reads them) and counts them, instead of stopping on them forever."""
    from tbajax.stores import TrajectoryWriter, trajectory_store_url
    from tbajax.system.trainer import StoreTail

    writer = TrajectoryWriter(trajectory_store_url(tmp_path, 0), 0)
    writer.append([_row(0), _row(1, reward=float("nan")), _row(2), _row(3, prompt_tokens=np.array([9999], np.int32))])

    class Collect:
        def __init__(self):
            self.rows = []

        def add(self, rows):
            self.rows.extend(rows)

    for _ in range(2):  # a resumed trainer re-reads the same rows: same verdict
        tail, got = StoreTail(str(tmp_path), vocab_size=64), Collect()
        tail.fill(got, 0)
        assert [t.prompt_id for t in got.rows] == [0, 2]
        assert tail.invalid_rows == {"non-finite reward": 1, "prompt_tokens outside [0, vocab_size)": 1}
        assert tail.invalid_total() == 2


def test_in_process_grading_gives_the_pool_statuses():
    """NaN, inf, a raise and a malformed return all become ERROR with reward 0, exactly as in the
    reward pool (`call_reward`), so no non-finite reward reaches a store."""
    import dataclasses

    from tbajax.system.searcher import GradeWatch, score_in_process
    from tbajax.tasks.arithmetic import arithmetic_task
    from tbajax.tasks.reward_pool import call_reward
    from tbajax.trajectory import RewardStatus

    def grader(completion, answer):
        return {"nan": (float("nan"), 0), "inf": (float("inf"), 0), "bad": "oops", "ok": (1.0, 0),
                "wrong": (0.0, 1)}.get(completion) or (_ for _ in ()).throw(ValueError("grader bug"))

    task = dataclasses.replace(arithmetic_task(), reward_fn=grader)
    texts = ["nan", "inf", "bad", "raise", "ok", "wrong"]
    got = score_in_process(task, texts, [None] * len(texts))
    assert [(r.reward, r.status) for r in got] == [(0.0, RewardStatus.ERROR)] * 4 + [(1.0, RewardStatus.OK), (0.0, RewardStatus.WRONG)]
    assert got == [call_reward(grader, t, None) for t in texts[:3]] + got[3:]
    assert got[3].error.startswith("ValueError: grader bug")

    watch = GradeWatch(window=4)
    watch.add(got[:4])  # four failures in a row: the grader is broken
    assert watch.all_failed() and watch.first_error.startswith("reward function returned a non-finite reward nan")
    watch.add(got[4:5])
    assert not watch.all_failed()
    watch.add(got[:3])
    assert not watch.all_failed()  # one success among the last four
    watch.add(got[3:4])
    assert watch.all_failed() and watch.first_error.startswith("reward function returned a non-finite")


def test_resume_markers_drop_superseded_trainer_records(tmp_path):
    from tbajax.system.metrics import read_metrics

    lines = [
        {"role": "trainer", "step": 0, "eval_accuracy": 0.1},
        *({"role": "trainer", "step": s, "loss": float(s)} for s in (1, 2, 3, 4, 5)),
        {"role": "searcher-0", "step": 40, "samples": 40},
        {"role": "trainer", "event": "resume", "from_step": 2, "step": 2},
        *({"role": "trainer", "step": s, "loss": 10.0 + s} for s in (3, 4)),
        {"role": "trainer", "event": "resume", "from_step": 4, "step": 4},
        *({"role": "trainer", "step": s, "loss": 20.0 + s} for s in (5, 6)),
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    losses = {r["step"]: r["loss"] for r in read_metrics(tmp_path, "trainer") if "loss" in r}
    assert [r["step"] for r in read_metrics(tmp_path, "trainer") if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert losses == {1: 1.0, 2: 2.0, 3: 13.0, 4: 14.0, 5: 25.0, 6: 26.0}
    assert len(read_metrics(tmp_path, "searcher-0")) == 1
    assert len(read_metrics(tmp_path, superseded=True)) == len(lines)


# ------------------------------------------------------------------ the chaos run


def _chaos_scenario(tmp_path, seed: int, early_kills: bool) -> dict:
    from experiments.chaos import check, run_scenario

    figures = run_scenario(tmp_path / f"run-{seed}", seed=seed, searcher_kills=3, steps=10, early_kills=early_kills,
                           timeout_s=400)
    assert check(figures) == [], json.dumps({k: v for k, v in figures.items()}, indent=1)
    return figures


@pytest.mark.processes
def test_chaos_searcher_killed_three_times_incl_mid_append_and_trainer_once(tmp_path):
    """Async run of the tiny model: SIGKILL the searcher three times (the first right after an
    append's data write, before its commit) and the trainer once, resume, then audit: every
    committed row reads back intact, none torn or duplicated, prompts in their exact order, the
    committed count never went down, versions monotone, the run finished with a sane summary."""
    from tests.test_system import assert_exact_resume

    f = _chaos_scenario(tmp_path, seed=0, early_kills=True)  # later kills during start-up: cheaper
    assert (f["searcher_kills"], f["trainer_kills"]) == (3, 1)
    assert f["kills"][0]["where"] == "mid-append" and f["kills"][0]["rows_in_flight"] > 0
    assert f["rows_committed"] > 0 and f["row_count_samples"] > 20
    assert f["resumes"] >= 1 and f["final_version"] > 0
    # the trainer kill was resumed by hand: exactly from its last checkpoint (tests/test_system.py)
    before = f["kills"][-1]["before_resume"]
    assert before["checkpoint_step"] >= 2
    assert_exact_resume(tmp_path / "run-0", checkpoint_step=before["checkpoint_step"],
                        checkpoint_extra=before["checkpoint_extra"], version_before=before["latest_version"])


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1, 21))
@pytest.mark.processes
def test_chaos_repeated(tmp_path, seed):
    _chaos_scenario(tmp_path, seed, early_kills=seed % 2 == 0)
