"""Start-up with and without the persistent compilation cache (`system.compile_cache`).

    python experiments/benchmarks/compile_cache.py [--steps 60] [--rounds 2] [--json PATH]

Every role of a run is its own process and compiles its programs when it starts: the searcher
its generate buckets, the trainer its step and its evaluation. A restarted role, a resumed run
and the next run of an experiment compile the same programs again, unless they find them in the
cache. Each round runs the embedded default experiment (`python -m tbajax.main`, --steps trainer
steps) three times, one after the other: with the cache off (the reference), with an empty cache
directory ("cold": compiles and writes) and again on that directory ("warm": loads). Per run:
the launcher's wall time, the trainer's wait for data, the searcher's first generate call and the
trainer's first evaluation (both include their compiles), and the cache's size after it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT)]

from common import machine, machine_line, print_table, write_json  # noqa: E402


def first_records(run_dir: Path) -> dict[str, float]:
    """The searcher's first generate call and the trainer's first evaluation, from metrics.jsonl."""
    out: dict[str, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("role") == "searcher-0" and rec.get("calls") == 1:
            out.setdefault("first_generate_s", rec["generate_s"])
        if rec.get("role") == "trainer" and "eval_score" in rec:
            out.setdefault("first_eval_s", rec["elapsed_s"])
    return out


def cache_size(directory: Path | None) -> tuple[int, float]:
    if directory is None or not directory.exists():
        return 0, 0.0
    files = [p for p in directory.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files) / 2**20


def run_once(arm: str, cache: Path | None, steps: int, work: Path) -> dict[str, Any]:
    run_dir = work / f"run-{arm}-{time.time_ns()}"
    setting = "null" if cache is None else json.dumps(str(cache))
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    cmd = [sys.executable, "-m", "tbajax.main", f"--run-dir={run_dir}", "--quiet",
           "--set", f"train.steps={steps}", "--set", f"system.compile_cache={setting}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{arm} run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    files, mb = cache_size(cache)
    return {"arm": arm, "launcher_wall_s": wall, "run_wall_s": summary["wall_time_s"],
            "trainer_wait_s": summary["trainer_wait_s"], **first_records(run_dir),
            "cache_files": files, "cache_mb": mb}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", help="write the figures to this path")
    args = ap.parse_args()
    info = machine()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-compile-cache-") as d:
        work = Path(d)
        for r in range(args.rounds):
            cache = work / f"xla-{r}"
            for arm, where in (("off", None), ("cold", cache), ("warm", cache)):
                row = {"round": r, **run_once(arm, where, args.steps, work)}
                print(f"round {r} {arm}: launcher {row['launcher_wall_s']:.1f} s, first generate "
                      f"{row.get('first_generate_s', float('nan')):.2f} s", flush=True)
                rows.append(row)
    keys = ["launcher_wall_s", "run_wall_s", "trainer_wait_s", "first_generate_s", "first_eval_s"]
    medians = []
    for arm in ("off", "cold", "warm"):
        mine = [r for r in rows if r["arm"] == arm]
        medians.append({"arm": arm, **{k: statistics.median(r[k] for r in mine if k in r) for k in keys}})
    off = medians[0]
    for m in medians:
        m["wall_vs_off"] = m["launcher_wall_s"] / off["launcher_wall_s"]
        m["first_generate_vs_off"] = m["first_generate_s"] / off["first_generate_s"]
    print(f"default experiment, {args.steps} trainer steps, median of {args.rounds} rounds")
    print(machine_line(info))
    print_table(medians, ["arm", *keys, "wall_vs_off", "first_generate_vs_off"])
    write_json(args.json, {"benchmark": "compile_cache", "steps": args.steps, "machine": info,
                           "medians": medians, "rows": rows})


if __name__ == "__main__":
    main()
