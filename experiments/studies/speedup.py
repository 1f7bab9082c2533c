"""Study 3: wall-clock gain of asynchrony and of more searchers.

    python experiments/studies/speedup.py [--steps 150] [--seeds 2] [--target 0.6] [--quick]

Runs the default experiment with the same objective, batch and number of trainer steps in the
synchronous mode (one process: generate with the current params, then train) and asynchronously
with 1, 2 and 3 searcher processes. Reports the wall time of the whole run, seconds per trainer
step, the time until held-out accuracy first reaches `--target`, and the speed-up over sync next
to its ideal bound. The bound comes from the sync run's own timings: with T_gen and T_train the
per-step generation and training times, N searchers can at best give
(T_gen + T_train) / max(T_gen / N, T_train). The bound assumes every process has its own
hardware; on a CPU machine all processes share the same cores. Claim under test (TBA paper):
asynchrony gives large wall-clock speed-ups and more searchers help.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
from common import (
    Arm,
    base_overrides,
    by_group,
    markdown_table,
    output_dir,
    plot_curves,
    provenance,
    run_study,
    study_parser,
    write_results,
)

SEARCHERS = (1, 2, 3)


def arms(searchers: tuple[int, ...], seeds: int) -> list[Arm]:
    out = []
    for s in range(seeds):
        out.append(Arm(group="sync", overrides=("system.mode=sync",), seed=s, params=(("searchers", 0),)))
        out += [
            Arm(group=f"async, {n} searcher{'s' if n > 1 else ''}", seed=s, params=(("searchers", n),),
                overrides=("system.mode=async", f"system.num_searchers={n}"))
            for n in searchers
        ]
    return out


def ideal_bound(t_gen: float, t_train: float, searchers: int) -> float:
    """Overlap bound: the slower of (generation split over N searchers) and training sets the pace."""
    return (t_gen + t_train) / max(t_gen / searchers, t_train)


def main(argv: list[str] | None = None) -> Path:
    ap = study_parser(__doc__, default_steps=150)
    ap.add_argument("--target", type=float, default=0.6, help="held-out accuracy to time (default %(default)s)")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps = min(args.steps, 6)
    seeds = args.seeds or (1 if args.quick else 2)
    searchers = (1,) if args.quick else SEARCHERS
    eval_every, eval_problems = (3, 16) if args.quick else (max(1, args.steps // 10), 300)
    common = base_overrides(args, eval_every, eval_problems)
    results = run_study("speedup", args, arms(searchers, seeds), common)

    groups = by_group(results)
    sync = groups["sync"]
    steps = np.mean([r.summary["trainer_steps"] for r in sync])
    t_gen = float(np.mean([r.generate_s for r in sync])) / steps
    t_train = float(np.mean([r.train_s for r in sync])) / steps
    sync_wall = float(np.mean([r.wall_s for r in sync]))
    sync_ttt = _mean_time_to(sync, args.target)
    rows = []
    figures = {"t_gen_s": t_gen, "t_train_s": t_train, "target": args.target, "arms": {}}
    for name, runs in groups.items():
        n = runs[0].arm.param("searchers")
        wall = float(np.mean([r.wall_s for r in runs]))
        ttt = _mean_time_to(runs, args.target)
        reached = sum(r.time_to(args.target) is not None for r in runs)
        bound = 1.0 if n == 0 else ideal_bound(t_gen, t_train, n)
        speed = sync_wall / wall
        speed_ttt = (sync_ttt / ttt) if (sync_ttt and ttt) else None
        figures["arms"][name] = {"wall_s": wall, "speedup": speed, "ideal": bound, "time_to_target_s": ttt,
                                 "reached": reached, "final_accuracy": float(np.mean([r.final_accuracy for r in runs]))}
        rows.append([
            name, len(runs), f"{wall:.0f}", f"{wall / steps:.3f}", f"{speed:.2f}x", f"{bound:.2f}x",
            "—" if n == 0 else f"{100 * (speed - 1) / max(bound - 1, 1e-9):.0f}%",
            f"{ttt:.0f} ({reached}/{len(runs)})" if ttt is not None else f"not reached (0/{len(runs)})",
            f"{speed_ttt:.2f}x" if speed_ttt else "—",
            f"{100 * np.mean([r.final_accuracy for r in runs]):.1f}",
            f"{np.mean([r.mean_lag for r in runs]):.2f}",
        ])
    table = markdown_table(
        ["mode", "seeds", "wall s", "s / step", "speed-up (wall)", "ideal bound", "share of ideal gain",
         f"s to acc ≥ {args.target} (runs that got there)", "speed-up to target", "final acc %", "mean lag (versions)"],
        rows,
    )
    out = output_dir("speedup", args)
    plot_curves(out / "accuracy_vs_time.png", groups, "held-out accuracy vs wall time", target=args.target)
    _plot_speedups(out / "speedup.png", figures["arms"])
    sections = [
        (f"Per-step times of the sync run (same process, no overlap): T_gen = {t_gen:.3f} s, T_train = {t_train:.3f} s; "
         "ideal bound with N searchers = (T_gen + T_train) / max(T_gen / N, T_train), i.e. every process on its "
         "own hardware."), "",
        table, "", "![accuracy vs time](accuracy_vs_time.png)", "", "![speed-up](speedup.png)", "",
    ]
    md = write_results(out, "Study 3: asynchrony and searcher count", provenance(args, common), results, sections,
                       extra={"figures": figures}, json_path=args.json)
    print(table)
    print(f"wrote {md}")
    return md


def _mean_time_to(runs, target: float) -> float | None:
    times = [r.time_to(target) for r in runs]
    times = [t for t in times if t is not None]
    return float(np.mean(times)) if times else None


def _plot_speedups(path: Path, arms: dict) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(arms)
    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(len(names))
    ax.bar(x - 0.2, [arms[n]["speedup"] for n in names], 0.4, label="measured (wall time)")
    ax.bar(x + 0.2, [arms[n]["ideal"] for n in names], 0.4, label="ideal overlap bound", alpha=0.6)
    ax.axhline(1.0, color="gray", lw=1)
    ax.set_xticks(x, names, rotation=15)
    ax.set_ylabel("speed-up over sync")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
