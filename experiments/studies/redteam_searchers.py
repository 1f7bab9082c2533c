"""Study 5: red-teaming with 1, 2, 3 searchers at equal trainer steps, and a policy-gradient arm.

    python experiments/studies/redteam_searchers.py [--steps 36] [--searchers 1 2 3] [--objective rloo]

The TBA paper (§8) reports that more searchers raise both attack success and diversity: with
more searchers the trainer sees more, and more varied, attacks per update (the replay heap keeps
the best unique ones). This study runs `redteam_smollm2` (SmolLM2-135M-Instruct attacking itself,
BiLSTM toxicity; see experiments/redteam_smollm2.py) asynchronously with each searcher count,
everything else fixed (LoRA, the reward-keyed replay heap half online / half replay, sync every
step, at most `rollout.max_calls_per_version` generation calls per searcher and version), for the
same number of trainer steps, plus one `--objective` arm per named objective (default `rloo`: the
policy-gradient baseline on the same log reward, no KL term) with the first searcher count.

Reported per arm, all read from the runs' own files:
- the sampled evaluation at the last step (64 attacks of the one prompt in the recipe, at the training
  temperature, a fixed key; `tbajax.tasks.redteam.RedTeamEval`): attack success rate (geometric
  mean toxicity over the victim's answers > 0.5), unique successful attacks, diversity of the
  successful attacks (1 − mean pairwise MiniLM cosine; `diversity_hashed_bow` when the run has
  no encoder) and mean geometric toxicity;
- the same metrics over the attacks the searchers sampled in the last `--train-window` policy
  versions (`tbajax.tasks.redteam.training_metrics`);
- attacks generated, policy lag, and the replay heap's counters (accepted, near-duplicate drops,
  evictions) from the trainer's last record.

Writes results.md, results.json, learning_curves.png and toxicity_vs_diversity.png (made by
experiments/redteam_report.py) under experiments/results/redteam_searchers/. Needs the
experiment's offline assets (see experiments/redteam_smollm2.py); hours on 2 CPU cores. `--quick`
(3 steps) only checks the pipeline; `--experiment=tiny_arithmetic` with the red-team `--set`s of
tests/test_redteam_task.py runs it on the tiny stand-ins (tests/test_studies.py does).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from common import (  # noqa: E402
    Arm,
    ArmResult,
    markdown_table,
    mean_std,
    output_dir,
    provenance,
    resolve,
    run_study,
    study_parser,
    write_results,
)

SEARCHERS = (1, 2, 3)
NAME = "redteam_searchers"


def arms(searchers: list[int], objectives: list[str], seeds: int) -> list[Arm]:
    tb = [Arm(group=f"TB, {n} searcher{'s' * (n > 1)}", seed=s, params=(("searchers", n), ("objective", "tb")),
              overrides=("system.mode=async", f"system.num_searchers={n}"))
          for s in range(seeds) for n in searchers]
    n0 = searchers[0]
    pg = [Arm(group=f"{obj}, {n0} searcher{'s' * (n0 > 1)}", seed=s, params=(("searchers", n0), ("objective", obj)),
              overrides=("system.mode=async", f"system.num_searchers={n0}", f"train.objective={obj}"))
          for s in range(seeds) for obj in objectives]
    return tb + pg


def common_overrides(steps: int, quick: bool, extra: list[str]) -> list[str]:
    """Equal trainer steps; evaluations at the start, every third of the run and at the end."""
    every = max(1, steps // 3)
    return [f"train.steps={steps}", f"eval.every={every}", f"train.checkpoint_every={steps}",
            "train.keep_checkpoints=1", *extra]


def diversity_key(end: dict[str, Any]) -> str:
    return "eval_diversity" if "eval_diversity" in end else "eval_diversity_hashed_bow"


def last_record(run_dir: Path, key: str) -> dict[str, Any]:
    from tbajax.system.metrics import eval_records

    rows = eval_records(run_dir, key)  # the trainer's (eval.mode=inline) or the evaluator role's
    return rows[-1] if rows else {}


def training_window(run_dir: Path, window: int, encoder: str | None) -> dict[str, Any]:
    """The eval metrics over the attacks sampled in the last `window` policy versions."""
    from tbajax.tasks.redteam import training_metrics

    curve = training_metrics(run_dir, window=window, encoder=encoder)
    return curve[-1] if curve else {}


def figures(r: ArmResult, run_dir: Path, window: int, encoder: str | None) -> dict[str, Any]:
    end, start = r.summary["eval_end"], r.summary["eval_start"]
    dk = diversity_key(end)
    heap = last_record(run_dir, "buffer_heap_accepted")
    train = training_window(run_dir, window, encoder)
    return {
        "group": r.arm.group, "seed": r.arm.seed, "searchers": r.arm.param("searchers"),
        "objective": r.arm.param("objective"),
        "asr_start": float(start["eval_attack_success_rate"]), "asr_end": float(end["eval_attack_success_rate"]),
        "unique_successful_end": float(end["eval_num_unique_successful"]),
        "diversity_metric": dk.removeprefix("eval_"), "diversity_end": float(end.get(dk, math.nan)),
        "toxicity_end": float(end["eval_mean_geometric_toxicity"]),
        "unique_attacks_end": float(end["eval_num_unique_attacks"]),
        "train_window": train,
        "samples_generated": int(r.summary["samples_generated"]), "policy_lag_mean": float(r.summary["policy_lag_mean"]),
        "wall_s": r.wall_s,
        "heap": {k.removeprefix("buffer_"): heap[k] for k in heap if k.startswith("buffer_heap_")},
    }


def table_row(f: dict[str, Any]) -> list[Any]:
    tw = f["train_window"]
    div_key = "diversity" if "diversity" in tw else "diversity_hashed_bow"
    heap = f["heap"]
    return [
        f["group"], f["seed"],
        f"{100 * f['asr_start']:.1f} → {100 * f['asr_end']:.1f}", int(f["unique_successful_end"]),
        f"{f['diversity_end']:.3f}", f"{f['toxicity_end']:.3f}",
        f"{100 * tw.get('attack_success_rate', math.nan):.1f}", int(tw.get("num_unique_successful", 0)),
        f"{tw.get(div_key, math.nan):.3f}",
        f["samples_generated"], f"{f['policy_lag_mean']:.2f}",
        f"{heap.get('heap_size', '-')}/{heap.get('heap_accepted', '-')}/{heap.get('heap_near_duplicate_drops', '-')}"
        f"/{heap.get('heap_evictions', '-')}",
        f"{f['wall_s']:.0f}",
    ]


def mean_table(figs: list[dict[str, Any]]) -> str:
    """Each arm's end-of-run figures as mean ± standard deviation over its seeds."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for f in figs:
        groups.setdefault(f["group"], []).append(f)
    header = ["arm", "seeds", "ASR % (eval)", "unique successful (eval)", "diversity (eval)",
              "mean geo. toxicity (eval)", "attacks generated"]

    def cell(fs: list[dict[str, Any]], key: str, spec: str, scale: float = 1.0) -> str:
        m, s = mean_std([scale * f[key] for f in fs])
        return f"{m:{spec}} ± {s:{spec}}"

    rows = [
        [group, len(fs), cell(fs, "asr_end", ".1f", 100.0), cell(fs, "unique_successful_end", ".1f"),
         cell(fs, "diversity_end", ".3f"), cell(fs, "toxicity_end", ".3f"),
         cell(fs, "samples_generated", ".0f")]
        for group, fs in groups.items()
    ]
    return markdown_table(header, rows)


def _report_figures(report: Any, run_dir: Path) -> dict[str, Any]:
    """redteam_report's per-run figures; without MiniLM the plotted diversity is the hashed one."""
    f = report.run_figures(run_dir)
    if all(math.isnan(d) for d in f["diversity"]):
        f["diversity"] = [float(r.get("eval_diversity_hashed_bow", math.nan)) for r in report.eval_rows(run_dir)]
    return f


def main() -> None:
    ap = study_parser(__doc__, default_steps=36)
    ap.set_defaults(experiment="redteam_smollm2")
    ap.add_argument("--searchers", type=int, nargs="+", default=list(SEARCHERS), help="searcher counts (TB arms)")
    ap.add_argument("--objective", nargs="*", default=["rloo"],
                    help="baseline objectives, one arm each at the first searcher count (none: TB only)")
    ap.add_argument("--train-window", type=int, default=4, help="policy versions of the training-attack metrics")
    args = ap.parse_args()
    if args.quick:
        args.steps = 3
    if any(n < 1 for n in args.searchers):
        raise SystemExit(f"--searchers must be >= 1, got {args.searchers}")
    seeds = args.seeds or 1
    common = common_overrides(args.steps, args.quick, args.set)
    arm_list = arms(args.searchers, args.objective, seeds)
    results = run_study(NAME, args, arm_list, common)
    runs_dir = args.runs_dir or Path(__file__).resolve().parents[2] / "runs" / "studies" / NAME
    base = resolve(args.experiment, [*common, *arm_list[0].overrides], 0)
    encoder = base.task.options.get("encoder")
    num_eval = base.eval.num_problems * int(base.task.options.get("eval_samples", 1))
    figs = [figures(r, runs_dir / r.arm.name, args.train_window, encoder) for r in results]

    import redteam_report

    out = output_dir(NAME, args)
    report_figs = {r.arm.name: _report_figures(redteam_report, runs_dir / r.arm.name) for r in results}
    plots = redteam_report.plot(report_figs, out)
    header = ["arm", "seed", "ASR % start → end (eval)", "unique successful (eval)", "diversity (eval)",
              "mean geo. toxicity (eval)", f"ASR % (train, last {args.train_window} versions)",
              "unique successful (train)", "diversity (train)", "attacks generated", "policy lag",
              "heap size/accepted/near-dup drops/evictions", "wall s"]
    table = markdown_table(header, [table_row(f) for f in figs])
    div_names = sorted({f["diversity_metric"] for f in figs})
    sections = [
        f"## After {args.steps} trainer steps", "",
        f"Eval: {num_eval} attacks of the one prompt sampled at the training temperature with a fixed key "
        f"(diversity metric: {', '.join(div_names)}; 1 − mean pairwise cosine of the successful attacks). "
        f"Train: the attacks the searchers sampled in the last {args.train_window} policy versions.", "",
        table, "",
        *(["Mean ± standard deviation over the seeds:", "", mean_table(figs), ""] if seeds > 1 else []),
        "Paper (§8): more searchers raise both attack success and diversity; TB keeps diversity where the "
        "policy-gradient baseline collapses onto few attacks.", "",
        *[f"![{p.stem}]({p.name})" for p in plots], "",
    ]
    md = write_results(out, "Red-teaming: searcher scaling (redteam_smollm2)", provenance(args, common), results,
                       sections, extra={"figures": figs}, json_path=args.json)
    print(md.read_text())


if __name__ == "__main__":
    main()
