"""The batched scorer contract: Samples in, Scores (rewards, statuses, extras) out."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from tbajax.stores import TrajectoryReader, TrajectoryWriter
from tbajax.tasks import get_task
from tbajax.tasks.base import Problem
from tbajax.tasks.scoring import (
    RewardFnScorer,
    Samples,
    ScorerContext,
    Scores,
    build_scorer,
    concat_samples,
    concat_scores,
)
from tbajax.trajectory import RewardStatus, Trajectory


def _samples(texts, split="train"):
    n = len(texts)
    return Samples(
        problems=[Problem(i, "q", str(i)) for i in range(n)],
        prompt_tokens=[np.arange(3, dtype=np.int32)] * n,
        response_tokens=[np.arange(len(t), dtype=np.int32) for t in texts],
        texts=list(texts),
        finished=np.ones(n, bool),
        split=split,
    )


def _grader(completion, answer):
    if completion == "raise":
        raise RuntimeError("grader bug")
    if completion == "nan":
        return math.nan, RewardStatus.OK
    return float(completion == answer), RewardStatus.OK if completion == answer else RewardStatus.WRONG


def test_default_scorer_grades_each_sample_with_the_pool_statuses():
    task = dataclasses.replace(get_task("arithmetic"), reward_fn=_grader)
    scorer = build_scorer(task, ScorerContext(config=None, tokenizer=None))
    assert isinstance(scorer, RewardFnScorer)
    scores = scorer.score(_samples(["0", "x", "raise", "nan"]))
    assert scores.reward.tolist() == [1.0, 0.0, 0.0, 0.0]  # a failure is reward 0, never NaN
    assert [RewardStatus(int(s)) for s in scores.status] == [
        RewardStatus.OK, RewardStatus.WRONG, RewardStatus.ERROR, RewardStatus.ERROR]
    assert scores.failed().tolist() == [False, False, True, True]
    assert scores.errors[0] is None and "grader bug" in scores.errors[2] and "non-finite" in scores.errors[3]


def test_a_task_scorer_is_built_once_with_its_context():
    built = []

    class Constant:
        def __init__(self, task, context):
            built.append((task.name, context.mesh))

        def score(self, samples, key):
            return Scores(reward=np.full(len(samples), 0.5), status=np.zeros(len(samples), int))

        def close(self):
            pass

    task = dataclasses.replace(get_task("arithmetic"), scorer=Constant)
    scorer = build_scorer(task, ScorerContext(config=None, tokenizer=None, mesh="mesh"))
    assert built == [("arithmetic", "mesh")]
    assert scorer.score(_samples(["a", "b"]), None).reward.tolist() == [0.5, 0.5]

    bad = dataclasses.replace(task, scorer=lambda t, c: object())
    with pytest.raises(TypeError, match="has no score"):
        build_scorer(bad, ScorerContext(config=None, tokenizer=None))


def test_scores_are_checked_where_the_scorer_made_them():
    with pytest.raises(ValueError, match="non-finite for samples \\[1\\]"):
        Scores(reward=np.array([0.0, np.nan]), status=np.zeros(2, int))
    with pytest.raises(ValueError, match="status has 1 entries for 2"):
        Scores(reward=np.zeros(2), status=np.zeros(1, int))
    with pytest.raises(ValueError, match="extras\\['x'\\] has 1 entries"):
        Scores(reward=np.zeros(2), status=np.zeros(2, int), extras={"x": [1]})
    s = Scores(reward=np.zeros(2), status=np.zeros(2, int), extras={"a": [np.float32(0.5), np.arange(2)],
                                                                      "b": [object(), None]})
    with pytest.raises(TypeError):
        s.extras_of(0)  # an object is not JSON: refused with the scorer on the stack
    ok = Scores(reward=np.zeros(2), status=np.zeros(2, int), extras={"a": [np.float32(0.5), np.arange(2)]})
    assert ok.extras_of(0) == {"a": 0.5} and ok.extras_of(1) == {"a": [0, 1]}


def test_concat_keeps_order_and_common_extras():
    a = Scores(reward=np.array([1.0]), status=np.array([0]), extras={"x": [1], "y": ["a"]})
    b = Scores(reward=np.array([0.0, 2.0]), status=np.array([1, 0]), extras={"x": [2, 3]},
               errors=[None, "boom"])
    c = concat_scores([a, b])
    assert c.reward.tolist() == [1.0, 0.0, 2.0] and c.status.tolist() == [0, 1, 0]
    assert dict(c.extras) == {"x": [1, 2, 3]} and c.errors == [None, None, "boom"]
    s = concat_samples([_samples(["a"]), _samples(["bb", "c"])])
    assert s.texts == ["a", "bb", "c"] and s.finished.tolist() == [True] * 3 and len(s) == 3


def test_trajectory_extras_round_trip_through_the_store(tmp_path):
    writer = TrajectoryWriter(tmp_path / "s", 0)

    def row(i, extras):
        return Trajectory(prompt_id=i, group_id=0, prompt_tokens=np.arange(3), response_tokens=np.arange(i + 1),
                          behavior_logprobs=np.zeros(i + 1), reward=float(i), extras=extras)

    rows = [row(0, {"victim": ["", "b"], "toxicity": [0.5, 0.0]}), row(1, None),
            row(2, {"victim": ["aa"], "toxicity": [0.25]}), row(3, {"rm": -1.5})]
    writer.append(rows[:2])
    writer.append(rows[2:])
    reader = TrajectoryReader(tmp_path / "s")
    got = reader.read(0, 4)
    assert [g.extras for g in got] == [r.extras for r in rows]
    assert reader.read(1, 3)[1].extras == {"victim": ["aa"], "toxicity": [0.25]}  # a range starting mid-store
    with pytest.raises(ValueError, match="JSON-serialisable"):
        writer.append([row(4, {"x": object()})])
    assert TrajectoryReader(tmp_path / "s").committed_rows() == 4  # nothing of the bad row was committed
