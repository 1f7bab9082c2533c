"""`--launcher=ray` on a local Ray cluster started here (2 CPUs, no dashboard): the tiny default
experiment with 1 trainer + 1 searcher as Ray actors, a searcher SIGKILLed and restarted by Ray.

The launcher runs in this process (it joins the cluster the test started); its roles are real
processes under Ray's actors. Skipped only when Ray is not installed (`pip install 'tbajax[ray]'`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import ROLE_XLA_FLAGS

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'tbajax[ray]' (the dev extra has it)")

from tbajax.config import ConfigError, RaySpec, apply_overrides, check_resume_changes  # noqa: E402
from tbajax.main import load_experiment, main  # noqa: E402
from tbajax.stores import ParamReader, TrajectoryReader, discover_searcher_stores, param_store_url  # noqa: E402
from tbajax.system.metrics import read_metrics  # noqa: E402
from tbajax.system.ray_launcher import actor_options, check_cluster, gpu_env, placement_problems  # noqa: E402

pytestmark = pytest.mark.processes

SMALL = [
    "--set", "eval.num_problems=16",
    "--set", "eval.batch_size=16",
    "--set", "rollout.prompts_per_call=4",
    "--set", "train.groups_per_step=4",
    "--set", "train.log_every=1",
    "--set", "system.stall_timeout_s=600",  # a hang ends the run (and the test) instead of waiting forever
]


@pytest.fixture(scope="module")
def ray_cluster():
    """A local 2-CPU Ray instance for this file. Its workers (and so the roles) inherit this
    environment: one CPU device per role, as in a user's run, not the tests' 8 fake devices."""
    saved = os.environ.get("XLA_FLAGS")
    os.environ["XLA_FLAGS"] = ROLE_XLA_FLAGS
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=100 * 2**20)
    finally:
        if saved is not None:
            os.environ["XLA_FLAGS"] = saved
    yield
    ray.shutdown()


def _status(run_dir: Path, role: str) -> dict:
    try:
        return json.loads((run_dir / "status" / f"{role}.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def test_actor_options_declare_resources_labels_and_restarts():
    spec = RaySpec(trainer_gpus=1.0, searcher_cpus=2.0, searcher_gpus=0.5,
                   trainer_resources={"trainer_host": 1.0}, searcher_labels={"ray.io/accelerator-type": "H100"})
    trainer = actor_options(spec, "trainer", max_restarts=0)
    assert trainer == {"num_cpus": 1.0, "num_gpus": 1.0, "max_restarts": 0, "max_task_retries": 0,
                       "max_concurrency": 2, "resources": {"trainer_host": 1.0}}
    searcher = actor_options(spec, "searcher", max_restarts=3)
    assert searcher == {"num_cpus": 2.0, "num_gpus": 0.5, "max_restarts": 3, "max_task_retries": 3,
                        "max_concurrency": 2, "label_selector": {"ray.io/accelerator-type": "H100"}}


def test_ray_placement_is_configurable_and_may_change_on_resume():
    base = load_experiment("tiny_arithmetic")
    moved = apply_overrides(base, ['system.ray.searcher_gpus=0.5', 'system.ray.trainer_resources={"big": 1}'])
    assert moved.system.ray.trainer_resources == {"big": 1}
    assert check_resume_changes(base.to_dict(), moved.to_dict()) == [
        "system.ray.searcher_gpus", "system.ray.trainer_resources.big"]
    with pytest.raises(ConfigError, match=r"system.ray.trainer_cpus=-1.0 must be >= 0"):
        apply_overrides(base, ["system.ray.trainer_cpus=-1"])
    with pytest.raises(ConfigError, match=r"system.ray.searcher_resources: 'big': 'one' must be a number >= 0"):
        apply_overrides(base, ['system.ray.searcher_resources={"big": "one"}'])
    with pytest.raises(ConfigError, match=r"system.ray.trainer_labels: 'zone': 3 must be a string"):
        apply_overrides(base, ['system.ray.trainer_labels={"zone": 3}'])
    with pytest.raises(ConfigError, match=r"differs from the stored one in system.rayon \(1 -> 2\)"):
        check_resume_changes({"system": {"rayon": 1}}, {"system": {"rayon": 2}})  # a prefix, not a section


def test_ray_address_needs_the_ray_launcher(tmp_path, capsys):
    assert main([f"--run-dir={tmp_path / 'run'}", "--ray-address=auto", "--quiet"]) == 2
    assert "--ray-address needs --launcher=ray" in capsys.readouterr().err
    assert not (tmp_path / "run" / "config.json").exists()


def _node(cpus: float, gpus: float = 0.0, alive: bool = True, **extra: float) -> dict:
    labels = {"ray.io/accelerator-type": "H100"} if gpus else {}
    return {"Alive": alive, "Resources": {"CPU": cpus, "GPU": gpus, "memory": 1e9, **extra}, "Labels": labels}


def test_placement_problems_name_the_role_that_no_node_can_hold():
    cluster = [_node(16, 4, trainer_host=1.0), _node(8), _node(64, 8, alive=False)]
    assert placement_problems(RaySpec(trainer_gpus=4, searcher_gpus=0), 2, cluster) == []
    # 8 GPUs exist only on a dead node; 17 GPUs in total are more than the 4 alive ones
    (one_node, total) = placement_problems(RaySpec(trainer_gpus=1, searcher_gpus=8), 2, cluster)
    assert one_node == ("no node of the Ray cluster can hold a searcher (1 CPU, 8 GPU; see system.ray.searcher_*)"
                        ": the nodes offer 16 CPU, 4 GPU, 1 trainer_host; 8 CPU, 0 GPU")
    assert total == ("the roles need 17 GPUs (system.ray.trainer_gpus + 2 x system.ray.searcher_gpus) "
                     "but the Ray cluster has 4")
    assert placement_problems(RaySpec(trainer_gpus=1, searcher_gpus=2), 1, cluster) == []  # 3 of 4 on one node
    # custom resources and node labels count per node
    assert placement_problems(RaySpec(trainer_resources={"trainer_host": 1.0}), 1, cluster) == []
    (missing,) = placement_problems(RaySpec(searcher_resources={"trainer_host": 2.0}), 1, cluster)
    assert missing.startswith("no node of the Ray cluster can hold a searcher (1 CPU, 2 trainer_host;")
    assert placement_problems(RaySpec(trainer_labels={"ray.io/accelerator-type": "H100"}), 1, cluster) == []
    (label,) = placement_problems(RaySpec(searcher_labels={"ray.io/accelerator-type": "A100"}), 1, cluster)
    assert "labels {'ray.io/accelerator-type': 'A100'}" in label
    # sync mode: no searcher to place
    assert placement_problems(RaySpec(searcher_cpus=99), 0, cluster) == []


def test_gpu_env_follows_rays_devices_and_shares_memory_by_fraction():
    env = {"CUDA_VISIBLE_DEVICES": "0,1", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.450", "A": "1"}
    ray_env = {"CUDA_VISIBLE_DEVICES": "3"}
    assert gpu_env(env, 0.0, None, ray_env) == env  # a CPU role keeps the launcher's environment
    half = gpu_env(env, 0.5, None, ray_env)
    assert half == {"CUDA_VISIBLE_DEVICES": "3", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.450", "A": "1"}
    assert gpu_env(env, 0.25, None, ray_env)["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.225"
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in gpu_env(env, 2.0, None, ray_env)  # GPUs of its own
    assert gpu_env(env, 2.0, 0.3, ray_env)["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.450"  # the config's share
    user = {**ray_env, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.450"}
    assert gpu_env(env, 0.25, None, user)["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.450"  # the user's own


def test_a_placement_the_cluster_cannot_hold_is_refused(ray_cluster):
    config = apply_overrides(load_experiment("tiny_arithmetic"), ["system.ray.searcher_cpus=2"])
    with pytest.raises(ConfigError, match=r"the roles need 5 CPUs .* but the Ray cluster has 2"):
        check_cluster(config, num_searchers=2)
    with pytest.raises(ConfigError, match=r"no node of the Ray cluster can hold a trainer \(1 CPU, 1 GPU;"):
        check_cluster(apply_overrides(config, ["system.ray.trainer_gpus=1"]), num_searchers=0)


def test_ray_run_survives_a_killed_searcher(ray_cluster, tmp_path, capsys):
    """1 trainer + 1 searcher as Ray actors; the searcher's role process is SIGKILLed once it has
    appended twice; Ray restarts its actor, and the run finishes with everything in order."""
    run = tmp_path / "run"
    steps = 8
    killed: dict[str, int] = {}

    def kill_searcher() -> None:
        deadline = time.time() + 400  # generous: a 2-core box shared by other jobs
        while time.time() < deadline and _status(run, "searcher-0").get("calls", 0) < 2:
            time.sleep(0.2)
        urls = discover_searcher_stores(str(run))
        killed["rows"] = TrajectoryReader(urls[0]).committed_rows() if urls else 0
        killed["pid"] = _status(run, "searcher-0").get("pid", 0)
        if killed["pid"]:
            os.kill(killed["pid"], signal.SIGKILL)  # possibly in the middle of an append

    killer = threading.Thread(target=kill_searcher, daemon=True)
    killer.start()
    code = main([f"--run-dir={run}", "--launcher=ray", "--quiet", *SMALL, "--set", f"train.steps={steps}",
                 "--set", "system.num_searchers=1", "--set", "system.restart_backoff_s=0"])
    killer.join(timeout=5)
    out = capsys.readouterr()
    text = out.out + out.err
    assert code == 0, text[-4000:]
    assert killed.get("pid"), "the searcher never appended twice"

    # Ray restarted the killed searcher; its lines reached the console, prefixed by role
    assert "searcher-0 killed by signal 9 (SIGKILL); ending its Ray actor" in text, text[-4000:]
    assert "[searcher-0] restarted by Ray (restart 1)" in text, text[-4000:]
    assert "[trainer] " in text and "[searcher-0] " in text
    assert _status(run, "searcher-0")["pid"] != killed["pid"]

    # the same final summary as the process launcher's
    summary = json.loads((run / "summary.json").read_text())
    assert summary["trainer_steps"] == steps and not summary["stopped_early"]
    assert re.search(rf"^trainer steps +{steps}$", out.out, re.M), out.out[-2000:]

    # versions: one published after every step (sync_every=1)
    trainer = [r for r in read_metrics(run, "trainer") if "loss" in r]
    assert [r["version"] for r in trainer] == list(range(1, steps + 1))
    assert summary["final_version"] == steps == ParamReader(param_store_url(str(run)), "test").latest_version()

    # trajectories: intact, the restarted searcher appended after the committed rows, versions monotone
    url = discover_searcher_stores(str(run))[0]
    reader = TrajectoryReader(url)
    rows = reader.read(0, reader.committed_rows())
    assert len(rows) > killed["rows"] > 0
    assert _status(run, "searcher-0")["calls"] >= 1  # the new searcher process appended too
    assert all(len(r.behavior_logprobs) == len(r.response_tokens) for r in rows)
    versions = [r.policy_version for r in rows]
    assert versions == sorted(versions) and versions[-1] <= steps

    # the run directory is released and no actor is left holding the cluster's CPUs
    assert not (run / "launcher.lock").exists()
    deadline = time.time() + 30
    while ray.available_resources().get("CPU", 0) < 2 and time.time() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 2


def _after(predicate, action, timeout: float = 400) -> threading.Thread:
    """Run `action` in a thread once `predicate` holds (the launcher needs the main thread)."""

    def wait() -> None:
        deadline = time.time() + timeout
        while time.time() < deadline and not predicate():
            time.sleep(0.2)
        action()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_ray_searcher_out_of_restarts_ends_the_run(ray_cluster, tmp_path, capsys):
    run = tmp_path / "run"
    _after(lambda: _status(run, "searcher-0").get("calls", 0) >= 1,
           lambda: os.kill(_status(run, "searcher-0")["pid"], signal.SIGKILL))
    code = main([f"--run-dir={run}", "--launcher=ray", "--quiet", *SMALL, "--set", "train.steps=200",
                 "--set", "system.max_searcher_restarts=0", "--set", "train.checkpoint_every=2"])
    out = capsys.readouterr()
    assert code == 1, out.out + out.err
    assert "searcher-0 failed (killed by signal 9 (SIGKILL)); Ray restarted it 0 times and has given up" \
        in out.err, out.err
    assert "system.max_searcher_restarts=0" in out.err
    assert not (run / "launcher.lock").exists()


@pytest.mark.slow
def test_ray_ctrl_c_stops_every_role_cleanly(ray_cluster, tmp_path, capsys):
    run = tmp_path / "run"
    _after(lambda: _status(run, "trainer").get("step", 0) >= 3, lambda: os.kill(os.getpid(), signal.SIGINT))
    code = main([f"--run-dir={run}", "--launcher=ray", "--quiet", *SMALL, "--set", "train.steps=500",
                 "--set", "train.checkpoint_every=100"])
    out = capsys.readouterr()
    assert code == 130, out.out + out.err
    assert "stopping: asking every role to shut down cleanly" in out.out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_early"] and 3 <= summary["trainer_steps"] < 500
    assert summary["trainer_steps"] in [int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()]
    assert f"python -m tbajax.main --run-dir={run} --resume --launcher=ray" in out.out
    assert "did not exit within" not in out.err  # nobody needed ray.kill to stop
    deadline = time.time() + 30
    while ray.available_resources().get("CPU", 0) < 2 and time.time() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 2


@pytest.mark.slow
def test_ray_restarts_a_killed_trainer_from_its_checkpoint(ray_cluster, tmp_path, capsys):
    run = tmp_path / "run"
    killed: dict[str, int] = {}

    def kill_trainer() -> None:
        killed["step"] = _status(run, "trainer")["step"]
        os.kill(_status(run, "trainer")["pid"], signal.SIGKILL)

    # killed once a checkpoint is complete (orbax writes it in the background, and one still in
    # its temporary directory at the kill is rightly not resumed from)
    def checkpointed() -> bool:
        return any(p.name.isdigit() for p in (run / "checkpoints").glob("*"))

    _after(lambda: _status(run, "trainer").get("step", 0) >= 3 and checkpointed(), kill_trainer)
    code = main([f"--run-dir={run}", "--launcher=ray", "--quiet", *SMALL, "--set", "train.steps=8",
                 "--set", "train.checkpoint_every=2", "--set", "system.max_trainer_restarts=1"])
    out = capsys.readouterr()
    text = out.out + out.err
    assert code == 0, text[-4000:]
    assert "[trainer] === trainer killed by signal 9 (SIGKILL); ending its Ray actor" in text
    assert "[trainer] restarted by Ray (restart 1)" in text
    summary = json.loads((run / "summary.json").read_text())
    assert summary["trainer_steps"] == 8 and not summary["stopped_early"]
    records = read_metrics(run, "trainer")
    # one resume, from a checkpoint (every 2 steps) taken before the kill, not from step 0
    resumed = [r["from_step"] for r in records if r.get("event") == "resume"]
    assert len(resumed) == 1 and resumed[0] % 2 == 0 and 2 <= resumed[0] <= killed["step"], (resumed, killed)
    steps = [r["step"] for r in records if "loss" in r]
    assert steps[-1] == 8 and set(range(resumed[0] + 1, 9)) <= set(steps), steps


@pytest.mark.slow
def test_ray_second_ctrl_c_kills_every_role_at_once(ray_cluster, tmp_path, capsys):
    run = tmp_path / "run"

    def interrupt_twice() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.3)  # the launcher is now in its grace period, waiting for the roles
        second["at"] = time.time()
        os.kill(os.getpid(), signal.SIGINT)

    second: dict[str, float] = {}
    _after(lambda: _status(run, "trainer").get("step", 0) >= 2, interrupt_twice)
    code = main([f"--run-dir={run}", "--launcher=ray", "--quiet", *SMALL, "--set", "train.steps=500",
                 "--set", "system.stop_grace_s=120"])
    ended = time.time() - second["at"]
    out = capsys.readouterr()
    assert code == 130, out.out + out.err
    assert "second interrupt: killing every role now (SIGKILL)" in out.err
    assert ended < 60, ended  # at once, not after the 120 s grace period (generous for a loaded box)
    deadline = time.time() + 30
    while ray.available_resources().get("CPU", 0) < 2 and time.time() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 2
    assert not (run / "launcher.lock").exists()


def test_a_stop_that_reaches_an_actor_before_its_role_starts_is_kept(ray_cluster, tmp_path):
    """A run that ends while a role's actor is still starting (a trainer that failed at once): the
    final stop finds no process to signal, and the role must not start after it (it would run until
    the launcher's grace period ran out and it was killed)."""
    from tbajax.system.ray_launcher import RoleActor
    from tests.test_launcher import ROLE

    run = tmp_path / "run"
    run.mkdir()
    script = tmp_path / "role.py"
    script.write_text(ROLE)
    config = load_experiment("tiny_arithmetic")
    options = actor_options(config.system.ray, "searcher", max_restarts=0)
    actor = ray.remote(RoleActor).options(**options).remote(
        config, "searcher-0", 0, [], str(run / "logs" / "searcher-0.log"), os.getcwd(), 0.0,
        [sys.executable, str(script), str(run), "searcher-0", "wait"])
    ray.get(actor.signal.remote(signal.SIGTERM, True))
    assert ray.get(actor.run.remote(), timeout=60) == 0
    assert not (run / "searcher-0.starts").exists()  # the role never started
    ray.kill(actor)


@pytest.mark.parametrize("role", ["trainer", "searcher-0"])
def test_ray_role_out_of_device_memory_is_not_restarted(ray_cluster, tmp_path, capsys, role):
    """Stand-in roles (tests/test_launcher.py's) under Ray actors with restart budgets: the role
    that hits XLA's real allocation error returns from its actor instead of ending it, so Ray does
    not start the same program again; the run ends with the error's advice and a Ray resume command."""
    from tbajax.system.ray_launcher import RaySupervisor, _RayChild
    from tests.test_launcher import ROLE

    run = tmp_path / "run"
    run.mkdir()
    script = tmp_path / "role.py"
    script.write_text(ROLE)
    config = apply_overrides(load_experiment("tiny_arithmetic"), [
        "system.restart_backoff_s=0", "system.max_trainer_restarts=2", "system.max_searcher_restarts=2"])

    def child(name: str, behaviour: str) -> _RayChild:
        return _RayChild(name, [], {}, run / "logs" / f"{name}.log",
                         command=[sys.executable, str(script), str(run), name, behaviour], config=config,
                         options=actor_options(config.system.ray, name.split("-")[0], max_restarts=2))

    trainer, searcher = ("out_of_memory", "wait") if role == "trainer" else ("wait", "out_of_memory")
    sup = RaySupervisor(config, run, child("trainer", trainer), [child("searcher-0", searcher)], quiet=True)
    sup.tick_s = 0.1
    assert sup.run() == 1
    out, err = capsys.readouterr()
    assert len((run / f"{role}.starts").read_text().splitlines()) == 1, out + err  # no restart by Ray
    assert f"{role} ran out of device memory; a restart would too" in err, out + err
    assert (f"error: tbajax.system.out_of_memory.DeviceOutOfMemoryError: the {role.split('-')[0]} ran out of "
            "device memory (RESOURCE_EXHAUSTED") in err
    assert f"--run-dir={run} --resume --launcher=ray --set KEY=VALUE" in err
    assert f"[{role}] === {role} exited with code 1; out of device memory: its Ray actor stays up" in out, out
    deadline = time.time() + 30
    while ray.available_resources().get("CPU", 0) < 2 and time.time() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 2
