"""Run metrics: one JSONL line per record, the same scalars in TensorBoard, a PNG at the end."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np


def _require(module: str, what: str) -> Any:
    """Import an optional dependency of the `plots` extra, or say how to get it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{what} needs the {module.split('.')[0]} package, which a lean install leaves out: "
            "pip install 'tbajax[plots]'"
        ) from e


class MetricsWriter:
    """Appends `{"step", "time", "role", **scalars}` to metrics.jsonl, to TensorBoard and, given a
    `WandbRun` (`tbajax.system.wandb_logging.open_wandb`), to Weights & Biases."""

    def __init__(self, run_dir: str | Path, role: str, tensorboard: bool = True, wandb: Any = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.role = role
        self._wandb = wandb
        self._tb = None
        if tensorboard:
            from tbajax.system.tensorboard import ScalarEventWriter

            self._tb = ScalarEventWriter(Path(run_dir) / "tensorboard" / role)

    def write(self, step: int, scalars: Mapping[str, Any]) -> dict[str, Any]:
        clean = {k: _scalar(v) for k, v in scalars.items()}
        record = {"step": int(step), "time": time.time(), "role": self.role, **clean}
        with open(self.path, "a") as f:  # one short line per write: appends are atomic enough
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in clean.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self._tb.add_scalar(k, v, int(step))
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(record)
        return record

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None


def matmul_flops_per_s(n: int = 1024, repeats: int = 5) -> float:
    """Measured fp32 FLOP/s of one jitted n^3 matmul on this backend (best of `repeats`): the
    machine's speed, and the roofline a benchmark compares against."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_model_and_flags() -> tuple[str | None, list[str]]:
    """The CPU's model name and the vector-ISA flags XLA's CPU backend can use (from
    /proc/cpuinfo; (None, []) where there is none): two machines of one "kind" may differ here."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None, []
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), None)
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return model, [f for f in _CPU_FLAGS if f in flags]


def machine_info() -> dict[str, Any]:
    """Where a run or a benchmark ran, with this machine's fp32 matmul rate measured now.

    Machines of one kind differ ~3x in speed from day to day, so an absolute time means something
    only next to the rate measured in the same run."""
    import os
    import platform
    import sys

    import jax

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    model, flags = cpu_model_and_flags()
    return {
        "cpu_count": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": model,
        "cpu_flags": flags,
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "jax": jax.__version__,
        "python": sys.version.split()[0],
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "matmul_gflops": matmul_flops_per_s() / 1e9,
        "load_average_1m": load,  # other work on the machine while it was measured
    }


def _scalar(v: Any) -> Any:
    if isinstance(v, (np.generic, np.ndarray)) or hasattr(v, "item"):
        v = np.asarray(v)
        return v.item() if v.size == 1 else v.tolist()
    return v


def read_metrics(run_dir: str | Path, role: str | None = None, *, superseded: bool = False) -> list[dict[str, Any]]:
    """The records of metrics.jsonl in file order (those of `role` only, if given).

    After a trainer resume the steps between its checkpoint and the crash were trained twice and
    logged twice; the resumed trainer writes ``{"event": "resume", "from_step": N}`` first.
    Unless `superseded=True`, trainer records of steps > N written before that marker are
    dropped, so curves and averages count each step once (the copy the run continued from)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a crash mid-write: skip it
            continue
    if not superseded:
        records = drop_superseded(records)
    return [r for r in records if role is None or r.get("role") == role]


def drop_superseded(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop records that a resume marker says were rolled back (see read_metrics): trainer
    records of steps > N written before it, and evaluator records of steps > N whose param
    version is older than the marker's (params of a rolled-back step, whenever the evaluator
    got to them: versions only grow, so a retrained step's params have a newer version)."""
    keep = [True] * len(records)
    for i, rec in enumerate(records):
        if rec.get("role") == "trainer" and rec.get("event") == "resume":
            from_step = int(rec["from_step"])
            for j in range(i):
                if records[j].get("role") == "trainer" and int(records[j].get("step", -1)) > from_step:
                    keep[j] = False
            resumed_version = int(rec.get("version", 0))
            for j, other in enumerate(records):
                if (other.get("role") == "evaluator" and int(other.get("step", -1)) > from_step
                        and int(other.get("version", 0)) < resumed_version):
                    keep[j] = False
    return [r for r, k in zip(records, keep) if k]


EVAL_ROLES = ("trainer", "evaluator")  # eval.mode=inline writes trainer records, eval.mode=process its own


def eval_records(run_dir: str | Path, key: str = "eval_score") -> list[dict[str, Any]]:
    """The run's evaluation records (those holding `key`), by trainer step: the trainer's
    (eval.mode=inline) and the evaluator role's (eval.mode=process), rolled-back ones dropped.
    A step evaluated twice (an evaluator restarted between its result and its unpin) counts once,
    the later record."""
    by_step: dict[int, dict[str, Any]] = {}
    for r in read_metrics(run_dir):
        if r.get("role") in EVAL_ROLES and key in r:
            by_step[int(r["step"])] = r
    return [by_step[s] for s in sorted(by_step)]


def plot_learning_curve(run_dir: str | Path, out: str | Path | None = None, metric: str = "accuracy") -> Path | None:
    """The eval headline metric (`eval_score`, named `metric`) and the training reward against
    trainer step and wall time, as one PNG."""
    _require("matplotlib", "plot_learning_curve").use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    train = [r for r in records if r.get("role") == "trainer" and "reward_mean" in r]
    key = "eval_score" if any("eval_score" in r for r in records) else "eval_accuracy"  # older runs
    evals = eval_records(run_dir, key)
    if not train and not evals:
        return None
    t0 = min(r["time"] for r in records)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    if evals:
        axes[0].plot([r["step"] for r in evals], [r[key] for r in evals], "o-", label=f"eval {metric}")
        # eval.mode=process: when the trainer published the evaluated params, not when they were evaluated
        when = [r.get("params_time", r["time"]) for r in evals]
        axes[1].plot([(t - t0) / 60 for t in when], [r[key] for r in evals], "o-", label=f"eval {metric}")
    if train:
        steps = np.array([r["step"] for r in train])
        reward = np.array([r["reward_mean"] for r in train], dtype=float)
        window = max(1, len(reward) // 20)
        smooth = np.convolve(reward, np.ones(window) / window, mode="valid")
        axes[0].plot(steps[window - 1 :], smooth, label=f"train reward (mean of {window})")
        axes[1].plot((np.array([r["time"] for r in train])[window - 1 :] - t0) / 60, smooth, label="train reward")
    axes[0].set_xlabel("trainer step")
    axes[1].set_xlabel("wall time (min)")
    values = [r[key] for r in evals] + [r["reward_mean"] for r in train]
    in_unit = all(0.0 <= float(v) <= 1.0 for v in values if v == v)
    for ax in axes:
        if in_unit:  # accuracies and 0/1 rewards: a fixed scale makes runs comparable
            ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.suptitle(Path(run_dir).name)
    fig.tight_layout()
    out = Path(out or Path(run_dir) / "plots" / "learning_curve.png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
