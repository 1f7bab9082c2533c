"""Wall time of the default test run (the README's test command) under XLA:CPU compile flags.

    python experiments/benchmarks/test_suite.py [--arms fast_compile mlir_emitters] [--json PATH]

Most of the default test run is XLA compiling small programs, and the run has to stay under 10
minutes on the slowest 2-core CI machine. `tests/conftest.py` compiles with two flags that make
that cheaper (`FAST_COMPILE_FLAGS`); each arm here runs the whole suite (`pytest -q -n 2 --dist
loadgroup`, a fresh compilation cache each time) with XLA_FLAGS set as the arm says, one arm
after the other, and records its wall time, its pass / fail counts and the machine's fp32 matmul
rate measured just before it (the machine drifts; quote the ratio, not the seconds).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT)]

from common import machine, machine_line, print_table, write_json  # noqa: E402

DEVICES = "--xla_force_host_platform_device_count=8"  # what conftest sets when XLA_FLAGS is unset
ARMS: dict[str, str | None] = {
    # conftest's flags (level 0 + the older fusion emitters): XLA_FLAGS left unset, as in CI
    "fast_compile": None,
    # level 0 only: XLA:CPU's MLIR fusion emitters, as before conftest added the second flag
    "mlir_emitters": f"{DEVICES} --xla_cpu_use_fusion_emitters=true",
    # XLA's defaults throughout, as benchmarks and real runs compile
    "xla_defaults": f"{DEVICES} --xla_backend_optimization_level=2 --xla_cpu_use_fusion_emitters=true",
}
TEST_COMMAND = ["-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider"]


def run_suite(xla_flags: str | None, extra: list[str]) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *TEST_COMMAND, *extra], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    wall = time.perf_counter() - t0
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", tail)}
    return {"wall_s": wall, "rc": proc.returncode, "summary": tail, **counts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=["fast_compile", "mlir_emitters"])
    ap.add_argument("--pytest-args", nargs=argparse.REMAINDER, default=[],
                    help="extra pytest arguments (e.g. a test file), after everything else")
    ap.add_argument("--json", help="write the figures to this path")
    args = ap.parse_args()
    rows = []
    for name in args.arms:
        info = machine()
        print(f"{name}: XLA_FLAGS={ARMS[name]!r}; {machine_line(info)}", flush=True)
        row = {"arm": name, "xla_flags": ARMS[name], "matmul_gflops": info["matmul_gflops"],
               **run_suite(ARMS[name], args.pytest_args)}
        print(f"  {row['wall_s']:.0f} s: {row['summary']}", flush=True)
        rows.append(row)
    for row in rows:
        row["x_first_arm"] = row["wall_s"] / rows[0]["wall_s"]
    print_table(rows, ["arm", "wall_s", "x_first_arm", "passed", "failed", "skipped", "matmul_gflops"])
    command = " ".join(["python", *TEST_COMMAND, *args.pytest_args])
    write_json(args.json, {"benchmark": "test_suite", "command": command, "machine": machine(), "rows": rows})
    if any(r["rc"] != 0 for r in rows):
        raise SystemExit("a test run failed: see the summaries above")


if __name__ == "__main__":
    main()
