"""experiments/slurm/tbajax.sbatch, run for real on this machine: `srun` and `scontrol` are
stand-ins that start each task locally (SLURM_PROCID set, --output with %t), so the script's own
logic (config written once, trainer and searcher steps, stop file, resume) is what is tested."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SBATCH = REPO / "experiments" / "slurm" / "tbajax.sbatch"
FAKE_SRUN = """#!/bin/bash
ntasks=1; out=/dev/stdout
while [[ $1 == --* ]]; do case $1 in --ntasks=*) ntasks=${1#*=};; --output=*) out=${1#*=};; esac; shift; done
echo "srun: $ntasks x $*" >> "$FAKE_LOG"
pids=()
for ((t=0; t<ntasks; t++)); do SLURM_PROCID=$t "$@" > "${out//%t/$t}" 2>&1 & pids+=($!); done
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc
"""
FAKE_SCONTROL = "#!/bin/bash\nfor n in $(seq 1 $FAKE_NODES); do echo localhost; done\n"
SMALL = ["--set", "eval.num_problems=16", "--set", "eval.batch_size=16", "--set", "rollout.prompts_per_call=4",
         "--set", "train.groups_per_step=4"]


def _sbatch(tmp_path: Path, run: Path, *args: str, nodes: int = 3) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_NODES": str(nodes),
           "FAKE_LOG": str(tmp_path / "srun.log"), "SLURM_JOB_NODELIST": "n[1-3]",
           "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_NAME": "t",
           "RUN_DIR": str(run), "PYTHON": sys.executable, "PYTHONPATH": str(REPO)}
    env.pop("XLA_FLAGS", None)  # one CPU device per role, as a user's run
    return subprocess.run(["bash", str(SBATCH), *args], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=400)


@pytest.mark.slow
def test_sbatch_recipe_runs_a_trainer_and_two_searchers_then_resumes(tmp_path):
    run = tmp_path / "run"
    done = _sbatch(tmp_path, run, *SMALL, "--set", "train.steps=3")
    assert done.returncode == 0, done.stdout + done.stderr
    config = json.loads((run / "config.json").read_text())
    assert config["system"]["num_searchers"] == 2 and config["train"]["steps"] == 3
    summary = json.loads((run / "summary.json").read_text())
    assert summary["trainer_steps"] == 3 and not summary["stopped_early"]
    assert sorted(p.name for p in (run / "logs").iterdir()) == ["searcher-0.log", "searcher-1.log", "trainer-0.log"]
    assert "stopping after" in (run / "logs" / "searcher-1.log").read_text()  # the stop file ended both
    srun = (tmp_path / "srun.log").read_text()
    assert "1 x bash" in srun and "2 x bash" in srun

    # re-submitting continues the run from its checkpoint, with the stored config
    again = _sbatch(tmp_path, run, *SMALL, "--set", "train.steps=3")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "continuing the run" in again.stdout
    assert "--resume" in (tmp_path / "srun.log").read_text().splitlines()[-1]
