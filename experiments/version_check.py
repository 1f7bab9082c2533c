"""The test run and the default experiment under another Python (and the jax release pip gives it).

CI runs Python 3.11, where pip's newest jax is 0.10.2; jax 0.11 needs Python 3.12, which is what
the GPU machines have. This script installs the project into a fresh venv of the given
interpreter (`pip install -e ".[dev]"`, as the README's commands do), runs the README's test
command there, then the default experiment (`python -m tbajax.main`), and writes what each gave:

    python experiments/version_check.py --python python3.12 --json PATH [--venv DIR]

A venv of Python 3.12 takes torch 2.13.0 from PyPI (a CUDA build, about 5 GB with its
libraries; it runs on the CPU). Figures: the test counts and names of the tests that did not
pass, the default run's summary (accuracy, samples, waits) and the installed versions. The
default run's wall time is reported with the fp32 matmul rate the run itself measured.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TEST_COMMAND = ["-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider"]
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "tensorstore", "transformers", "torch",
            "numpy")
SUMMARY_KEYS = ("eval_accuracy_start", "eval_accuracy_end", "trainer_steps", "samples_generated",
                "trainer_wait_s", "wall_time_s", "policy_lag_mean")


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=REPO, text=True, **kw)


def installed_versions(python: str) -> dict[str, str | None]:
    code = ("import importlib.metadata as m, json, sys\n"
            f"names = {list(PACKAGES)!r}\n"
            "def v(n):\n"
            "    try:\n        return m.version(n)\n"
            "    except m.PackageNotFoundError:\n        return None\n"
            "print(json.dumps({'python': sys.version.split()[0], **{n: v(n) for n in names}}))")
    return json.loads(run([python, "-c", code], capture_output=True, check=True).stdout)


def test_results(junit: Path, output: str) -> dict[str, Any]:
    """Counts from pytest's JUnit XML, and the ids of the tests that failed or errored."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    not_passed = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"  # JUnit's dotted module (and class) path
        kinds = {child.tag for child in case}
        if "failure" in kinds:
            counts["failed"] += 1
            not_passed.append(name)
        elif "error" in kinds:
            counts["errors"] += 1
            not_passed.append(name)
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    last = [ln for ln in output.strip().splitlines() if re.search(r"\d+ (passed|failed)", ln)]
    return {**counts, "not_passed": not_passed, "pytest_summary": last[-1] if last else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", required=True, help="the interpreter to build the venv with")
    ap.add_argument("--venv", help="venv directory (default: a temporary one, removed after)")
    ap.add_argument("--json", required=True, help="write the results here")
    ap.add_argument("--skip-default-run", action="store_true", help="tests only")
    args = ap.parse_args()

    venv = Path(args.venv or tempfile.mkdtemp(prefix="tbajax-venv-"))
    py = str(venv / "bin" / "python")
    reused = Path(py).exists()  # then install_s is pip's check of an installed venv, not an install
    try:
        if not reused:
            run([args.python, "-m", "venv", str(venv)], check=True)
        t0 = time.perf_counter()
        run([py, "-m", "pip", "install", "-q", "-e", ".[dev]"], check=True)
        install_s = time.perf_counter() - t0
        versions = installed_versions(py)
        print(json.dumps(versions), flush=True)

        junit = venv / "junit.xml"
        t0 = time.perf_counter()
        tests = run([py, *TEST_COMMAND, f"--junitxml={junit}"], capture_output=True)
        tests_s = time.perf_counter() - t0
        print(tests.stdout[-3000:], tests.stderr[-2000:], flush=True)
        if not junit.exists():
            sys.exit(f"pytest wrote no report (exit {tests.returncode}); its output is above")
        result: dict[str, Any] = {
            "versions": versions, "install_s": install_s, "venv_reused": reused,
            "tests": {**test_results(junit, tests.stdout), "exit_code": tests.returncode, "seconds": tests_s},
        }
        if not args.skip_default_run:
            run_dir = venv / "default_run"
            shutil.rmtree(run_dir, ignore_errors=True)
            main_run = run([py, "-m", "tbajax.main", f"--run-dir={run_dir}"], capture_output=True)
            print(main_run.stdout[-1500:], main_run.stderr[-1500:], flush=True)
            summary_path = run_dir / "summary.json"
            summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
            result["default_run"] = {
                "exit_code": main_run.returncode,
                **{k: summary.get(k) for k in SUMMARY_KEYS},
                "matmul_gflops": (summary.get("machine") or {}).get("matmul_gflops"),
            }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    finally:
        if not args.venv:
            shutil.rmtree(venv, ignore_errors=True)


if __name__ == "__main__":
    main()
