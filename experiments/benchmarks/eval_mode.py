"""Evaluation inline (in the trainer) vs in the evaluator process: the same experiment, steps and
evaluation schedule, one run each, in the same session.

    python experiments/benchmarks/eval_mode.py [--experiment tiny_arithmetic] [--steps 40]
        [--eval-every 10] [--json PATH] [--set key=value ...]

Figures per mode: the launcher's wall time (start-up, compilation, training, the final evaluation
and the shutdown: what a user waits for), the trainer's step-loop wall time (first to last step
record: inline evaluations are inside it, the evaluator's are not), the trainer's wall time in
summary.json, and how long the trainer waited for the evaluator's final result. Ratios are
process / inline. On a 2-core CPU machine the
evaluator shares the cores with the trainer and the searcher, so overlap buys less than on a
machine with a device per role.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine, print_table, write_json  # noqa: E402

from tbajax.system.metrics import eval_records, read_metrics  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def run(mode: str, run_dir: Path, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable, "-m", "tbajax.main", f"--experiment={args.experiment}", f"--run-dir={run_dir}",
        "--quiet", "--set", f"train.steps={args.steps}", "--set", f"eval.every={args.eval_every}",
        "--set", f"eval.mode={mode}", "--set", "train.log_every=1",
        "--set", f"train.checkpoint_every={args.steps}",
    ]
    for item in args.set:
        cmd += ["--set", item]
    load_before = os.getloadavg()[0]
    t0 = time.time()
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    launcher_s = time.time() - t0
    steps = [r for r in read_metrics(run_dir, "trainer") if "step_time_s" in r]
    summary = json.loads((run_dir / "summary.json").read_text())
    evals = eval_records(run_dir)
    return {
        "mode": mode,
        "launcher_wall_s": launcher_s,
        "loop_wall_s": steps[-1]["time"] - steps[0]["time"],
        "trainer_wall_s": summary["wall_time_s"],
        "trainer_wait_s": summary["trainer_wait_s"],
        "eval_wait_s": summary.get("eval_wait_s", 0.0),
        "eval_steps": [int(r["step"]) for r in evals],
        "eval_score_start": summary["eval_score_start"],
        "eval_score_end": summary["eval_score_end"],
        "evaluator_eval_s": sum(float(r.get("eval_s", 0.0)) for r in evals if r.get("role") == "evaluator"),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg()[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiment", default="tiny_arithmetic")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    info = machine()
    rows = []
    with tempfile.TemporaryDirectory(prefix="eval-mode-") as tmp:
        for mode in ("inline", "process"):
            rows.append(run(mode, Path(tmp) / mode, args))
            print(f"{mode}: {rows[-1]['launcher_wall_s']:.1f} s", flush=True)
    inline, process = rows
    ratios = {k: process[k] / inline[k] for k in ("launcher_wall_s", "loop_wall_s", "trainer_wall_s")
              if inline[k] > 0}
    print_table(rows, ["mode", "launcher_wall_s", "loop_wall_s", "trainer_wall_s", "trainer_wait_s",
                       "eval_wait_s", "eval_score_start", "eval_score_end"])
    print("process / inline: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    print(f"machine: {info['cpu_count']} CPUs, {info['matmul_gflops']:.1f} GFLOP/s fp32 matmul, "
          f"load {info['load_average_1m']}")
    write_json(args.json, {"experiment": args.experiment, "steps": args.steps, "eval_every": args.eval_every,
                           "overrides": args.set, "runs": rows, "process_over_inline": ratios,
                           "machine": info})


if __name__ == "__main__":
    main()
