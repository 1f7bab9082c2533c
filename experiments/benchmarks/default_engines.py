"""The default experiment with the static vs the continuous searcher engine: same machine, same
session, same run length, one run each.

    python experiments/benchmarks/default_engines.py [--experiment tiny_arithmetic] [--steps N]
        [--slots 128] [--chunk 3] [--baseline REV] [--json PATH] [--set key=value ...]

Figures per engine (from each run's summary.json): how long the trainer waited for data
(`trainer_wait_s`), samples generated, the trainer's wall time, and the greedy accuracy at the
start and the end (the run must still reach its target). The continuous engine refills a decode
slot as soon as its sample ends and swaps in new params between chunks; the static one decodes
each call's batch until its longest sample ends, and loads new params between calls.

`--searcher-devices N` adds a third run: the static engine with N host devices for the searcher
(`system.cpu_devices_per_searcher=N`: its batches split over a data mesh of one device per core),
with its ratios over the one-device static run (`devices_over_static`).

`--baseline REV` first runs the static engine with the code of git revision REV (exported with
`git archive` into a temporary directory and run from there), so that a change's effect on the
default run is measured on the same machine in the same session; the ratios are this
checkout's static run over the baseline's (`static_over_baseline` in the JSON).
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

REPO = Path(__file__).resolve().parents[2]


def export_revision(rev: str, into: Path) -> Path:
    """The tree of git revision `rev` of this repository, extracted under `into`."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def run(engine: str, run_dir: Path, args: argparse.Namespace, source: Path = REPO,
        extra: tuple[str, ...] = ()) -> dict:
    """One run of the experiment with the code under `source` (this checkout, or a baseline's tree),
    with the `--set` overrides `extra` on top of the command line's."""
    env = dict(os.environ)
    if source != REPO:  # the baseline's tbajax, not the installed (editable) one
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(source), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "tbajax.main", f"--experiment={args.experiment}", f"--run-dir={run_dir}",
           "--quiet", "--set", f"rollout.engine={engine}"]
    if args.steps:
        cmd += ["--set", f"train.steps={args.steps}"]
    if engine == "continuous":
        cmd += ["--set", f"rollout.decode_slots={args.slots}", "--set", f"rollout.decode_chunk={args.chunk}"]
    for item in (*args.set, *extra):
        cmd += ["--set", item]
    load_before = os.getloadavg()[0]
    t0 = time.time()
    subprocess.run(cmd, cwd=source, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    s = json.loads((run_dir / "summary.json").read_text())
    return {
        "engine": engine,
        "overrides": list(extra),
        "launcher_wall_s": time.time() - t0,
        "trainer_wall_s": s["wall_time_s"],
        "trainer_wait_s": s["trainer_wait_s"],
        "wait_share": s["trainer_wait_s"] / s["wall_time_s"],
        "samples_generated": s["samples_generated"],
        "trainer_steps": s["trainer_steps"],
        "eval_score_start": s["eval_score_start"],
        "eval_score_end": s["eval_score_end"],
        "policy_lag_mean": s["policy_lag_mean"],
        "load_average_before": load_before,
        "load_average_after": os.getloadavg()[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiment", default="tiny_arithmetic")
    ap.add_argument("--steps", type=int, default=0, help="train.steps (0: the experiment's own)")
    ap.add_argument("--slots", type=int, default=128, help="rollout.decode_slots of the continuous run")
    ap.add_argument("--chunk", type=int, default=3, help="rollout.decode_chunk of the continuous run")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="for both runs")
    ap.add_argument("--baseline", metavar="REV", help="also run the static engine with the code of this git revision")
    ap.add_argument("--searcher-devices", type=int, default=0, metavar="N",
                    help="also run the static engine with system.cpu_devices_per_searcher=N")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    info = machine()
    rows = []
    baseline = None
    with tempfile.TemporaryDirectory(prefix="engines-") as tmp:
        if args.baseline:
            commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", args.baseline], check=True,
                                    capture_output=True, text=True).stdout.strip()
            baseline = {**run("static", Path(tmp) / "baseline", args, export_revision(commit, Path(tmp) / "src")),
                        "revision": commit}
            print(f"baseline {commit[:10]}: {baseline['trainer_wall_s']:.1f} s, waited "
                  f"{baseline['trainer_wait_s']:.1f} s", flush=True)
        for engine in ("static", "continuous"):
            rows.append(run(engine, Path(tmp) / engine, args))
            print(f"{engine}: {rows[-1]['trainer_wall_s']:.1f} s, waited {rows[-1]['trainer_wait_s']:.1f} s", flush=True)
        devices = None
        if args.searcher_devices:
            devices = run("static", Path(tmp) / "devices", args,
                          extra=(f"system.cpu_devices_per_searcher={args.searcher_devices}",))
            print(f"static, {args.searcher_devices} searcher devices: {devices['trainer_wall_s']:.1f} s, "
                  f"waited {devices['trainer_wait_s']:.1f} s", flush=True)
    static, cont = rows
    keys = ("trainer_wait_s", "samples_generated", "trainer_wall_s")
    devices_ratios = ({k: devices[k] / max(static[k], 1e-9) for k in keys} if devices is not None else None)
    ratios = {"trainer_wait_s": cont["trainer_wait_s"] / max(static["trainer_wait_s"], 1e-9),
              "samples_generated": cont["samples_generated"] / static["samples_generated"],
              "trainer_wall_s": cont["trainer_wall_s"] / static["trainer_wall_s"]}
    print_table(rows, ["engine", "trainer_wall_s", "trainer_wait_s", "wait_share", "samples_generated",
                       "eval_score_start", "eval_score_end", "policy_lag_mean"])
    print("continuous / static: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    if devices is not None:
        print_table([devices], ["overrides", "trainer_wall_s", "trainer_wait_s", "wait_share",
                                "samples_generated", "eval_score_start", "eval_score_end", "policy_lag_mean"])
        print(f"{args.searcher_devices} searcher devices / static: "
              + ", ".join(f"{k} {v:.2f}x" for k, v in devices_ratios.items()))
    baseline_ratios = None
    if baseline is not None:
        baseline_ratios = {k: static[k] / max(baseline[k], 1e-9)
                           for k in ("trainer_wait_s", "samples_generated", "trainer_wall_s")}
        print_table([baseline], ["revision", "trainer_wall_s", "trainer_wait_s", "wait_share", "samples_generated",
                                 "eval_score_start", "eval_score_end", "policy_lag_mean"])
        print("static / baseline static: " + ", ".join(f"{k} {v:.2f}x" for k, v in baseline_ratios.items()))
    print(f"machine: {info['cpu_count']} CPUs, {info['matmul_gflops']:.1f} GFLOP/s fp32 matmul, "
          f"load {info['load_average_1m']}")
    write_json(args.json, {"benchmark": "default_engines", "experiment": args.experiment,
                           "steps": args.steps or None, "slots": args.slots, "chunk": args.chunk,
                           "overrides": args.set, "runs": rows, "continuous_over_static": ratios,
                           "baseline": baseline, "static_over_baseline": baseline_ratios,
                           "searcher_devices": args.searcher_devices or None, "devices_run": devices,
                           "devices_over_static": devices_ratios,
                           "machine": info})


if __name__ == "__main__":
    main()
