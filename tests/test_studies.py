"""The claim studies' --quick variants: real runs (trainer and searcher processes) of a few steps
each. The figures of a quick run mean nothing (the committed results come from the full
studies), so these check the pipeline's behaviour: every arm runs the requested steps, the
report is computed from the runs it lists, and a second invocation reuses finished arms.

All three are slow (each is two or more real runs plus the report: the speed-up one took 80 s of
the default run on 2 cores); the default suite checks the speed-up study's bound and arms by hand
and has its own end-to-end runs of both modes (tests/test_system.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROLE_XLA_FLAGS

pytestmark = pytest.mark.processes

REPO = Path(__file__).resolve().parent.parent
STUDIES = REPO / "experiments" / "studies"


def run_study(script: str, tmp_path: Path, *extra: str) -> tuple[Path, dict]:
    out, runs = tmp_path / "results", tmp_path / "runs"
    env = {**os.environ, "XLA_FLAGS": ROLE_XLA_FLAGS}  # the study's runs: one CPU device per role, as a user's
    proc = subprocess.run(
        [sys.executable, str(STUDIES / script), "--quick", f"--out={out}", f"--runs-dir={runs}", *extra],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    payload = json.loads((out / "results.json").read_text())
    return out, payload


def check_common(out: Path, payload: dict, expected_runs: int) -> str:
    md = (out / "results.md").read_text()
    assert "--quick" in md and "Produced by" in md
    assert len(payload["runs"]) == expected_runs
    for run in payload["runs"]:
        assert run["summary"]["trainer_steps"] == payload["provenance"]["steps"]
        assert run["curve"], "every run records held-out accuracy during training"
    for line in md.splitlines():
        if line.startswith("![") and "](" in line:
            assert (out / line.split("](")[1].rstrip(")")).stat().st_size > 1000
    return md


def _speedup_module():
    import importlib.util

    sys.path.insert(0, str(STUDIES))
    spec = importlib.util.spec_from_file_location("speedup_study", STUDIES / "speedup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_speedup_bound_and_arms_by_hand():
    study = _speedup_module()
    # T_gen 3 s, T_train 1 s per step: 1 searcher overlaps to max(3, 1) = 3 s (4/3x); 3 searchers
    # split generation to 1 s, so training and generation balance (4x); more cannot beat T_train
    assert study.ideal_bound(3.0, 1.0, 1) == pytest.approx(4 / 3)
    assert study.ideal_bound(3.0, 1.0, 3) == pytest.approx(4.0)
    assert study.ideal_bound(3.0, 1.0, 6) == pytest.approx(4.0)
    arms = study.arms((1, 2), seeds=2)
    assert [(a.group, a.seed) for a in arms] == [(g, s) for s in (0, 1) for g in ("sync", "async, 1 searcher", "async, 2 searchers")]
    assert arms[0].overrides == ("system.mode=sync",)
    assert arms[2].overrides == ("system.mode=async", "system.num_searchers=2")


@pytest.mark.slow
def test_speedup_study_quick_reports_its_runs_and_reuses_them(tmp_path: Path):
    out, payload = run_study("speedup.py", tmp_path, "--target=0.0", "--steps=3")
    md = check_common(out, payload, expected_runs=2)
    assert {r["group"] for r in payload["runs"]} == {"sync", "async, 1 searcher"}
    assert {r["summary"]["mode"] for r in payload["runs"]} == {"sync", "async"}
    figures = payload["figures"]
    t_gen, t_train = figures["t_gen_s"], figures["t_train_s"]
    # the bound is the formula of the sync run's own per-step timings, not a constant
    assert figures["arms"]["async, 1 searcher"]["ideal"] == pytest.approx(
        (t_gen + t_train) / max(t_gen, t_train), rel=1e-6)
    assert "ideal bound" in md
    # finished arms are reused, not re-run: the second invocation only re-reports
    before = {r["group"]: r["summary"]["wall_time_s"] for r in payload["runs"]}
    _, again = run_study("speedup.py", tmp_path, "--target=0.0", "--steps=3")
    assert {r["group"]: r["summary"]["wall_time_s"] for r in again["runs"]} == before


@pytest.mark.slow
def test_objectives_study_quick(tmp_path: Path):
    out, payload = run_study("objectives.py", tmp_path)
    md = check_common(out, payload, expected_runs=2)
    assert "`tb`" in md and "`dr_grpo`" in md
    assert {r["group"] for r in payload["runs"]} == {"tb", "dr_grpo"}
    assert {r["summary"]["objective"] for r in payload["runs"]} == {"tb", "dr_grpo"}


@pytest.mark.slow
def test_off_policy_study_quick(tmp_path: Path):
    out, payload = run_study("off_policy.py", tmp_path)
    # quick grid: k = 4 at m = 0.95, for tb and dr_grpo
    md = check_common(out, payload, expected_runs=2)
    assert "k = 4" in md
    assert {(r["params"]["objective"], r["params"]["k"]) for r in payload["runs"]} == {("tb", 4), ("dr_grpo", 4)}


@pytest.mark.slow
def test_redteam_searchers_study_quick_on_tiny_stand_ins(tmp_path: Path):
    """The searcher-scaling study on the tiny red-team stand-ins of tests/test_redteam_task.py
    (tiny Llama attacker and victim, tiny BiLSTM judge): 1 and 2 searchers plus the rloo arm."""
    pytest.importorskip("h5py", reason="h5py reads the BiLSTM weights")
    from tests.test_redteam_task import _run_args, write_tiny_bilstm
    from tests.test_system import SMALL

    bilstm_dir = write_tiny_bilstm(tmp_path / "bilstm")

    sets = []
    for a in [*SMALL, *_run_args(bilstm_dir)]:
        if a == "--set":
            continue
        sets.append("--set=" + (a.replace("--objective=", "train.objective=") if a.startswith("--objective=") else a))
    out, payload = run_study("redteam_searchers.py", tmp_path, "--experiment=tiny_arithmetic", "--searchers", "1", "2",
                             "--objective", "rloo", *sets)
    md = check_common(out, payload, expected_runs=3)
    assert {(r["params"]["searchers"], r["params"]["objective"]) for r in payload["runs"]} == {
        (1, "tb"), (2, "tb"), (1, "rloo")}
    assert {r["summary"]["objective"] for r in payload["runs"]} == {"tbajax.tasks.redteam:TB_NO_REFERENCE", "rloo"}
    for f in payload["figures"]:
        assert 0.0 <= f["asr_end"] <= 1.0 and f["diversity_metric"] == "diversity_hashed_bow"
        assert f["heap"]["heap_accepted"] >= f["heap"]["heap_size"] > 0
    assert "unique successful" in md and "heap size" in md
