"""Asynchrony speed-up: the same experiment and number of trainer steps, sync vs async, one run.

    python experiments/benchmarks/async_speedup.py [--experiment tiny_arithmetic] [--steps 60]
        [--searchers 1] [--quick] [--json PATH] [--set key=value ...]

The sync run (one process, generate-then-train on the current params) measures the per-step
generation time T_gen and training time T_train; the ideal speed-up of overlapping them is
(T_gen + T_train) / max(T_gen, T_train). The async run (trainer + searcher processes) is timed
over the same steps. Wall time counts from the first to the last trainer step (start-up and
compilation excluded on both sides). Busy fractions: time each side spent computing / wall.
Note: on a CPU machine the processes share the cores, so overlap buys less than on separate GPUs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine, print_table, write_json  # noqa: E402

from tbajax.system.metrics import read_metrics  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def run(mode: str, run_dir: Path, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable, "-m", "tbajax.main", f"--experiment={args.experiment}", f"--mode={mode}",
        f"--run-dir={run_dir}", "--quiet", "--set", f"train.steps={args.steps}",
        "--set", f"system.num_searchers={args.searchers}", "--set", "eval.every=0",
        "--set", "eval.num_problems=16", "--set", "train.log_every=1",
    ]
    for item in args.set:
        cmd += ["--set", item]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    steps = [r for r in read_metrics(run_dir, "trainer") if "step_time_s" in r]
    # wall over steps 2..N (step 1 includes compilation on the trainer side)
    wall = steps[-1]["time"] - steps[0]["time"]
    n = len(steps) - 1
    train_s = sum(r["step_time_s"] for r in steps[1:])
    if mode == "sync":
        gen_s = sum(r["generate_s"] for r in steps[1:])
        searcher_busy = gen_s / wall
    else:
        t0, t1 = steps[0]["time"], steps[-1]["time"]
        gen = [r for r in read_metrics(run_dir) if r["role"].startswith("searcher") and t0 <= r["time"] <= t1]
        gen_s = sum(r["generate_s"] for r in gen)
        searcher_busy = gen_s / (wall * args.searchers)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "mode": mode,
        "steps_timed": n,
        "wall_s": wall,
        "s_per_step": wall / n,
        "train_s_per_step": train_s / n,
        "gen_s_per_step": gen_s / n if mode == "sync" else float("nan"),
        "trainer_busy": train_s / wall,
        "searcher_busy": searcher_busy,
        "samples": summary["samples_generated"],
        "eval_end": summary["eval_accuracy_end"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiment", default="tiny_arithmetic")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--searchers", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="12 steps")
    ap.add_argument("--set", action="append", default=[], help="extra config overrides for both runs")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.quick:
        args.steps = 12
    base = Path(tempfile.mkdtemp(prefix="async-speedup-"))
    sync = run("sync", base / "sync", args)
    asyn = run("async", base / "async", args)
    t_gen, t_train = sync["gen_s_per_step"], sync["train_s_per_step"]
    ideal = (t_gen + t_train) / max(t_gen, t_train)
    speedup = sync["s_per_step"] / asyn["s_per_step"]
    print(f"{args.experiment}: {args.steps} trainer steps, {args.searchers} searcher(s), {machine()['cpu_count']} CPU cores")
    print_table([sync, asyn], ["mode", "steps_timed", "wall_s", "s_per_step", "train_s_per_step", "gen_s_per_step",
                               "trainer_busy", "searcher_busy", "samples", "eval_end"])
    print(f"speed-up async vs sync: {speedup:.2f}x; ideal overlap bound (T_gen + T_train) / max = {ideal:.2f}x "
          f"(T_gen {t_gen:.3f}s, T_train {t_train:.3f}s per step, from the sync run); "
          f"fraction of the bound reached: {(speedup - 1) / max(ideal - 1, 1e-9):.2f}")
    write_json(args.json, {"benchmark": "async_speedup", "machine": machine(), "args": vars(args),
                           "sync": sync, "async": asyn, "speedup": speedup, "ideal_bound": ideal})


if __name__ == "__main__":
    main()
