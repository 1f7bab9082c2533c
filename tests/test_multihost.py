"""A trainer as several JAX processes (tbajax.system.distributed): real processes, jax.distributed
over localhost, gloo CPU collectives, fake CPU devices.

Cheap on purpose: the shipped tiny policy, a few steps, a pre-written trajectory store (no
searcher) for the parity check.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.conftest import ROLE_XLA_FLAGS

from tbajax.config import ConfigError, apply_overrides
from tbajax.main import load_experiment
from tbajax.stores import TrajectoryWriter, param_store_url, trajectory_store_url
from tbajax.stores.params import parse_trailer
from tbajax.system import rundir
from tbajax.system.distributed import STOP, StepAgreement, decode_groups, encode_groups
from tbajax.system.metrics import read_metrics
from tbajax.trajectory import RewardStatus, Trajectory

pytestmark = pytest.mark.processes

REPO = Path(__file__).resolve().parent.parent
K = 8
STEPS = 3
OVERRIDES = [
    f"train.steps={STEPS}", "train.groups_per_step=4", "train.checkpoint_every=100", "train.log_every=1",
    "eval.num_problems=4", "eval.batch_size=4", "rollout.prompts_per_call=4",
    # the reward branch of the replay buffer only: a seeded draw from a static store
    "buffer.recency_prob=0", "buffer.max_staleness=null", "buffer.max_recent_uses=null",
    "system.stall_timeout_s=300",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(seed: int, groups: int, vocab: int) -> list[Trajectory]:
    """Synthetic groups of K rows (any tokens train: this checks who trains on what, not learning)."""
    rng = np.random.default_rng(seed)
    rows = []
    for g in range(groups):
        prompt = rng.integers(3, vocab, 8).astype(np.int32)  # every row fits one length bucket: one compile
        for _ in range(K):
            r = int(rng.integers(1, 7))
            rows.append(Trajectory(
                prompt_id=g, group_id=g, prompt_tokens=prompt,
                response_tokens=rng.integers(3, vocab, r).astype(np.int32),
                behavior_logprobs=-rng.uniform(0.5, 4.0, r).astype(np.float32),
                reference_logprobs=-rng.uniform(0.5, 4.0, r).astype(np.float32),
                reward=float(rng.integers(0, 2)), policy_version=0, searcher_id=0,
                reward_status=RewardStatus.OK,
            ))
    return rows


def _prepared_run(run: Path, *extra: str) -> Path:
    """A run directory with config.json and a searcher store of 16 groups already written."""
    config = apply_overrides(load_experiment("tiny_arithmetic"), [*OVERRIDES, *extra])
    rundir.make_run_dir(run)
    rundir.write_json_atomic(run / "config.json", config.to_dict())
    vocab = json.loads((Path(config.model.checkpoint) / "config.json").read_text())["vocab_size"]
    TrajectoryWriter(trajectory_store_url(str(run), 0), 0).append(_rows(0, 16, vocab))
    return run


def _env(devices: int) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "XLA_FLAGS": f"{ROLE_XLA_FLAGS} --xla_force_host_platform_device_count={devices}".strip()}
    # (the tests' compile flags too: a run compared with this process's must compile the same way)
    return env


def _trainers(run: Path, processes: int, devices: int, *extra: str) -> list[subprocess.Popen]:
    port = _free_port()
    dist = [] if processes == 1 else [f"--coordinator-address=127.0.0.1:{port}", f"--num-processes={processes}"]
    procs = []
    for i in range(processes):
        log = open(run / f"trainer-{i}.out", "w")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tbajax.main", "--role=trainer", f"--run-dir={run}", *dist,
             *([f"--process-id={i}"] if dist else []), *extra],
            cwd=REPO, env=_env(devices), stdout=log, stderr=subprocess.STDOUT))
    return procs


def _wait(procs: list[subprocess.Popen], run: Path, timeout: float = 300) -> list[int]:
    deadline = time.time() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError(f"trainer processes did not finish within {timeout} s:\n{_logs(run)}") from None
    return [p.returncode for p in procs]


def _logs(run: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(run.glob("trainer-*.out")))


def _published(run: Path, version: int | None = None) -> dict[str, np.ndarray]:
    """Published params (default: the newest version) as {path: array}, read from params.bin."""
    store = Path(param_store_url(str(run)).removeprefix("file://"))
    version = version or json.loads((store / "latest.json").read_text())["version"]
    data = (store / str(version) / "params.bin").read_bytes()
    manifest, _ = parse_trailer(data[-(1 << 16):], len(data), "params.bin")
    out = {}
    for leaf in manifest["leaves"]:
        dtype = np.dtype(leaf["dtype"])
        n = int(np.prod(leaf["shape"], dtype=np.int64))
        out[leaf["path"]] = np.frombuffer(data, dtype, n, leaf["offset"]).reshape(leaf["shape"])
    return out


# --- pure pieces ----------------------------------------------------------------------------------


def test_groups_round_trip_through_the_agreement_encoding():
    rows = _rows(1, 3, 50)
    rows[0] = Trajectory(**{**rows[0].__dict__, "reference_logprobs": None, "extras": {"text": "é", "x": [1, 2]},
                            "reward": 0.1 + 0.2, "finished": False, "reward_status": RewardStatus.TIMEOUT})
    groups = [rows[:K], rows[K:2 * K], rows[2 * K:]]
    back = decode_groups(encode_groups(groups))
    assert [len(g) for g in back] == [K, K, K]
    for a, b in zip(rows, [t for g in back for t in g]):
        for field in a.__dataclass_fields__:
            x, y = getattr(a, field), getattr(b, field)
            if isinstance(x, np.ndarray):
                assert x.dtype == y.dtype and np.array_equal(x, y), field
            else:
                assert x == y and type(x) is type(y), (field, x, y)  # floats bit-exact (0.1 + 0.2)


def test_single_process_agreement_is_the_decision_itself():
    agreement = StepAgreement()
    assert not agreement.multiprocess
    assert agreement.decide(1, lambda: STOP) is STOP
    assert agreement.decide(2, lambda: None) is None
    assert agreement.share("run_id", lambda: "abc") == "abc"


def test_multiprocess_config_checks():
    with pytest.raises(ConfigError, match="sync"):
        apply_overrides(load_experiment("tiny_arithmetic"), ["system.trainer_processes=2", "system.mode=sync"])
    with pytest.raises(ConfigError, match="system.trainer_processes=0"):
        apply_overrides(load_experiment("tiny_arithmetic"), ["system.trainer_processes=0"])


def test_a_searcher_refuses_to_join_a_process_group(tmp_path, capsys):
    from tbajax.main import main

    code = main(["--role=searcher", f"--run-dir={tmp_path}", "--coordinator-address=127.0.0.1:1",
                 "--num-processes=2", "--process-id=1"])
    assert code == 2
    err = capsys.readouterr().err
    assert "trainer only" in err and "system.num_searchers" in err


def test_launcher_environment_and_coordinator_of_trainer_processes(tmp_path):
    from tbajax.system.launcher import _Child, child_env, set_coordinator

    config = apply_overrides(load_experiment("tiny_arithmetic"), [
        "system.trainer_processes=2", "system.cpu_devices_per_trainer_process=3", "system.devices=split",
        "system.trainer_devices=4"])
    env = child_env(config, "trainer", 1)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"  # process 1's half of the trainer GPUs
    assert env["XLA_FLAGS"].split().count("--xla_force_host_platform_device_count=3") == 1
    assert "--xla_force_host_platform_device_count=3" not in child_env(config, "searcher", 0).get("XLA_FLAGS", "")
    searchers = apply_overrides(config, ["system.cpu_devices_per_searcher=2"])
    assert child_env(searchers, "searcher", 1)["XLA_FLAGS"].split().count(
        "--xla_force_host_platform_device_count=2") == 1
    assert "--xla_force_host_platform_device_count=2" not in child_env(searchers, "trainer", 0)["XLA_FLAGS"]
    trainers = [_Child(f"trainer-{i}", ["--role=trainer"], {}, tmp_path / f"{i}.log") for i in range(2)]
    set_coordinator(trainers)
    first = trainers[1].args
    set_coordinator(trainers)  # a restart: a new port, no duplicated flags
    assert [a for a in first if a.startswith("--process-id")] == ["--process-id=1"]
    assert len(trainers[1].args) == 4 and trainers[1].args[1] != first[1]
    assert trainers[0].args[1:3] == trainers[1].args[1:3] and trainers[0].args[3] == "--process-id=0"


def test_the_launcher_names_the_trainer_process_that_died_first(tmp_path):
    """Process 1 was killed; JAX then aborted process 0 (SIGABRT) for its dead peer: the cause
    named is process 1, whichever exit the launcher sees first."""
    import signal

    from tbajax.system.launcher import Supervisor, _Child

    class Exited(_Child):
        def poll(self):  # noqa: ANN201
            return self.code

    config = apply_overrides(load_experiment("tiny_arithmetic"), ["system.trainer_processes=2"])
    p0, p1 = (Exited(f"trainer{s}", [], {}, tmp_path / f"trainer{s}.log") for s in ("", "-1"))
    p0.code, p1.code = -signal.SIGABRT, -signal.SIGKILL
    sup = Supervisor(config, tmp_path, p0, [], trainer_peers=[p1])
    assert sup._trainer_exit() == -signal.SIGKILL
    assert sup._trainer_name().startswith("trainer process 1 of 2 (log ")
    p1.code = None  # process 1 still up: process 0's own failure
    assert sup._trainer_exit() == -signal.SIGABRT and sup._trainer_name().startswith("trainer process 0 of 2")
    p0.code = 0
    assert sup._trainer_exit() == 0  # process 0 done: the run is over (peers get the stop request)


# --- real processes -------------------------------------------------------------------------------


_AGREEMENT_SCRIPT = """
import hashlib, os, pathlib, sys, time
from tbajax.system import distributed
from tests.test_multihost import _rows, K
pid, port = int(sys.argv[1]), sys.argv[2]
distributed.initialize(f"127.0.0.1:{port}", 3, pid, heartbeat_timeout_s=60)
agreement = distributed.StepAgreement(poll_s=0.2)
rows = _rows(7, 2, 50)
groups = agreement.decide(1, lambda: [rows[:K], rows[K:]] if pid == 0 else None)
digest = hashlib.sha256(distributed.encode_groups(groups)).hexdigest()
print("step 1", digest, agreement.share("run_id", lambda: "r-" + str(pid)), flush=True)
if pid == 2:
    distributed.fail_fast(RuntimeError("process 2 ran out of memory"))
if pid == 1:
    try:
        agreement.decide(2, lambda: None)
    except distributed.PeerFailedError as e:
        print("peer failed:", e, flush=True)
elif pid == 0:  # process 0 hosts the coordination service: it must outlive its peers (a client
    # whose service vanishes aborts), so it waits for the test to see processes 1 and 2 gone
    release = pathlib.Path(sys.argv[3])
    while not release.exists():
        time.sleep(0.05)
sys.stdout.flush()
os._exit(0)
"""


def test_followers_get_process_0s_groups_and_a_failed_peer_by_name(tmp_path):
    """3 real processes (jax.distributed, 1 CPU device each): steps' groups arrive bit-identical
    on every process; a follower waiting for a step learns that process 2 failed, and why."""
    port = _free_port()
    env = {**_env(1), "PYTHONPATH": str(REPO)}
    release = tmp_path / "release"
    procs = [subprocess.Popen([sys.executable, "-c", _AGREEMENT_SCRIPT, str(i), str(port), str(release)], cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(3)]
    outs = {}
    for i in (1, 2, 0):  # the followers first; then process 0 (the service) may go
        try:
            outs[i] = procs[i].communicate(timeout=180)[0]
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        if i == 2:
            release.touch()
    outs = [outs[i] for i in range(3)]
    step1 = [next(line for line in o.splitlines() if line.startswith("step 1")) for o in outs]
    assert len(set(step1)) == 1 and step1[0].endswith("r-0"), outs  # same digest, process 0's run id
    assert [p.returncode for p in procs] == [0, 0, 1], outs
    assert "trainer process 2 failed: RuntimeError: process 2 ran out of memory" in outs[2]
    assert "peer failed: waiting for trainer step 2's batch from process 0: trainer process(es) 2 failed " \
           "(RuntimeError: process 2 ran out of memory)" in outs[1], outs[1]


def test_two_processes_train_the_same_params_as_one(tmp_path):
    """2 processes x 4 CPU devices vs 1 process x 8 devices, same store, same seed: the same batches
    (process 0 decides; a follower that trained on a batch of its own would diverge at once) and
    the same params after 3 steps and a checkpoint. Tolerance 1e-5 relative + 1e-6 absolute: the
    device programs are the same 8-way data-parallel step, but the cross-process gradient all-reduce
    (gloo) may add in a different order than the in-process one; reduction-order noise of float32
    sums (~1e-7 relative) is amplified by Adam's normalisation only where the second moment is tiny."""
    from tbajax.system.trainer import run_trainer

    one = _prepared_run(tmp_path / "one")
    two = _prepared_run(tmp_path / "two")
    procs = _trainers(two, 2, 4)
    try:
        assert jax.device_count() == 8  # conftest's fake devices: the 1-process run is this process
        summary = run_trainer(one)
    finally:
        codes = _wait(procs, two)
    assert codes == [0, 0], _logs(two)
    assert summary["trainer_steps"] == STEPS
    a, b = _published(one), _published(two)
    assert a.keys() == b.keys() and len(a) > 3
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-6, err_msg=k)
    first = _published(two, version=1)  # after step 1: training moved the params since
    assert max(float(np.abs(first[k] - b[k]).max()) for k in a) > 1e-4
    trained = [r for r in read_metrics(two, "trainer") if "loss" in r]
    assert [r["step"] for r in trained] == [1, 2, 3]
    assert [r["loss"] for r in trained] == pytest.approx(
        [r["loss"] for r in read_metrics(one, "trainer") if "loss" in r], rel=1e-5)
    # only process 0 wrote: one trainer metrics stream, one status file, one summary
    assert {r["role"] for r in read_metrics(two)} == {"trainer"}
    assert sorted(p.name for p in (two / "status").iterdir()) == ["trainer.json"]
    assert json.loads((two / "summary.json").read_text())["trainer_steps"] == STEPS
    # both processes wrote the final checkpoint together (orbax)
    assert sorted(int(p.name) for p in (two / "checkpoints").iterdir() if p.name.isdigit()) == [STEPS]


SMALL = ["--set", "eval.num_problems=4", "--set", "eval.batch_size=4", "--set", "rollout.prompts_per_call=4",
         "--set", "train.groups_per_step=4", "--set", "train.log_every=1", "--set", "system.stall_timeout_s=600"]


@pytest.mark.slow  # ~2 min on 2 loaded cores (3 JAX processes compiling); the launcher's parts are tested above
def test_async_run_with_a_two_process_trainer_and_one_searcher(tmp_path):
    """The launcher starts the trainer as 2 processes x 2 CPU devices (one 4-device mesh) and one
    searcher: the run finishes, and only process 0 wrote metrics, status and param versions."""
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)  # the searcher: one CPU device, as a user's run
    proc = subprocess.run(
        [sys.executable, "-m", "tbajax.main", f"--run-dir={run}", "--quiet", *SMALL, "--set", f"train.steps={STEPS}",
         "--set", "system.trainer_processes=2", "--set", "system.cpu_devices_per_trainer_process=2"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((run / "logs").glob("*.log")))
    assert proc.returncode == 0, proc.stdout[-3000:] + logs
    summary = json.loads((run / "summary.json").read_text())
    assert summary["trainer_steps"] == STEPS and summary["machine"]["devices"] == 4
    assert "JAX process 1 of 2" in (run / "logs" / "trainer-1.log").read_text()
    records = read_metrics(run)
    assert {r["role"] for r in records} == {"trainer", "searcher-0"}
    assert [r["step"] for r in records if r["role"] == "trainer" and "loss" in r] == [1, 2, 3]  # one writer
    assert sorted(p.name for p in (run / "status").iterdir()) == ["searcher-0.json", "trainer.json"]
    assert json.loads((run / "params" / "latest.json").read_text())["version"] == STEPS  # sync_every=1


@pytest.mark.slow
def test_a_dead_peer_stops_the_other_trainer_process_with_its_name(tmp_path):
    """Process 1 is killed (SIGKILL, no chance to report) while process 0 waits for data: process 0
    does not hang, JAX's coordination service names the dead task within the heartbeat timeout."""
    run = tmp_path / "run"
    config = apply_overrides(load_experiment("tiny_arithmetic"), OVERRIDES)
    rundir.make_run_dir(run)
    rundir.write_json_atomic(run / "config.json", config.to_dict())  # no trajectories: waits for data
    procs = _trainers(run, 2, 2, "--heartbeat-timeout=10")
    deadline = time.time() + 300
    while "waiting for data" not in json.dumps(_status_of(run)) and time.time() < deadline:
        time.sleep(0.5)
    procs[1].kill()
    t0 = time.time()
    try:
        procs[0].wait(timeout=120)
    except subprocess.TimeoutExpired:
        procs[0].kill()
        raise AssertionError(f"process 0 hung after its peer died:\n{_logs(run)}") from None
    assert procs[0].returncode != 0
    text = (run / "trainer-0.out").read_text()
    assert "unhealthy" in text and "stopped sending heartbeats" in text, text[-3000:]
    assert time.time() - t0 < 90


def _status_of(run: Path) -> dict:
    try:
        return json.loads((run / "status" / "trainer.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


@pytest.mark.slow
def test_a_two_process_trainer_resumes_from_its_orbax_checkpoint(tmp_path):
    """Both processes save the checkpoint together and restore their own shards of it."""
    run = _prepared_run(tmp_path / "run")
    assert _wait(_trainers(run, 2, 2), run) == [0, 0], _logs(run)
    longer = apply_overrides(load_experiment("tiny_arithmetic"), [*OVERRIDES, f"train.steps={STEPS + 2}"])
    rundir.write_json_atomic(run / "config.json", longer.to_dict())  # what the launcher's --resume does
    assert _wait(_trainers(run, 2, 2, "--resume"), run) == [0, 0], _logs(run)
    assert json.loads((run / "summary.json").read_text())["trainer_steps"] == STEPS + 2
    records = read_metrics(run, "trainer")
    assert [r["from_step"] for r in records if r.get("event") == "resume"] == [STEPS]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 3))
