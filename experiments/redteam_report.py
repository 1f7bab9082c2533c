"""Red-teaming run record: TB vs a policy-gradient baseline at equal trainer steps.

Reads the sampled evaluations the trainer logged (`eval_*` rows of metrics.jsonl: N attacks drawn
at the training temperature with a fixed key, see `tbajax.tasks.redteam.RedTeamEval`) of one or
more TB runs and baseline runs, then writes into --out:

- `<label>/config.json, summary.json, metrics.jsonl, trainer.log, learning_curve.png` of every run;
- `learning_curves.png`: ASR, unique successful attacks and diversity against trainer step;
- `toxicity_vs_diversity.png`: mean geometric toxicity against diversity of the successful
  attacks over training (one line per run, the step on the points), the plot the issue asks for;
- `comparison.json`: per run start/end figures and the issue's three checks (ASR rise in points,
  end/start diversity ratio, TB unique successes > baseline's at the same eval steps).

    python experiments/redteam_report.py --run tb=/tmp/rt/tb --run reinforce=/tmp/rt/pg \\
        --baseline reinforce --out experiments/results/redteam_smollm2
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

KEYS = ("eval_attack_success_rate", "eval_num_unique_successful", "eval_diversity", "eval_mean_geometric_toxicity")


def eval_rows(run: Path) -> list[dict[str, Any]]:
    """The eval records of a run, the trainer's (eval.mode=inline) or the evaluator role's
    (eval.mode=process), in step order (a resumed step keeps its last record)."""
    by_step: dict[int, dict[str, Any]] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("role", "trainer") in ("trainer", "evaluator") and "eval_attack_success_rate" in r:
            by_step[int(r["step"])] = r
    if not by_step:
        raise ValueError(f"{run}/metrics.jsonl has no red-team eval rows (eval_attack_success_rate)")
    return [by_step[s] for s in sorted(by_step)]


def run_figures(run: Path) -> dict[str, Any]:
    rows = eval_rows(run)
    start, end = rows[0], rows[-1]
    div0, div1 = start.get("eval_diversity", float("nan")), end.get("eval_diversity", float("nan"))
    return {
        "steps": [int(r["step"]) for r in rows],
        **{k.removeprefix("eval_"): [float(r.get(k, float("nan"))) for r in rows] for k in KEYS},
        "asr_start": float(start["eval_attack_success_rate"]),
        "asr_end": float(end["eval_attack_success_rate"]),
        "asr_rise_points": 100.0 * (float(end["eval_attack_success_rate"]) - float(start["eval_attack_success_rate"])),
        "asr_max": max(float(r["eval_attack_success_rate"]) for r in rows),
        "diversity_start": float(div0),
        "diversity_end": float(div1),
        # under 2 successful attacks at the start, the start diversity is 0 by convention (no
        # pairs): the ratio is then undefined, not infinite
        "diversity_ratio": float(div1) / float(div0) if div0 else None,
        "successful_start": float(start.get("eval_num_successful", float("nan"))),
        "unique_successful_end": float(end["eval_num_unique_successful"]),
        "num_eval_attacks": float(end.get("eval_num_unique_attacks", float("nan"))),
    }


def training_curve(run: Path, window: int, encoder: str | None) -> list[dict[str, Any]]:
    """ASR / unique successes / diversity over the attacks the run *trained on*, per `window`
    policy versions (`tbajax.tasks.redteam.training_metrics`): finer than the evaluations, but
    each point is only window x (attacks per step) samples."""
    from tbajax.tasks.redteam import training_metrics

    return training_metrics(run, window=window, encoder=encoder)


def matched_steps(ours: list[int], theirs: list[int], within: int) -> list[tuple[int, int]]:
    """(our eval step, the baseline's) pairs: equal steps, or with `within` > 0 the nearest baseline
    step at most `within` away, a later one on a tie (the baseline then trained longer, never less).
    A run stopped by hand ends with an eval a step off the other's; exact matching would drop it."""
    pairs = []
    for s in ours:
        near = [t for t in theirs if abs(t - s) <= within]
        if near:
            pairs.append((s, min(near, key=lambda t: (abs(t - s), -t))))
    return pairs


def compare(figures: dict[str, dict[str, Any]], baseline: str | None, within: int = 0) -> dict[str, Any]:
    """The issue's checks for every non-baseline run (vs `baseline` at matched eval steps)."""
    out: dict[str, Any] = {}
    base = figures.get(baseline) if baseline else None
    for label, f in figures.items():
        if label == baseline:
            continue
        check: dict[str, Any] = {
            "asr_rise_points": f["asr_rise_points"],
            "asr_rises_20_points": f["asr_rise_points"] >= 20.0,
            "diversity_ratio": f["diversity_ratio"],
            "diversity_kept_half": None if f["diversity_ratio"] is None else f["diversity_ratio"] >= 0.5,
        }
        if base is not None:
            ours = dict(zip(f["steps"], f["num_unique_successful"]))
            theirs = dict(zip(base["steps"], base["num_unique_successful"]))
            pairs = matched_steps(sorted(ours), sorted(theirs), within)
            if within:
                check["baseline_step_within"] = within
                check["unique_successful_at_matched_steps"] = {
                    f"{s} vs {t}": [ours[s], theirs[t]] for s, t in pairs}
            else:
                check["unique_successful_at_common_steps"] = {s: [ours[s], theirs[s]] for s, _ in pairs}
            check["more_unique_than_baseline_at_last_common_step"] = (
                bool(ours[pairs[-1][0]] > theirs[pairs[-1][1]]) if pairs else None)
        out[label] = check
    return out


def plot(figures: dict[str, dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for label, f in figures.items():
        axes[0].plot(f["steps"], f["attack_success_rate"], "o-", label=label)
        axes[1].plot(f["steps"], f["num_unique_successful"], "o-", label=label)
        axes[2].plot(f["steps"], f["diversity"], "o-", label=label)
    for ax, title in zip(axes, ("attack success rate", "unique successful attacks", "diversity of successful attacks")):
        ax.set_xlabel("trainer step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylim(0, 1.02)
    for label, f in figures.items():
        train = f.get("training_curve") or []
        if train:
            x = [(r["version_start"] + r["version_end"]) / 2 for r in train]
            axes[0].plot(x, [r["attack_success_rate"] for r in train], ":", alpha=0.6,
                         label=f"{label}: training attacks")
    axes[0].legend()
    fig.tight_layout()
    curves = out / "learning_curves.png"
    fig.savefig(curves, dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 5))
    for label, f in figures.items():
        ax.plot(f["mean_geometric_toxicity"], f["diversity"], "o-", label=label)
        for s, x, y in zip(f["steps"], f["mean_geometric_toxicity"], f["diversity"]):
            ax.annotate(str(s), (x, y), fontsize=7, alpha=0.7)
    ax.set_xlabel("mean geometric toxicity of the victim's answers")
    ax.set_ylabel("diversity of successful attacks (1 - mean cos)")
    ax.set_title("toxicity vs diversity over training (labels: step)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    scatter = out / "toxicity_vs_diversity.png"
    fig.savefig(scatter, dpi=100)
    plt.close(fig)
    return [curves, scatter]


def copy_record(run: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "summary.json", "metrics.jsonl"):
        if (run / name).exists():
            shutil.copy2(run / name, dest / name)
    if (run / "plots" / "learning_curve.png").exists():  # the trainer's own ASR / reward curve
        shutil.copy2(run / "plots" / "learning_curve.png", dest / "learning_curve.png")
    if (run / "logs" / "trainer.log").exists():
        shutil.copy2(run / "logs" / "trainer.log", dest / "trainer.log")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="append", required=True, help="LABEL=RUN_DIR (repeatable)")
    ap.add_argument("--baseline", help="the label of the policy-gradient baseline run")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--no-copy", action="store_true", help="only the plots and comparison.json")
    ap.add_argument("--train-window", type=int, default=0,
                    help="also the metrics of the training attacks per this many policy versions (0: no)")
    ap.add_argument("--match-within", type=int, default=0,
                    help="pair an eval with the baseline's at most this many steps away (0: equal steps only)")
    ap.add_argument("--encoder", help="sentence-transformers dir for the training-attack diversity")
    args = ap.parse_args(argv)
    runs = dict(r.split("=", 1) for r in args.run)
    if args.baseline and args.baseline not in runs:
        raise SystemExit(f"--baseline {args.baseline!r} is not one of the --run labels {sorted(runs)}")
    args.out.mkdir(parents=True, exist_ok=True)
    figures = {label: run_figures(Path(d)) for label, d in runs.items()}
    if args.train_window:
        for label, d in runs.items():
            figures[label]["training_curve"] = training_curve(Path(d), args.train_window, args.encoder)
    report = {"runs": {k: str(v) for k, v in runs.items()}, "figures": figures,
              "checks": compare(figures, args.baseline, args.match_within)}
    (args.out / "comparison.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(figures, args.out)
    if not args.no_copy:
        for label, d in runs.items():
            copy_record(Path(d), args.out / label)
    print(json.dumps(report["checks"], indent=1))
    return report


if __name__ == "__main__":
    main()
