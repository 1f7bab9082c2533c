"""Study 4: off-policyness in preference tuning, the recency probability m on `pft_smollm2`.

    python experiments/studies/pft_recency.py [--steps 20] [--seeds 1] [--m 0.4 0.5 0.6] [--k 2]

The TBA paper's TL;DR table (§6) reports win rate 0.67 / 0.82 / 0.80 for m = 0.4 / 0.5 / 0.6: a
*more* off-policy mix (a smaller m draws more groups from the whole buffer by reward instead of
from the latest sync's data) does not hurt and can help. This study runs the offline preference
experiment (SmolLM2-135M-Instruct, MiniLM-similarity reward, AFINN gold judge; see
experiments/pft_smollm2.py) once per m (and per sync period k with `--k 2 8`), everything else
fixed, for the same number of trainer steps, and reports at that step: the win rate under the
gold judge with its 95% interval, and two KLs to the SFT model that the runs themselves logged or
stored (no extra model passes):
- `eval_kl_greedy`: −log SFT(y*) per token of the greedy policy output on the 64 held-out prompts
  (the run's own eval; KL of the point-mass policy the win rate judges, not 0 at step 0);
- sampled k3 KL(π_v‖SFT) at the sampling temperature, per response token, from the training rows
  the searcher drew with the last policy versions (behaviour vs SFT log-probs stored in each row).

Writes results.md, results.json and win_rate_kl.png under experiments/results/pft_recency/.
Needs the experiment's offline assets (see experiments/pft_smollm2.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from common import (  # noqa: E402
    Arm,
    ArmResult,
    by_group,
    markdown_table,
    output_dir,
    provenance,
    run_study,
    study_parser,
    write_results,
)

RECENCY = (0.4, 0.5, 0.6)
BASE_K = 2  # pft_smollm2's sync period
LAST_VERSIONS = 3  # sampled KL: rows drawn by the newest this many policy versions


def arms(ms: list[float], ks: list[int], seeds: int) -> list[Arm]:
    points = [(k, m) for k in ks for m in ms]
    return [
        Arm(group=f"k={k} m={m}", seed=s, params=(("k", k), ("m", m)),
            overrides=(f"buffer.recency_prob={m}", f"system.sync_every={k}"))
        for s in range(seeds) for k, m in points
    ]


def common_overrides(steps: int, extra: list[str]) -> list[str]:
    """Evaluate at the start and at the last step only (the step-0 evaluation also generates the
    SFT reference outputs; it is identical across arms), keep the final checkpoint."""
    return [f"train.steps={steps}", f"eval.every={steps}", f"train.checkpoint_every={steps}",
            "train.keep_checkpoints=1", *extra]


def sampled_kl(run_dir: Path) -> dict[str, float]:
    """Sampled k1/k3 KL(π_v‖SFT) per token over the rows of the newest LAST_VERSIONS versions."""
    import numpy as np
    from pft_smollm2 import _rows_by_version

    from tbajax.tasks.preference import sampled_kl_of_rows

    by_version = _rows_by_version(run_dir)
    if not by_version:
        return {"k1": float("nan"), "k3": float("nan"), "rows": 0, "versions": []}
    newest = sorted(by_version)[-LAST_VERSIONS:]
    rows = [r for v in newest for r in by_version[v]]
    kl = sampled_kl_of_rows(rows)
    first = sampled_kl_of_rows(by_version[min(by_version)])
    return {**{k: float(v) for k, v in kl.items() if isinstance(v, (int, float, np.floating))},
            "rows": len(rows), "versions": newest, "k3_first_version": float(first.get("k3", float("nan")))}


def row(r: ArmResult, kl: dict) -> list:
    end = r.summary["eval_end"]
    return [
        r.arm.param("m"), r.arm.param("k"), r.arm.seed,
        f"{end['eval_win_rate']:.3f} [{end['eval_win_rate_low']:.2f}, {end['eval_win_rate_high']:.2f}]",
        f"{int(end['eval_wins'])}/{int(end['eval_ties'])}/{int(end['eval_losses'])}",
        f"{end['eval_gold_mean']:.2f}",
        f"{r.summary['eval_start']['eval_kl_greedy']:.3f} → {end['eval_kl_greedy']:.3f}",
        f"{kl.get('k3_first_version', float('nan')):.3f} → {kl.get('k3', float('nan')):.3f}",
        f"{r.summary['policy_lag_mean']:.2f}", r.summary["samples_generated"], f"{r.wall_s:.0f}",
    ]


def plot(path: Path, results: list[ArmResult], kls: list[dict]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, (r, kl) in enumerate(zip(results, kls)):
        end = r.summary["eval_end"]
        y, lo, hi = end["eval_win_rate"], end["eval_win_rate_low"], end["eval_win_rate_high"]
        x = end["eval_kl_greedy"]
        ax.errorbar([x], [y], yerr=[[y - lo], [hi - y]], fmt="o", color=f"C{i % 10}", capsize=4,
                    label=f"m={r.arm.param('m')} k={r.arm.param('k')} seed {r.arm.seed}")
    if results:
        s = results[0].summary["eval_start"]
        ax.scatter([s["eval_kl_greedy"]], [s["eval_win_rate"]], marker="x", color="k", label="SFT (step 0)")
    ax.set_xlabel("KL of the greedy output to SFT per token (eval_kl_greedy, nats)")
    ax.set_ylabel("win rate vs SFT under AFINN (95% CI)")
    ax.set_title("pft_smollm2: recency m, equal trainer steps")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    ap = study_parser(__doc__, default_steps=20)
    ap.set_defaults(experiment="pft_smollm2")
    ap.add_argument("--m", type=float, nargs="+", default=list(RECENCY), help="recency probabilities")
    ap.add_argument("--k", type=int, nargs="+", default=[BASE_K], help="sync periods")
    args = ap.parse_args()
    if args.quick:
        args.steps = 2
    seeds = args.seeds or 1
    common = common_overrides(args.steps, args.set)
    results = run_study("pft_recency", args, arms(args.m, args.k, seeds), common)
    runs_dir = args.runs_dir or Path(__file__).resolve().parents[2] / "runs" / "studies" / "pft_recency"
    kls = [sampled_kl(runs_dir / r.arm.name) for r in results]

    out = output_dir("pft_recency", args)
    header = ["m", "k", "seed", "win rate [95% CI]", "wins/ties/losses", "AFINN mean",
              "greedy KL start → end", "sampled k3 KL first → last versions", "policy lag", "samples", "wall s"]
    table = markdown_table(header, [row(r, kl) for r, kl in zip(results, kls)])
    plot(out / "win_rate_kl.png", results, kls)
    groups = by_group(results)
    spread = [f"- {g}: win rate " + ", ".join(f"{r.final_score:.3f}" for r in runs)
              + (f" (mean {sum(r.final_score for r in runs) / len(runs):.3f} over {len(runs)} seeds)"
                 if len(runs) > 1 else "") for g, runs in groups.items()]
    sections = [
        f"## Win rate and KL after {args.steps} trainer steps", "",
        "Win rate of the policy's greedy continuation over the SFT model's on 64 held-out passages under "
        "AFINN (ties count half; 95% Wilson interval). Step 0 is 0.5 by construction.", "",
        table, "", *spread, "",
        "Paper (TL;DR, Pythia, 256 updates): m = 0.4 / 0.5 / 0.6 → 0.67 / 0.82 / 0.80.", "",
        "![win rate vs KL](win_rate_kl.png)", "",
    ]
    md = write_results(out, "Preference tuning: recency m (pft_smollm2)", provenance(args, common), results,
                       sections, extra={"sampled_kl": kls}, json_path=args.json)
    print(md.read_text())


if __name__ == "__main__":
    main()
