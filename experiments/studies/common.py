"""Shared machinery of the claim studies: run a grid of real experiment runs, collect, report.

Every arm is an ordinary run of the launcher (`tbajax.system.launcher.launch`: a trainer process
plus searcher processes, or the sync mode), with its own run directory. A study only reads what
the runs wrote (summary.json, metrics.jsonl) and turns it into results.json, results.md and PNG
plots; nothing in a results directory is edited by hand. Finished arms are reused when a study
is re-run with the same settings, so an interrupted study continues where it stopped.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tbajax.config import ConfigError, ExperimentConfig, apply_overrides
from tbajax.main import load_experiment
from tbajax.system.launcher import launch, read_summary
from tbajax.system.metrics import eval_records, read_metrics

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "experiments" / "results"


class StudyError(RuntimeError):
    pass


@dataclass(frozen=True)
class Arm:
    """One configuration of a study, run once per seed.

    group: the label results are aggregated under (e.g. the objective name).
    overrides: `--set`-style `key=value` strings applied to the study's base experiment.
    """

    group: str
    overrides: tuple[str, ...]
    seed: int = 0
    params: tuple[tuple[str, Any], ...] = ()  # the study's own coordinates (k, m, searchers...)

    @property
    def name(self) -> str:
        slug = "".join(c if c.isalnum() or c in "._=" else "-" for c in self.group).strip("-")
        return f"{'-'.join(filter(None, slug.split('-')))}-seed{self.seed}"

    def param(self, key: str) -> Any:
        return dict(self.params)[key]


@dataclass(frozen=True)
class ArmResult:
    arm: Arm
    summary: dict[str, Any]
    curve: tuple[tuple[int, float, float], ...]  # (trainer step, seconds since start, eval score)
    generate_s: float  # sync mode: time spent generating (0 in async mode)
    train_s: float  # time inside train steps (without the sync mode's generation, which step_time_s counts)
    mean_lag: float  # mean over trained rows of (trainer version - the version that sampled them)

    @property
    def final_accuracy(self) -> float:
        return float(self.summary["eval_accuracy_end"])

    @property
    def start_accuracy(self) -> float:
        return float(self.summary["eval_accuracy_start"])

    @property
    def final_score(self) -> float:
        """The experiment's own headline metric (`eval_metric`: accuracy, win rate, ...)."""
        return float(self.summary["eval_score_end"])

    @property
    def start_score(self) -> float:
        return float(self.summary["eval_score_start"])

    @property
    def wall_s(self) -> float:
        return float(self.summary["wall_time_s"])

    def time_to(self, target: float) -> float | None:
        """Seconds from the start until the first evaluation at or above `target` (None: never)."""
        for _, t, acc in self.curve:
            if acc >= target:
                return t
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "group": self.arm.group, "seed": self.arm.seed, "overrides": list(self.arm.overrides),
            "params": dict(self.arm.params), "summary": self.summary,
            "curve": [list(c) for c in self.curve], "generate_s": self.generate_s, "train_s": self.train_s,
            "mean_lag": self.mean_lag,
        }


def study_parser(doc: str, default_steps: int) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiment", default="tiny_arithmetic", help="base experiment (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=default_steps, help="trainer steps per run")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per arm (default: the study's own)")
    ap.add_argument("--quick", action="store_true", help="a few steps per arm: checks the pipeline only")
    ap.add_argument("--out", type=Path, default=None, help="results directory (default experiments/results/<study>)")
    ap.add_argument("--runs-dir", type=Path, default=None, help="where run directories go (default runs/studies/<study>)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra override for every arm")
    ap.add_argument("--fresh", action="store_true", help="re-run arms even if a finished run exists")
    ap.add_argument("--json", type=Path, default=None, help="also write results.json here")
    return ap


def base_overrides(args: argparse.Namespace, eval_every: int, eval_problems: int) -> list[str]:
    """The study-wide budget: steps, evaluation cadence and size (the same for every arm). A
    decaying learning-rate schedule is compressed to the study's number of steps."""
    out = [
        f"train.steps={args.steps}", f"eval.every={eval_every}", f"eval.num_problems={eval_problems}",
        f"eval.batch_size={min(eval_problems, 250)}", f"train.checkpoint_every={args.steps}",
    ]
    lr = load_experiment(args.experiment).train.trainer.optimizer.lr
    if lr.kind in ("linear", "cosine") and lr.warmup_steps + lr.decay_steps != args.steps:
        out.append(f"train.trainer.optimizer.lr.decay_steps={max(1, args.steps - lr.warmup_steps)}")
    return [*out, *args.set]


def resolve(experiment: str, overrides: Sequence[str], seed: int) -> ExperimentConfig:
    return apply_overrides(load_experiment(experiment), [*overrides, f"seed={seed}"])


def run_arm(experiment: str, arm: Arm, common: Sequence[str], runs_dir: Path, *, fresh: bool) -> ArmResult:
    config = resolve(experiment, [*common, *arm.overrides], arm.seed)
    run_dir = runs_dir / arm.name
    config_path = run_dir / "config.json"
    summary = read_summary(run_dir)
    same = config_path.exists() and _stored_config(config_path) == json.loads(config.to_json())
    if fresh or not (summary and same and not summary.get("stopped_early")):
        if run_dir.exists():
            shutil.rmtree(run_dir)
        t0 = time.time()
        print(f"  {arm.name}: {' '.join(arm.overrides) or '(base config)'}", flush=True)
        code = launch(config, run_dir, quiet=True)
        if code != 0:
            raise StudyError(f"arm {arm.name} failed (exit {code}); see {run_dir}/logs/")
        summary = read_summary(run_dir)
        if summary is None:
            raise StudyError(f"arm {arm.name} finished without a summary.json in {run_dir}")
        print(f"    -> {summary['eval_metric']} {summary['eval_score_start']:.3f} -> {summary['eval_score_end']:.3f} "
              f"in {time.time() - t0:.0f}s", flush=True)
    else:
        print(f"  {arm.name}: reusing the finished run in {run_dir}", flush=True)
    return collect(arm, run_dir, summary)


def _stored_config(path: Path) -> dict[str, Any]:
    """A run's config.json as the current code reads it: fields added since the run started take
    their defaults (as on --resume), so a finished run is not re-run over a new config field."""
    stored = json.loads(path.read_text())
    try:
        return json.loads(ExperimentConfig.from_dict(stored).to_json())
    except ConfigError:
        return stored  # a field since removed: compared as stored, it differs and the arm re-runs


def collect(arm: Arm, run_dir: Path, summary: dict[str, Any]) -> ArmResult:
    records = read_metrics(run_dir, "trainer")
    evals = eval_records(run_dir)  # the trainer's (eval.mode=inline) or the evaluator role's
    curve = tuple((int(r["step"]), float(r.get("elapsed_s", 0.0)), float(r["eval_score"])) for r in evals)
    steps = [r for r in records if "step_time_s" in r]
    generate_s = float(sum(r.get("generate_s", 0.0) for r in steps))  # sync mode only: 0 in async runs
    return ArmResult(
        arm=arm, summary=summary, curve=curve,
        generate_s=generate_s,
        train_s=float(sum(r["step_time_s"] for r in steps)) - generate_s,  # a sync step's time includes its generation
        mean_lag=float(np.mean([r.get("policy_lag_mean", 0.0) for r in steps])) if steps else 0.0,
    )


def run_study(
    name: str, args: argparse.Namespace, arms: Sequence[Arm], common: Sequence[str]
) -> list[ArmResult]:
    runs_dir = args.runs_dir or REPO / "runs" / "studies" / name
    runs_dir.mkdir(parents=True, exist_ok=True)
    print(f"{name}: {len(arms)} runs of {args.experiment} ({args.steps} trainer steps each); runs in {runs_dir}")
    t0 = time.time()
    results = []
    for i, arm in enumerate(arms, 1):
        print(f"[{i}/{len(arms)}] ({time.time() - t0:.0f}s elapsed)", flush=True)
        results.append(run_arm(args.experiment, arm, common, runs_dir, fresh=args.fresh))
    return results


def output_dir(name: str, args: argparse.Namespace) -> Path:
    out = args.out or RESULTS / name
    out.mkdir(parents=True, exist_ok=True)
    return out


def provenance(args: argparse.Namespace, common: Sequence[str]) -> dict[str, Any]:
    import jax

    return {
        "command": "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}",
        "python": platform.python_version(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "experiment": args.experiment,
        "steps": args.steps,
        "quick": bool(args.quick),
        "common_overrides": list(common),
    }


def write_results(
    out: Path, title: str, prov: dict[str, Any], results: Sequence[ArmResult], sections: Sequence[str],
    extra: dict[str, Any] | None = None, json_path: Path | None = None,
) -> Path:
    """results.json (everything) and results.md (the tables and plots the study made)."""
    payload = {"title": title, "provenance": prov, "runs": [r.to_json() for r in results], **(extra or {})}
    (out / "results.json").write_text(json.dumps(payload, indent=2, default=float))
    if json_path is not None:
        json_path.write_text(json.dumps(payload, indent=2, default=float))
    lines = [
        f"# {title}", "",
        f"Produced by `{prov['command']}` on {prov['date']} ({prov['machine']}; Python {prov['python']}, "
        f"jax {prov['jax']} on {prov['backend']}). Base experiment `{prov['experiment']}`, "
        f"{prov['steps']} trainer steps per run" + (" (**--quick: a pipeline check, not a result**)" if prov["quick"] else "")
        + ". Every figure below is read from the runs' own summary.json / metrics.jsonl.", "",
        *sections,
    ]
    md = out / "results.md"
    md.write_text("\n".join(lines).rstrip() + "\n")
    return md


# ---- aggregation and presentation -------------------------------------------------------------


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    a = np.asarray(values, float)
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0


def fmt_mean_std(values: Sequence[float], pct: bool = True) -> str:
    m, s = mean_std(values)
    scale = 100.0 if pct else 1.0
    return f"{m * scale:.1f} ± {s * scale:.1f}" if len(values) > 1 else f"{m * scale:.1f}"


def by_group(results: Sequence[ArmResult], key: Callable[[ArmResult], Any] = lambda r: r.arm.group) -> dict[Any, list[ArmResult]]:
    out: dict[Any, list[ArmResult]] = {}
    for r in results:
        out.setdefault(key(r), []).append(r)
    return out


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def plot_curves(
    path: Path, groups: dict[str, list[ArmResult]], title: str, x: str = "time", target: float | None = None
) -> Path:
    """Eval accuracy vs wall time (or trainer step) per group; one thin line per seed, bold mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (label, runs) in enumerate(groups.items()):
        color = f"C{i % 10}"
        for r in runs:
            xs = [(c[1] / 60 if x == "time" else c[0]) for c in r.curve]
            ax.plot(xs, [c[2] for c in r.curve], color=color, alpha=0.35, lw=1)
        mean = _mean_curve(runs, x)
        if mean is not None:
            ax.plot(mean[0], mean[1], color=color, lw=2.2, marker="o", ms=3, label=label)
    if target is not None:
        ax.axhline(target, color="gray", ls="--", lw=1, label=f"target {target:.2f}")
    ax.set_xlabel("wall time (min)" if x == "time" else "trainer step")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _mean_curve(runs: Sequence[ArmResult], x: str) -> tuple[list[float], list[float]] | None:
    """Mean over seeds at each evaluation index (runs share the evaluation schedule by step)."""
    n = min(len(r.curve) for r in runs) if runs else 0
    if n == 0:
        return None
    xs = [float(np.mean([(r.curve[i][1] / 60 if x == "time" else r.curve[i][0]) for r in runs])) for i in range(n)]
    ys = [float(np.mean([r.curve[i][2] for r in runs])) for i in range(n)]
    return xs, ys


def plot_bars(path: Path, labels: Sequence[str], values: Sequence[Sequence[float]], title: str, ylabel: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    means = [float(np.mean(v)) for v in values]
    errs = [float(np.std(v, ddof=1)) if len(v) > 1 else 0.0 for v in values]
    ax.bar(range(len(labels)), means, yerr=errs, capsize=4, color=[f"C{i % 10}" for i in range(len(labels))])
    for i, v in enumerate(values):
        ax.scatter([i] * len(v), v, color="k", s=10, zorder=3)
    ax.set_xticks(range(len(labels)), labels, rotation=20)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
