"""Study 2: robustness to off-policy data, TB against Dr. GRPO.

    python experiments/studies/off_policy.py [--steps 150] [--seeds 3] [--quick] [--out DIR]

Two knobs make the trained data more off-policy in TBA: the sync period k (searchers sample with
params up to k trainer steps old and the trainer replays their data until the next sync) and the
recency probability m (with probability 1 − m a group is drawn from the whole buffer, by reward,
not from the latest sync's data). Sweep k at the base m, and m at the base k, for `tb` and
`dr_grpo` on the default experiment; everything else is fixed. The study uses the reference's
buffer semantics (recent groups may be replayed any number of times, searchers keep sampling
between syncs), because that reuse is exactly what k and m control; the default experiment
instead caps reuse at one draw per group (`buffer.max_recent_uses=1`). Claim under test (TBA paper): TB
degrades far less than GRPO-style objectives as the data get more off-policy. Writes results.md,
results.json and PNG plots under experiments/results/off_policy/.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    Arm,
    base_overrides,
    by_group,
    fmt_mean_std,
    markdown_table,
    output_dir,
    provenance,
    run_study,
    study_parser,
    write_results,
)

OBJECTIVES = ("tb", "dr_grpo")
SYNC_PERIODS = (1, 2, 8, 32)
RECENCY = (0.2, 0.5, 0.95)
BASE_K, BASE_M = 2, 0.95
REFERENCE_BUFFER = ("buffer.max_recent_uses=null", "buffer.recency_fallback=reward", "rollout.max_calls_per_version=null")


def arms(objectives, ks, ms, seeds: int) -> list[Arm]:
    points = [(k, BASE_M) for k in ks] + [(BASE_K, m) for m in ms if (BASE_K, m) not in [(k, BASE_M) for k in ks]]
    return [
        Arm(
            group=f"{o} k={k} m={m}", seed=s, params=(("objective", o), ("k", k), ("m", m)),
            overrides=(f"train.objective={o}", f"system.sync_every={k}", f"buffer.recency_prob={m}", *REFERENCE_BUFFER),
        )
        for s in range(seeds) for o in objectives for k, m in points
    ]


def plot_sweep(path: Path, results, knob: str, fixed: tuple[str, float], title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, o in enumerate(OBJECTIVES):
        pts = by_group([r for r in results if r.arm.param("objective") == o and r.arm.param(fixed[0]) == fixed[1]],
                       key=lambda r: r.arm.param(knob))
        xs = sorted(pts)
        for x in xs:  # each seed's run, faint, beside the mean
            ax.scatter([x] * len(pts[x]), [r.final_accuracy for r in pts[x]], color=f"C{i}", alpha=0.3, s=12)
        means = [np.mean([r.final_accuracy for r in pts[x]]) for x in xs]
        seeds = max(len(pts[x]) for x in xs) if xs else 1
        ax.plot(xs, means, "o-", color=f"C{i}", label=o + (f" (mean of {seeds} seeds)" if seeds > 1 else ""))
    if results:
        ax.axhline(results[0].start_accuracy, color="gray", ls="--", lw=1, label="start")
    if knob == "k":
        ax.set_xscale("log", base=2)
    ax.set_xlabel({"k": "sync period k (trainer steps)", "m": "recency probability m"}[knob])
    ax.set_ylabel("final held-out accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def sweep_table(results, knob: str, fixed: tuple[str, float]) -> str:
    values = sorted({r.arm.param(knob) for r in results if r.arm.param(fixed[0]) == fixed[1]})
    rows = []
    for v in values:
        row = [f"{knob} = {v}"]
        for o in OBJECTIVES:
            runs = [r for r in results if r.arm.param("objective") == o and r.arm.param(knob) == v
                    and r.arm.param(fixed[0]) == fixed[1]]
            row.append(fmt_mean_std([r.final_accuracy for r in runs]) if runs else "—")
            row.append(f"{sum(r.mean_lag for r in runs) / len(runs):.2f}" if runs else "—")
        rows.append(row)
    header = [f"{knob} ({fixed[0]} = {fixed[1]})"]
    for o in OBJECTIVES:
        header += [f"`{o}` final acc %", f"`{o}` mean lag (versions)"]
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> Path:
    args = study_parser(__doc__, default_steps=150).parse_args(argv)
    if args.quick:
        args.steps = min(args.steps, 6)
    seeds = args.seeds or (1 if args.quick else 3)
    ks, ms = ((4,), ()) if args.quick else (SYNC_PERIODS, RECENCY)
    eval_every, eval_problems = (3, 16) if args.quick else (max(1, args.steps // 6), 300)
    common = base_overrides(args, eval_every, eval_problems)
    results = run_study("off_policy", args, arms(OBJECTIVES, ks, ms, seeds), common)

    out = output_dir("off_policy", args)
    plot_sweep(out / "sync_period.png", results, "k", ("m", BASE_M), f"final accuracy vs sync period (m = {BASE_M})")
    plot_sweep(out / "recency.png", results, "m", ("k", BASE_K), f"final accuracy vs recency probability (k = {BASE_K})")
    k_table = sweep_table(results, "k", ("m", BASE_M))
    m_table = sweep_table(results, "m", ("k", BASE_K))
    start = results[0].start_accuracy if results else float("nan")
    sections = [
        "All arms: " + ", ".join(f"`{o}`" for o in REFERENCE_BUFFER) + " (reference TBA buffer semantics).", "",
        f"Start accuracy (the shipped checkpoint, greedy): {100 * start:.1f}%.", "",
        "## Sync period k", "", k_table, "", "![sync period](sync_period.png)", "",
        "## Recency probability m", "", m_table, "", "![recency](recency.png)", "",
    ]
    md = write_results(out, "Study 2: off-policyness, TB vs Dr. GRPO", provenance(args, common), results, sections,
                       json_path=args.json)
    print(k_table)
    print(m_table)
    print(f"wrote {md}")
    return md


if __name__ == "__main__":
    main()
