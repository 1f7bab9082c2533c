"""Trajectory and param stores: real files, real processes, crashes included."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding, PartitionSpec as P

from tbajax.sharding import MeshConfig, make_mesh
from tbajax.stores import (
    ParamPublisher,
    ParamReader,
    ParamStoreError,
    ParamVersionError,
    TrajectoryReader,
    TrajectoryStoreError,
    TrajectoryWriter,
    discover_searcher_stores,
    param_store_url,
    trajectory_store_url,
)
from tbajax.trajectory import RewardStatus, Trajectory

REPO = Path(__file__).resolve().parents[1]
BATCH = 32  # rows per append in the crash test


def make_row(i: int, searcher_id: int = 0) -> Trajectory:
    """Row i of a deterministic stream: every field depends on i, lengths vary (0 included)."""
    rng = np.random.default_rng(i)
    p = int(rng.integers(1, 40))
    r = int(rng.integers(0, 1500)) if i % 7 else 0
    return Trajectory(
        prompt_id=1_000_000_000_000 + i,  # needs int64
        group_id=i // 4,
        prompt_tokens=rng.integers(0, 2**31 - 1, p).astype(np.int32),
        response_tokens=rng.integers(0, 50_000, r).astype(np.int32),
        behavior_logprobs=-rng.random(r).astype(np.float32) * 5,
        reward=0.25 * i - 3.0,
        reward_status=RewardStatus(i % 5),
        finished=bool(i % 2),
        policy_version=i // 10,
        searcher_id=searcher_id,
        wall_time=1.7e9 + 0.125 * i,
        reference_logprobs=(-rng.random(r).astype(np.float32) if i % 3 == 0 else None),
    )


def assert_same(a: Trajectory, b: Trajectory) -> None:
    scalars = ("prompt_id", "group_id", "reward", "reward_status", "finished", "policy_version", "searcher_id")
    for field in (*scalars, "wall_time"):
        assert getattr(a, field) == getattr(b, field), field
    assert type(a.reward_status) is RewardStatus and type(b.reward_status) is RewardStatus
    np.testing.assert_array_equal(a.prompt_tokens, b.prompt_tokens)
    np.testing.assert_array_equal(a.response_tokens, b.response_tokens)
    np.testing.assert_array_equal(a.behavior_logprobs, b.behavior_logprobs)
    np.testing.assert_array_equal(a.token_versions, b.token_versions)
    assert (a.reference_logprobs is None) == (b.reference_logprobs is None)
    if a.reference_logprobs is not None:
        np.testing.assert_array_equal(a.reference_logprobs, b.reference_logprobs)


def assert_rows(got: list[Trajectory], start: int, stop: int) -> None:
    assert len(got) == stop - start
    for i, t in zip(range(start, stop), got):
        assert_same(t, make_row(i))


# ------------------------------------------------------------------ trajectory store


def test_trajectory_round_trip_all_fields(tmp_path: Path) -> None:
    url = trajectory_store_url(tmp_path, 3)
    rows = [make_row(i, searcher_id=3) for i in range(10)]
    writer = TrajectoryWriter(url, searcher_id=3)
    assert writer.append(rows[:6]) == 6
    assert writer.append(rows[6:]) == 10
    reader = TrajectoryReader(url)
    got = reader.read_new()
    assert len(got) == 10 and reader.cursor == 10
    for a, b in zip(got, rows):
        assert_same(a, b)
    assert got[0].response_tokens.dtype == np.int32 and got[0].behavior_logprobs.dtype == np.float32
    assert len(got[7].response_tokens) == 0  # empty responses survive
    assert got[3].reference_logprobs is not None and got[4].reference_logprobs is None
    # random access across the two appends, cursor untouched
    for a, b in zip(reader.read(4, 8), rows[4:8]):
        assert_same(a, b)
    assert reader.cursor == 10
    # jagged layout: the flat arrays hold exactly the concatenation, no padding
    flat = ts.open({"driver": "zarr3", "kvstore": url + "/response_tokens/"}).result()
    total = sum(len(t.response_tokens) for t in rows)
    np.testing.assert_array_equal(flat[:total].read().result(), np.concatenate([t.response_tokens for t in rows]))
    assert json.loads((tmp_path / "trajectories/searcher-3/commit.json").read_text())["response_tokens"] == total


def test_trajectory_tailing_and_resume(tmp_path: Path) -> None:
    url = trajectory_store_url(tmp_path, 0)
    early = TrajectoryReader(url)  # before the store exists
    assert early.committed_rows() == 0 and early.read_new() == []
    writer = TrajectoryWriter(url, 0)
    assert early.read_new() == []
    writer.append([make_row(i) for i in range(5)])
    assert_rows(early.read_new(), 0, 5)
    assert early.read_new() == []
    writer.append([make_row(i) for i in range(5, 9)])
    writer.append([make_row(i) for i in range(9, 12)])
    assert early.committed_rows() == 12
    assert_rows(early.read_new(max_rows=2), 5, 7)
    assert_rows(early.read_new(), 7, 12)
    # a trainer resuming from a checkpointed cursor sees only what follows it
    resumed = TrajectoryReader(url, start_row=9)
    assert_rows(resumed.read_new(), 9, 12)
    too_far = TrajectoryReader(url, start_row=13)
    with pytest.raises(TrajectoryStoreError, match="past the 12 committed rows"):
        too_far.read_new()
    with pytest.raises(IndexError, match="outside the 12 committed rows"):
        early.read(10, 13)


def test_uncommitted_data_is_invisible_and_overwritten(tmp_path: Path) -> None:
    url = trajectory_store_url(tmp_path, 0)
    writer = TrajectoryWriter(url, 0)
    writer.append([make_row(i) for i in range(4)])
    reader = TrajectoryReader(url)
    assert_rows(reader.read_new(), 0, 4)
    # A crash between the data write and the commit: the data is on disk, the commit is not.
    torn = [make_row(i) for i in range(100, 104)]
    writer._write_data(torn)
    raw = ts.open({"driver": "zarr3", "kvstore": url + "/rows_i64/"}).result()
    assert raw[4, 0].read().result() == torn[0].prompt_id  # physically there...
    assert reader.committed_rows() == 4 and reader.read_new() == []  # ...but never read
    # A writer re-opened after the crash continues after the last committed row.
    reopened = TrajectoryWriter(url, 0)
    assert reopened.committed_rows() == 4
    assert reopened.append([make_row(i) for i in range(4, 7)]) == 7
    assert_rows(reader.read_new(), 4, 7)
    assert_rows(TrajectoryReader(url).read_new(), 0, 7)


def test_trajectory_bad_input(tmp_path: Path) -> None:
    url = trajectory_store_url(tmp_path, 1)
    writer = TrajectoryWriter(url, 1)
    with pytest.raises(ValueError, match="searcher_id 0 but this store belongs to searcher 1"):
        writer.append([make_row(0, searcher_id=0)])
    bad = Trajectory(0, 0, np.array([1.5, 2.0]), np.array([1], np.int32), np.zeros(1, np.float32), 0.0, searcher_id=1)
    with pytest.raises(ValueError, match="prompt_tokens must be a 1-D integer array"):
        writer.append([bad])
    with pytest.raises(TrajectoryStoreError, match="belongs to searcher_id 1, not 2"):
        TrajectoryWriter(url, 2)
    assert writer.committed_rows() == 0 and TrajectoryReader(url).committed_rows() == 0
    commit = json.loads((tmp_path / "trajectories" / "searcher-1" / "commit.json").read_text())
    assert commit["writer_epoch"] == writer.epoch == 1  # the refused open took no epoch


def test_a_json_record_survives_the_lock_file_a_killed_writer_left(tmp_path: Path) -> None:
    """tensorstore's file driver writes `<key>.__lock`, then renames it over `<key>`; a writer killed
    between the two leaves the lock file, and the next write reuses it without truncating. Records
    are padded to whole blocks, so a shorter record still reads back alone (found by the
    killed-writer test above: commit.json came back with the dead writer's tail)."""
    from tbajax.stores.urls import JSON_RECORD_BLOCK, open_kvstore, read_json, write_json

    kv = open_kvstore(str(tmp_path))
    write_json(kv, "commit.json", {"rows": 1})
    _, generation = read_json(kv, "commit.json")
    # what a writer killed mid-write of a longer record leaves behind
    stale = json.dumps({"rows": 123456789, "segments": list(range(200))}).encode()
    (tmp_path / "commit.json.__lock").write_bytes(stale + b" " * (-len(stale) % JSON_RECORD_BLOCK))
    assert write_json(kv, "commit.json", {"rows": 2}, if_equal=generation) is not None
    assert read_json(kv, "commit.json")[0] == {"rows": 2}
    assert (tmp_path / "commit.json").stat().st_size % JSON_RECORD_BLOCK == 0


def test_writer_fencing_a_zombie_fails_before_writing(tmp_path: Path) -> None:
    """Two writers on one store: opening the second fences the first, whose next append fails
    before it writes a single byte, while the new writer's rows stay intact."""
    url = trajectory_store_url(tmp_path, 1)
    zombie = TrajectoryWriter(url, 1)
    zombie.append([make_row(i, 1) for i in range(3)])
    replacement = TrajectoryWriter(url, 1)  # e.g. the restarted searcher while the old one hangs
    assert (zombie.epoch, replacement.epoch) == (1, 2)
    assert replacement.committed_rows() == 3
    raw = ts.open({"driver": "zarr3", "kvstore": url + "/rows_i64/"}).result()
    with pytest.raises(TrajectoryStoreError, match=r"epoch 1, store now at epoch 2.*wrote nothing"):
        zombie.append([make_row(i, 1) for i in range(100, 104)])
    assert raw[3:7].read().result().sum() == 0  # nothing of the zombie's rows reached the store
    # A zombie paused between its (fenced-in-time) data write and its commit cannot commit either.
    late = TrajectoryWriter(url, 1)
    grow = late._write_data([make_row(i, 1) for i in range(3, 5)])
    newest = TrajectoryWriter(url, 1)
    with pytest.raises(TrajectoryStoreError, match="fenced"):
        late._store.commit(grow)
    assert newest.append([make_row(i, 1) for i in range(3, 6)]) == 6
    got = TrajectoryReader(url).read_new()
    assert [t.prompt_id for t in got] == [make_row(i).prompt_id for i in range(6)]
    assert json.loads((tmp_path / "trajectories" / "searcher-1" / "commit.json").read_text())["writer_epoch"] == 4


def test_decoded_rows_do_not_pin_the_read_block(tmp_path: Path) -> None:
    url = trajectory_store_url(tmp_path, 0)
    TrajectoryWriter(url, 0).append([make_row(i) for i in range(1, 9)])
    rows = TrajectoryReader(url).read_new()
    for t in rows:
        for a in (t.prompt_tokens, t.response_tokens, t.behavior_logprobs, t.reference_logprobs):
            assert a is None or (a.base is None and a.flags.owndata)  # a copy, not a view of the block


def test_discover_searcher_stores(tmp_path: Path) -> None:
    assert discover_searcher_stores(tmp_path) == {}
    for i in (2, 0, 11):
        TrajectoryWriter(trajectory_store_url(tmp_path, i), i)
    (tmp_path / "trajectories" / "searcher-5").mkdir()  # no commit record: not a store
    found = discover_searcher_stores(tmp_path)
    assert list(found) == [0, 2, 11]
    assert found[11] == trajectory_store_url(tmp_path, 11)


CHILD = """
import sys
sys.path.insert(0, {repo!r})
from tests.test_stores import BATCH, make_row
from tbajax.stores import TrajectoryWriter
writer = TrajectoryWriter({url!r}, 0)
while True:
    n = writer.committed_rows()
    rows = [make_row(i) for i in range(n, n + BATCH)]
    print("begin", n, flush=True)
    writer.append(rows)
"""


def _run_and_kill(url: str, kill_after_rows: int, delay_s: float) -> int:
    """Start a writer process, SIGKILL it `delay_s` into an append; returns that append's start row."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(CHILD.format(repo=str(REPO), url=url))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,  # unbuffered: select() then sees every line as soon as it is printed
        env=env,
    )
    deadline = time.monotonic() + 120  # generous: the machine may be shared and slow
    try:
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError("writer process produced no output within 120 s")
            line = proc.stdout.readline().decode()
            if not line:
                raise AssertionError(f"writer process exited early: {proc.communicate()[1][-2000:].decode()}")
            start = int(line.split()[1])
            if start >= kill_after_rows:
                time.sleep(delay_s)  # an append takes ~10-50 ms here: land inside it
                os.kill(proc.pid, signal.SIGKILL)
                break
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    # lines printed before the kill that we had not read yet: the append in flight is the last one
    for rest in proc.stdout.read().decode().split():
        if rest.isdigit():
            start = max(start, int(rest))
    return start


def test_writer_killed_mid_append_loses_nothing_committed(tmp_path: Path) -> None:
    url = trajectory_store_url(tmp_path, 0)
    reader = TrajectoryReader(url)
    seen = 0
    # Later processes re-open the store the previous one was killed in.
    for delay_s in (0.005, 0.015, 0.03):
        started = _run_and_kill(url, kill_after_rows=seen + 2 * BATCH, delay_s=delay_s)
        committed = reader.committed_rows()
        assert committed % BATCH == 0  # each append is one commit: never a partial batch
        assert started <= committed <= started + BATCH
        got = reader.read_new()
        assert_rows(got, seen, committed)  # every visible row is complete and as written
        seen = committed
    writer = TrajectoryWriter(url, 0)
    assert writer.committed_rows() == seen
    writer.append([make_row(i) for i in range(seen, seen + 5)])
    assert_rows(reader.read_new(), seen, seen + 5)
    assert_rows(TrajectoryReader(url).read_new(), 0, seen + 5)


# ------------------------------------------------------------------ param store


def _params(mesh: jax.sharding.Mesh, scale: float = 1.0) -> dict:
    data = NamedSharding(mesh, P("data"))
    rep = NamedSharding(mesh, P())
    w = jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8) * scale / 7.0
    return {
        "w": jax.device_put(w, data),
        "block": {"b": jax.device_put(jnp.linspace(-1, 1, 8, dtype=jnp.float32) * scale, data)},
        "count": jax.device_put(jnp.arange(3, dtype=jnp.int32), rep),
    }


@pytest.fixture(scope="module")
def meshes() -> tuple[jax.sharding.Mesh, jax.sharding.Mesh]:
    """A trainer mesh over every device and a differently shaped searcher mesh over the same ones
    (8 fake CPU devices by default; whatever a preset XLA_FLAGS gives, never a skip)."""
    n = len(jax.devices())
    trainer = make_mesh(MeshConfig(data=n))
    x = 2 if n % 2 == 0 else 1
    searcher = jax.make_mesh((x, n // x), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    return trainer, searcher


def test_publish_and_restore_into_another_mesh(tmp_path: Path, meshes) -> None:
    trainer, searcher = meshes
    url = param_store_url(tmp_path)
    reader = ParamReader(url, "searcher-0")
    assert reader.latest_version() is None and reader.versions() == []
    with ParamPublisher(url, "run-a", dtype="float32", keep=5) as pub:
        versions = [pub.publish(_params(trainer, scale=v), step=10 * v) for v in (1, 2, 3)]
    assert versions == [1, 2, 3]
    latest = reader.latest()
    assert (latest.version, latest.run_id, latest.step, latest.dtype) == (3, "run-a", 30, "float32")
    assert reader.versions() == [1, 2, 3]

    expected = jax.tree.map(np.asarray, _params(trainer, scale=3))
    target = jax.eval_shape(lambda: _params(trainer))
    split = {
        "w": NamedSharding(searcher, P("x", "y")),
        "block": {"b": NamedSharding(searcher, P("y"))},
        "count": NamedSharding(searcher, P()),
    }
    for shardings in (split, NamedSharding(searcher, P())):
        got = reader.restore(3, target, shardings)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), got, expected)
        assert got["w"].sharding == (split["w"] if shardings is split else shardings)
        assert got["count"].dtype == jnp.int32
    assert reader.restore(1, target, NamedSharding(searcher, P()))["w"][1, 0] == pytest.approx(8 / 7.0)
    assert not (tmp_path / "params" / "readers" / "searcher-0.json").exists()  # lease released


def test_bf16_publish_casts_floats_only(tmp_path: Path, meshes) -> None:
    trainer, searcher = meshes
    url = param_store_url(tmp_path)
    params = _params(trainer, scale=1.3)
    with ParamPublisher(url, "run-b", dtype="bfloat16") as pub:
        pub.publish(params)
    reader = ParamReader(url, "s")
    assert reader.latest().dtype == "bfloat16"
    rep = NamedSharding(searcher, P())
    as_stored = reader.restore(1, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params), rep)
    f32_target = jax.eval_shape(lambda: params)
    np.testing.assert_array_equal(
        np.asarray(as_stored["w"], np.float32), np.asarray(params["w"].astype(jnp.bfloat16), np.float32)
    )
    bf16_target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16 if x.dtype == jnp.float32 else x.dtype), f32_target
    )
    got = reader.restore(1, bf16_target, rep)
    assert got["w"].dtype == jnp.bfloat16 and got["count"].dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(params["w"].astype(jnp.bfloat16)))
    np.testing.assert_array_equal(np.asarray(got["count"]), [0, 1, 2])


def test_versions_monotone_across_restarts_and_incomplete_versions(tmp_path: Path, meshes) -> None:
    trainer, searcher = meshes
    url = param_store_url(tmp_path)
    with ParamPublisher(url, "run-c", dtype=None, keep=10) as pub:
        for _ in range(3):
            pub.publish(_params(trainer))
    # A trainer that crashed mid-save left an incomplete version 4 (no commit marker) and an
    # orbax temp dir for version 6.
    shutil.copytree(tmp_path / "params" / "3", tmp_path / "params" / "4")
    (tmp_path / "params" / "4" / "commit_success.txt").unlink()
    (tmp_path / "params" / "6.orbax-checkpoint-tmp").mkdir()
    reader = ParamReader(url, "s", run_id="run-c")
    assert reader.latest_version() == 3 and reader.versions() == [1, 2, 3]
    target = jax.eval_shape(lambda: _params(trainer))
    with pytest.raises(ParamVersionError, match=r"version 4 is not available .* complete versions are \[1, 2, 3\]"):
        reader.restore(4, target, NamedSharding(searcher, P()))
    # The restarted trainer continues above everything on disk; its first publish cleans up.
    with pytest.raises(ParamStoreError, match="holds params of run 'run-c', not 'run-x'"):
        ParamPublisher(url, "run-x")
    with ParamPublisher(url, "run-c", dtype=None, keep=2) as restarted:
        assert restarted.latest_version() == 3 and restarted.next_version == 7
        assert restarted.publish(_params(trainer, scale=7)) == 7
    assert reader.latest_version() == 7 and reader.versions() == [3, 7]
    assert sorted(p.name for p in (tmp_path / "params").iterdir()) == ["3", "7", "latest.json"]
    np.testing.assert_array_equal(
        np.asarray(reader.restore(7, target, NamedSharding(searcher, P()))["w"]),
        np.asarray(_params(trainer, scale=7)["w"]),
    )
    with pytest.raises(ParamStoreError, match="expected 'other'"):
        ParamReader(url, "s", run_id="other").latest_version()


def test_gc_keeps_last_n_and_leased_versions(tmp_path: Path, meshes) -> None:
    trainer, _ = meshes
    url = param_store_url(tmp_path)
    reader = ParamReader(url, "searcher-1")
    pub = ParamPublisher(url, "run-d", dtype="bfloat16", keep=2, lease_timeout_s=60)
    pub.publish(_params(trainer))
    with reader.lease(1):
        for _ in range(4):
            pub.publish(_params(trainer))
        assert pub.leased_versions() == {1}
        assert 5 in reader.versions()  # visible when publish returns; collection runs behind it
        pub.wait()  # joins the collection
        assert reader.versions() == [1, 4, 5]  # 1 survives while leased; 2 and 3 are gone
    assert pub.gc() == [1]
    assert reader.versions() == [4, 5]
    # A lease left behind by a dead searcher expires.
    (tmp_path / "params" / "readers" / "dead.json").write_text(json.dumps({"version": 4, "time": time.time() - 3600}))
    pub.publish(_params(trainer))
    pub.publish(_params(trainer))
    pub.wait()
    assert reader.versions() == [6, 7]
    pub.close()


def test_async_publish_and_bad_input(tmp_path: Path, meshes) -> None:
    trainer, searcher = meshes
    url = param_store_url(tmp_path)
    reader = ParamReader(url, "s")
    target = jax.eval_shape(lambda: _params(trainer))
    with pytest.raises(ParamVersionError, match="no params have been published"):
        reader.restore(1, target, NamedSharding(searcher, P()))
    pub = ParamPublisher(url, "run-e", dtype="float32")
    params = _params(trainer, scale=2)
    assert pub.publish(params, wait=False) == 1
    jax.tree.map(lambda x: x.delete(), params)  # orbax copied to host: the trainer may donate
    pub.wait()
    assert reader.latest_version() == 1
    with pytest.raises(ParamVersionError, match=r"version 9 is not available .* complete versions are \[1\]"):
        reader.restore(9, target, NamedSharding(searcher, P()))
    with pytest.raises(ValueError, match="no sharding for target leaf"):
        reader.restore(1, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), target))
    with pytest.raises(TypeError, match=r"param leaf \['lr'\] is a float"):
        pub.publish({"lr": 0.1})
    with pytest.raises(ValueError, match="publish dtype must be one of"):
        ParamPublisher(url, "run-e", dtype="int8")
    (tmp_path / "params" / "latest.json").write_text("{not json")
    with pytest.raises(ParamStoreError, match="is corrupt .*not valid JSON.*delete it: the trainer rebuilds it"):
        reader.latest_version()
    pub.close()


def test_model_params_round_trip_through_store(tmp_path: Path, meshes) -> None:
    """The searcher flow: nnx params -> pure dict -> publish -> restore into another mesh -> model."""
    from flax import nnx

    from tbajax.models import CausalLM, ModelConfig
    from tbajax.sharding import param_shardings

    _, searcher = meshes
    cfg = ModelConfig(
        model_type="llama", vocab_size=101, hidden_size=32, intermediate_size=48, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8,
    )
    # Abstract model (no random-init compiles), filled with known values: the "trained" params.
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    rng = np.random.default_rng(0)
    trained = jax.tree.map(
        lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), nnx.to_pure_dict(abstract)
    )
    url = param_store_url(tmp_path)
    with ParamPublisher(url, "run-f", dtype=None) as pub:
        pub.publish(trained)

    mesh = make_mesh(MeshConfig(data=2, tensor=4))
    shardings = nnx.to_pure_dict(param_shardings(abstract, mesh))
    loaded = ParamReader(url, "s").restore(1, nnx.to_pure_dict(abstract), shardings)
    jax.tree.map(lambda x, s: (x.sharding == s) or pytest.fail(f"{x.sharding} != {s}"), loaded, shardings)
    nnx.replace_by_pure_dict(abstract, loaded)
    model = nnx.merge(graphdef, abstract)
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
        nnx.to_pure_dict(nnx.state(model, nnx.Param)),
        trained,
    )


# ------------------------------------------------------------------ param store recovery (one device)


def _tiny(scale: float) -> dict:
    return {"w": jnp.arange(6, dtype=jnp.float32) * scale}


def test_deleted_or_corrupt_pointer_is_rebuilt_from_the_newest_complete_version(tmp_path: Path, caplog) -> None:
    url = param_store_url(tmp_path)
    with ParamPublisher(url, "run-a", dtype=None) as pub:
        for s in (1.0, 2.0, 3.0):
            pub.publish(_tiny(s))
    latest = tmp_path / "params" / "latest.json"
    latest.unlink()  # as a user might after a corrupt-pointer error
    with ParamPublisher(url, "run-a", dtype=None) as pub:
        assert pub.latest_version() == 3  # not 0: versions go on above what searchers saw
        assert pub.publish(_tiny(4.0)) == 4
    assert ParamReader(url, "s").latest_version() == 4
    latest.write_text('{"format": "tbajax.par')  # torn
    with ParamPublisher(url, "run-a", dtype=None) as pub:
        assert pub.latest_version() == 4 and pub.publish(_tiny(5.0)) == 5
    assert "is corrupt" in caplog.text and "rebuilt" in caplog.text
    record = json.loads(latest.read_text())
    del record["run_id"]
    latest.write_text(json.dumps(record))
    with pytest.raises(ParamStoreError, match=r"latest.json lacks a valid run_id field .*delete the file"):
        ParamReader(url, "s").latest_version()


def test_lease_is_renewed_during_a_slow_restore(tmp_path: Path) -> None:
    url = param_store_url(tmp_path)
    with ParamPublisher(url, "run-a", dtype=None) as pub:
        pub.publish(_tiny(1.0))
    reader = ParamReader(url, "slow")
    lease = tmp_path / "params" / "readers" / "slow.json"
    with reader.lease(1, renew_every_s=0.05):
        first = json.loads(lease.read_text())["time"]
        time.sleep(0.5)
        assert json.loads(lease.read_text())["time"] > first + 0.04  # heartbeat rewrote it
    assert not lease.exists()


def test_version_is_one_flat_file_and_damaged_versions_say_so(tmp_path: Path) -> None:
    """params.bin holds each leaf's raw bytes at 64-byte aligned offsets then the manifest; a
    truncated file, a target of another model and an orbax-era version are refused by name."""
    import struct

    url = param_store_url(tmp_path)
    params = {"b": jnp.arange(3, dtype=jnp.int32), "a": {"w": jnp.arange(20, dtype=jnp.float32) / 4}}
    with ParamPublisher(url, "run-a", dtype="bfloat16") as pub:
        pub.publish(params)
    version_dir = tmp_path / "params" / "1"
    assert sorted(p.name for p in version_dir.iterdir()) == ["commit_success.txt", "params.bin"]
    raw = (version_dir / "params.bin").read_bytes()
    # Leaves in tree order ("a" before "b"): 20 bf16 (40 bytes) at 0, 3 int32 at 64; data ends at 128.
    np.testing.assert_array_equal(np.frombuffer(raw[:40], jnp.bfloat16).astype(np.float32), np.arange(20) / 4)
    assert raw[40:64] == bytes(24)
    np.testing.assert_array_equal(np.frombuffer(raw[64:76], np.int32), [0, 1, 2])
    magic, n = struct.unpack("<8sQ", raw[-16:])
    manifest = json.loads(raw[-16 - n : -16])
    assert magic == b"TBAJAXP1" and manifest["bytes"] == 128 == len(raw) - n - 16
    assert [(x["path"], x["shape"], x["dtype"], x["offset"]) for x in manifest["leaves"]] == [
        ("['a']['w']", [20], "bfloat16", 0), ("['b']", [3], "int32", 64)]

    reader = ParamReader(url, "s")
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    got = reader.restore(1, jax.eval_shape(lambda: params), one)  # bf16 on disk, f32 target: cast
    assert got["a"]["w"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got["a"]["w"]), np.arange(20) / 4)  # exact in bf16
    with pytest.raises(ParamStoreError, match=r"target leaves not stored \[\"\['c'\]\"\]"):
        reader.restore(1, {**jax.eval_shape(lambda: params), "c": jax.ShapeDtypeStruct((1,), jnp.float32)}, one)
    with pytest.raises(ParamStoreError, match=r"leaf \['b'\] of version 1 .* has shape \(3,\), the target \(4,\)"):
        reader.restore(1, {**jax.eval_shape(lambda: params), "b": jax.ShapeDtypeStruct((4,), jnp.int32)}, one)
    (version_dir / "params.bin").write_bytes(raw[:100])  # a disk that filled up, say
    with pytest.raises(ParamStoreError, match="params.bin has no tbajax.params.flat.v1 footer .*delete the version"):
        reader.restore(1, jax.eval_shape(lambda: params), one)
    (version_dir / "params.bin").unlink()  # what an orbax-era version looks like: a marker, no params.bin
    with pytest.raises(ParamStoreError, match="no params.bin: it was written in the orbax format"):
        reader.restore(1, jax.eval_shape(lambda: params), one)
    assert not (tmp_path / "params" / "readers" / "s.json").exists()  # leases released on errors too


# ------------------------------------------------------------------ param store: the fast publish path


def _awkward_floats(n: int, seed: int) -> np.ndarray:
    """Normal values plus the cases a float -> bf16 cast can get wrong: ties (round to even),
    subnormals, infinities, NaN, signed zeros, values that overflow bf16."""
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-45, 3.4e38, 1.0 + 2**-8,
                        1.0 + 3 * 2**-8, 65504.0, 65520.0], np.float32)
    x[: special.size] = special
    x[-special.size :] = special
    return x


@pytest.mark.parametrize("dtype,where", [("bfloat16", "host"), ("float16", "host"), ("bfloat16", "device")])
def test_cast_publish_is_bitwise_the_jax_cast(tmp_path: Path, monkeypatch, dtype: str, where: str) -> None:
    """A leaf larger than the writer's cast piece (chunked casts and a tail), small and 0-d and
    empty leaves, a numpy leaf and an int leaf: stored bytes equal `jnp.astype`'s, with
    wait=True (chunked casts while writing) and wait=False (casts dispatched before returning,
    then the caller deletes its arrays, as a donation would), and a reader loads them unchanged.
    "device" runs the accelerator path (whole-leaf casts, host transfers started early) on CPU."""
    from tbajax.stores import params as store

    if where == "device":  # jax arrays take the accelerator path: cast whole on the device, then transfer
        monkeypatch.setattr(store, "_on_host", lambda x: isinstance(x, np.ndarray))

    big = _awkward_floats((1 << 20) + 37, 0)
    params = {
        "big": jnp.asarray(big).reshape(-1, 1),
        "small": jnp.asarray(_awkward_floats(40, 1)),
        "scalar": jnp.float32(2.5) + jnp.zeros(()),
        "empty": jnp.zeros((0, 3), jnp.float32),
        "host": _awkward_floats(300, 2),
        "ids": jnp.arange(5, dtype=jnp.int32),
    }
    pieces = [i for i, _ in store._pieces(store._publish_leaves(params, dtype, detach=False), chunk=1 << 18)]
    assert pieces.count(0) == (5 if where == "host" else 1)  # on the host: 4 full chunks and a tail
    expected = {k: np.asarray(jnp.asarray(v).astype(dtype) if k != "ids" else v) for k, v in params.items()}
    url = param_store_url(tmp_path)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), expected)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    reader = ParamReader(url, "s")
    with ParamPublisher(url, "run-a", dtype=dtype, keep=4) as pub:
        versions = [pub.publish(params, wait=True), pub.publish(params, wait=False)]
        jax.tree.map(lambda x: x.delete() if isinstance(x, jax.Array) else None, params)  # a donation, say
        pub.wait()
    for version in versions:
        got = reader.restore(version, target, one)
        for k, want in expected.items():
            assert got[k].dtype == want.dtype and got[k].shape == want.shape, k
            got_bytes = np.asarray(got[k]).reshape(-1).view(np.uint8)
            np.testing.assert_array_equal(got_bytes, want.reshape(-1).view(np.uint8), err_msg=k)


def test_bucket_objects_hold_the_same_bytes_as_the_local_file(tmp_path: Path) -> None:
    """gs:// and s3:// stores write params.bin as one object (then the marker) through tensorstore:
    byte for byte the local file, bf16 casts included (checked on a memory:// kvstore)."""
    from tbajax.stores.params import _publish_leaves, _write_objects, layout

    params = {"a": jnp.asarray(_awkward_floats(3000, 3)).reshape(30, 100),
              "b": jnp.arange(7, dtype=jnp.int32)}
    with ParamPublisher(param_store_url(tmp_path), "run-a", dtype="bfloat16") as pub:
        pub.publish(params, {"kind": "full"})
    leaves = _publish_leaves(params, "bfloat16", detach=False)
    kv = ts.KvStore.open("memory://").result()
    _write_objects(kv, 1, leaves, layout([leaf.name for leaf in leaves], leaves, {"kind": "full"}))
    assert kv.read("1/params.bin").result().value == (tmp_path / "params" / "1" / "params.bin").read_bytes()
    assert kv.read("1/commit_success.txt").result().state == "value"


KILLED_PUBLISHER = """
import sys, time
sys.path.insert(0, {repo!r})
import jax.numpy as jnp
from tbajax.stores import ParamPublisher, params
write_all = params._write_all
def slow_write_all(fd, data):  # a slow disk: the kill lands inside the version's data write
    write_all(fd, data)
    print("wrote", flush=True)
    time.sleep(0.05)
pub = ParamPublisher({url!r}, "run-k", dtype="bfloat16", keep=2)
for v in range(1, 1000):
    print("publishing", pub.next_version, flush=True)
    if pub.next_version >= {kill_in!r}:
        params._write_all = slow_write_all
    pub.publish({{"w": jnp.full((3 << 20,), float(pub.next_version), jnp.float32)}})
"""


def test_publisher_killed_mid_write_leaves_no_visible_broken_version(tmp_path: Path) -> None:
    """SIGKILL while a version's params.bin is half written: readers still see the previous
    version (complete, exact), the broken one is never listed or loadable, a restarted
    publisher continues above it and its collection deletes it."""
    url = param_store_url(tmp_path)
    code = KILLED_PUBLISHER.format(repo=str(REPO), url=url, kill_in=3)  # a slow disk from version 3 on
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    deadline, writing = time.monotonic() + 120, None
    try:
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = proc.stdout.readline().decode() if ready else ""
            if not line:
                stderr = proc.stderr.read()[-2000:].decode()
                raise AssertionError(f"publisher produced no kill point: {stderr}")
            if line.startswith("publishing"):
                writing = int(line.split()[1])
            elif line.startswith("wrote") and writing == 3:
                os.kill(proc.pid, signal.SIGKILL)  # a few MB of version 3 are on disk, not all
                break
    finally:
        proc.kill()
        proc.wait(timeout=30)
    broken = tmp_path / "params" / "3"
    assert (broken / "params.bin").exists() and not (broken / "commit_success.txt").exists()
    assert (broken / "params.bin").stat().st_size < 3 << 21
    reader = ParamReader(url, "s", run_id="run-k")
    assert reader.latest_version() == 2 and reader.versions() == [1, 2]
    target = {"w": jax.ShapeDtypeStruct((3 << 20,), jnp.bfloat16)}
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    np.testing.assert_array_equal(np.asarray(reader.restore(2, target, one)["w"], np.float32), 2.0)
    gone = r"version 3 is not available .* complete versions are \[1, 2\]"
    with pytest.raises(ParamVersionError, match=gone):
        reader.restore(3, target, one)
    with ParamPublisher(url, "run-k", dtype="bfloat16", keep=2) as pub:
        assert pub.next_version == 4
        assert pub.publish({"w": jnp.full((3 << 20,), 4.0, jnp.float32)}) == 4
        pub.wait()
    assert reader.versions() == [2, 4] and not broken.exists()
    assert sorted(p.name for p in (tmp_path / "params").iterdir()) == ["2", "4", "latest.json", "readers"]
    np.testing.assert_array_equal(np.asarray(reader.restore(4, target, one)["w"], np.float32), 4.0)
