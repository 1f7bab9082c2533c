"""The trainer's step loop: serial and pipelined give the same updates; the prefetch thread's
errors and shutdown; a refused update is reported one update late under its own number."""

from __future__ import annotations

import dataclasses
import threading
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tbajax.buffer import BufferConfig
from tbajax.config import ConfigError, ExperimentConfig, SystemSpec, apply_overrides
from tbajax.models import load_model
from tbajax.system.pipeline import BackgroundPublish, PollBackoff, Prefetcher, UpdateClock
from tbajax.system.trainer import Learner, RunCounters, StepLoop, make_buffer
from tbajax.training import NonFiniteLossError
from tbajax.trajectory import Trajectory

K = 4
VOCAB = 19  # the shipped tiny-arithmetic policy
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


# ----------------------------------------------------------------------------- prefetcher


def test_prefetcher_runs_jobs_in_its_thread_and_reraises_their_errors_with_the_traceback():
    p = Prefetcher("test-prefetch")
    try:
        p.request(threading.current_thread)
        assert p.outstanding
        assert p.get(timeout=30).name == "test-prefetch"  # ran in the prefetch thread
        with pytest.raises(RuntimeError, match="without a request"):
            p.get()

        def draw():
            raise KeyError("no such row")

        p.request(draw)
        with pytest.raises(RuntimeError, match="outstanding"):
            p.request(draw)  # one job at a time
        with pytest.raises(KeyError, match="no such row") as err:
            p.get(timeout=30)
        frames = [f.name for f in traceback.extract_tb(err.value.__traceback__)]
        assert "draw" in frames  # the thread's frames travel with the exception
        p.request(lambda: 7)  # the thread survives a failed job
        assert p.get(timeout=30) == 7
    finally:
        p.close()
    assert not p._thread.is_alive()
    with pytest.raises(RuntimeError, match="after close"):
        p.request(lambda: 1)


def test_prefetcher_close_waits_for_a_running_job_and_drops_its_result():
    started, ended = threading.Event(), threading.Event()

    def slow():
        started.set()
        time.sleep(0.3)
        ended.set()
        return "unused"

    p = Prefetcher()
    p.request(slow)
    assert started.wait(30)
    p.close()
    assert ended.is_set() and not p._thread.is_alive()
    p.close()  # idempotent


def test_inline_prefetcher_runs_in_the_callers_thread():
    p = Prefetcher(inline=True)
    p.request(threading.current_thread)
    assert p.get() is threading.current_thread()
    p.request(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        p.get()


def test_update_clock_idle_is_the_gap_between_one_update_finishing_and_the_next_dispatch():
    clock = UpdateClock()
    ready = jnp.ones(())
    jax.block_until_ready(ready)
    t = time.perf_counter()
    clock.dispatched(1, t - 10.0, ready)  # finished "now" (the watcher stamps it when ready)
    assert clock.finished(1) == 0.0 and clock.wall_s == 0.0  # a session's first update: not counted
    time.sleep(0.2)
    clock.pause(0.05)  # e.g. an evaluation between the two
    clock.dispatched(2, time.perf_counter(), ready)
    idle = clock.finished(2)
    assert 0.1 < idle < 5.0  # ~0.2 s slept minus 0.05 s paused
    assert clock.idle_s == idle and clock.wall_s >= idle and 0 < clock.idle_share <= 1
    clock.close()


def test_poll_backoff_doubles_to_its_cap_and_resets():
    poll = PollBackoff(first_s=0.001, max_s=0.005)
    assert [poll.sleep() for _ in range(5)] == [0.001, 0.002, 0.004, 0.005, 0.005]
    poll.reset()
    assert poll.sleep() == 0.001
    with pytest.raises(ValueError, match="0 < first_s <= max_s"):
        PollBackoff(first_s=0.1, max_s=0.05)


def test_pipeline_switch_is_a_checked_bool():
    from experiments.tiny_arithmetic import config as tiny

    assert tiny().train.pipeline is True
    assert apply_overrides(tiny(), ["train.pipeline=false"]).train.pipeline is False
    with pytest.raises(ConfigError, match="train.pipeline"):
        apply_overrides(tiny(), ["train.pipeline=3"])


# ----------------------------------------------------------------------------- the loop


def _rows(first_group: int, groups: int, *, seed: int, version: int, huge_reward_group: int | None = None) -> list[Trajectory]:
    """K rows per group, prompts 0..5 repeating (a prompt id's tokens the same wherever it comes:
    the buffer may draw a group's K rows from several generation groups, and the experiment packs
    each group's prompt once), versions as given (finite, valid rows)."""
    r = np.random.default_rng(seed)
    out = []
    for g in range(first_group, first_group + groups):
        prompt = np.random.default_rng(1000 + g % 6).integers(3, VOCAB, 3).astype(np.int32)
        for _ in range(K):
            n = int(r.integers(2, 6))
            reward = 1e38 if g == huge_reward_group else float(r.integers(0, 2))
            out.append(Trajectory(prompt_id=g % 6, group_id=g, prompt_tokens=prompt,
                                  response_tokens=r.integers(3, VOCAB, n).astype(np.int32),
                                  behavior_logprobs=-r.random(n).astype(np.float32), reward=reward,
                                  policy_version=version, wall_time=float(g),
                                  reference_logprobs=np.zeros(n, np.float32)))
    return out


class ChunkSource:
    """Store tail stand-in: its i-th `fill` adds chunk i (the same rows whatever the loop)."""

    def __init__(self, chunks: list[list[Trajectory]]):
        self.chunks = chunks
        self.fills: list[tuple[int, str]] = []  # (version, thread name) of each fill

    def fill(self, buffer, version: int) -> None:
        i = len(self.fills)
        self.fills.append((version, threading.current_thread().name))
        if i < len(self.chunks):
            buffer.add(self.chunks[i])

    def invalid_total(self) -> int:
        return 0

    def invalid_status(self) -> dict[str, int]:
        return {}


class HostPublisher:
    """ParamPublisher stand-in: keeps a host copy of every published version."""

    def __init__(self):
        self.next_version = 1
        self.versions: dict[int, tuple[int, list[np.ndarray]]] = {}

    def publish(self, params, meta=None, *, step: int, wait: bool = True, pin=None) -> int:
        assert pin is None  # eval.mode=inline: nothing is pinned for an evaluator
        v, self.next_version = self.next_version, self.next_version + 1
        self.versions[v] = (step, [np.array(x) for x in jax.tree.leaves(params)])
        return v


REPLAY = BufferConfig(samples_per_group=K, capacity_per_prompt=32, recency_prob=0.5, dedup=False)
IN_ORDER = BufferConfig(mode="fifo_once", samples_per_group=K, async_level=100)


def _config(pipeline: bool, steps: int = 6, mode: str = "async", buffer: BufferConfig = REPLAY) -> ExperimentConfig:
    from experiments.tiny_arithmetic import config as tiny

    base = tiny()
    return dataclasses.replace(
        base,
        train=dataclasses.replace(base.train, steps=steps, groups_per_step=2, pipeline=pipeline, checkpoint_every=1000),
        # the recency window moves with each sync: sampling depends on when mark_sync happened
        buffer=buffer,
        system=SystemSpec(mode=mode, num_searchers=1, sync_every=2),
    )


@pytest.fixture(scope="module")
def learner():
    from experiments.tiny_arithmetic import CHECKPOINT

    model = load_model(str(CHECKPOINT))
    lrn = Learner(_config(True), model, compiler_options=FAST_COMPILE)
    fresh = jax.device_get(lrn.trainer.state)
    return lrn, lambda: jax.tree.map(jnp.asarray, fresh)


def _run(learner, pipeline: bool, chunks, *, pauses=(), steps: int = 6, buffer: BufferConfig = REPLAY):
    lrn, fresh = learner
    lrn.trainer.state = fresh()
    lrn.config = config = _config(pipeline, steps, buffer=buffer)
    lrn.tokens_trained = 0
    buffer, source, publisher = make_buffer(config), ChunkSource(chunks), HostPublisher()
    publishing = BackgroundPublish(publisher, threaded=pipeline)
    records, paused_params = [], {}

    def on_step(step, record):
        records.append((step, record))
        if step in pauses:  # the loop promised the params after exactly this update
            paused_params[step] = [np.array(x) for x in jax.tree.leaves(lrn.trainer.state.params)]

    loop = StepLoop(config, lrn, buffer, source, RunCounters(start_time=time.time()), version=0,
                    publish=lambda s: publishing.publish(nnx.to_pure_dict(lrn.trainer.state.params), step=s),
                    on_step=on_step, pauses_after=lambda s: s in pauses)
    try:
        loop.run()
    finally:
        publishing.close()
    params = [np.array(x) for x in jax.tree.leaves(lrn.trainer.state.params)]
    return dict(loop=loop, records=records, params=params, buffer=buffer.state_dict(), source=source,
                publisher=publisher, paused=paused_params, tokens=lrn.tokens_trained)


def test_pipelined_and_serial_loops_give_the_same_updates(learner):
    chunks = [_rows(0, 6, seed=0, version=0), [], _rows(6, 4, seed=1, version=1), [], _rows(10, 4, seed=2, version=2)]
    serial = _run(learner, False, chunks, pauses=(3,))
    piped = _run(learner, True, chunks, pauses=(3,))
    assert piped["loop"].pipelined and not serial["loop"].pipelined
    # the batches were drawn in the prefetch thread, at the same versions, in the same order
    assert {t for _, t in piped["source"].fills} == {"draw-batch"}
    assert [v for v, _ in piped["source"].fills] == [v for v, _ in serial["source"].fills] == [0, 0, 1, 1, 2, 2]
    # same records in order (timings aside), same buffer state, same final params
    timing = {"step_time_s", "device_idle_s", "batch_prep_s", "batch_wait_s", "trainer_wait_s", "elapsed_s"}
    assert [s for s, _ in piped["records"]] == [s for s, _ in serial["records"]] == [1, 2, 3, 4, 5, 6]
    for (_, a), (_, b) in zip(piped["records"], serial["records"]):
        assert a.keys() == b.keys() and timing <= a.keys()
        assert {k: v for k, v in a.items() if k not in timing} == {k: v for k, v in b.items() if k not in timing}
    assert [r["version"] for _, r in piped["records"]] == [0, 1, 1, 2, 2, 3]
    assert piped["buffer"] == serial["buffer"]
    assert piped["tokens"] == serial["tokens"] > 0
    for a, b in zip(piped["params"], serial["params"]):
        np.testing.assert_array_equal(a, b)
    # published versions hold the params after their step (not the update dispatched after it)
    for v in (1, 2, 3):
        (sa, pa), (sb, pb) = piped["publisher"].versions[v], serial["publisher"].versions[v]
        assert sa == sb == 2 * v
        for a, b in zip(pa, pb):
            np.testing.assert_array_equal(a, b)
    # at a pause step on_step saw the params after exactly that update
    for a, b in zip(piped["paused"][3], serial["paused"][3]):
        np.testing.assert_array_equal(a, b)
    assert not any(np.array_equal(a, b) for a, b in zip(piped["paused"][3], piped["params"]) if a.size > 1)
    for run in (serial, piped):
        counters = run["loop"].counters
        assert counters.loop_wall_s > 0 and 0 <= counters.idle_s <= counters.loop_wall_s
        assert counters.prep_s == pytest.approx(sum(r["batch_prep_s"] for _, r in run["records"]))


def test_a_refused_update_is_reported_one_update_late_under_its_own_number(learner):
    # in order, 2 groups a step: groups 4-5 are update 3's; group 5's huge reward makes its loss infinite
    chunks = [_rows(0, 12, seed=3, version=0, huge_reward_group=5)]
    lrn, _ = learner
    for pipeline in (False, True):
        got = {}
        with pytest.raises(NonFiniteLossError, match="update 3") as err:
            try:
                _run(learner, pipeline, chunks, steps=6, buffer=IN_ORDER)
            finally:
                got["applied"] = lrn.trainer.updates_applied
        assert err.value.update == 3
        # serial: stopped at update 3; pipelined: update 4 was dispatched before 3 was checked,
        # and (from update 2's params, as 3 was refused) went in as the 3rd applied update
        assert got["applied"] == (3 if pipeline else 2)
    assert not [t for t in threading.enumerate() if t.name == "draw-batch" and t.is_alive()]


def test_sync_mode_stays_serial(learner):
    assert not StepLoop(_config(True, mode="sync"), learner[0], None, None, RunCounters(0.0), version=0,
                        publish=lambda s: 0, on_step=lambda s, r: None).pipelined


def test_auto_layout_scores_groups_that_do_not_share_a_prompt_in_rows(learner, caplog):
    """pack_groups="auto" (the default experiment's): groups whose rows share their prompt are
    packed; a batch with a group whose rows do not (a task whose prompt for one id varies between
    calls, drawn together by the buffer) is scored in rows, with one warning, not refused."""
    from tbajax.training.layout import batch_layout

    lrn, _ = learner
    assert lrn.config.train.trainer.pack_groups == "auto"
    assert lrn.trainer.layouts == ("rows", "packed", "strided")
    same = _rows(0, 2, seed=5, version=0)
    assert batch_layout(lrn.prepare([same[:K], same[K:]])) == "packed"
    mixed = [dataclasses.replace(t, prompt_tokens=t.prompt_tokens + i) for i, t in enumerate(same[:K])]
    with caplog.at_level("WARNING", logger="tbajax.system.trainer"):
        assert batch_layout(lrn.prepare([mixed, same[K:]])) == "rows"
        assert batch_layout(lrn.prepare([mixed, same[K:]])) == "rows"
    warnings = [r.getMessage() for r in caplog.records if "pack_groups=auto" in r.getMessage()]
    assert len(warnings) == 1 and "share group 0 but not their prompt" in warnings[0], warnings
