"""A role's metrics records, also logged to Weights & Biases (`system.wandb`).

One W&B run per role (the trainer, each searcher, the evaluator) in one W&B group per tbajax
run: W&B's layout for a job of several processes, each of which logs its own run. The ids come
from the run directory and the role, so a restarted or resumed role continues its own W&B run
(resume="allow"). Every record is logged against its own "step" field (`define_metric`), the
trainer step for the trainer and the evaluator, a searcher's committed rows for a searcher: W&B
drops a record whose implicit step goes back, which a trainer resumed from an earlier checkpoint
than its last logged step would otherwise do.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tbajax.config import ConfigError, ExperimentConfig, WandbSpec

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


def wandb_names(run_dir: Path, role: str, spec: WandbSpec) -> tuple[str, str, str]:
    """(group, run id, display name) of `role`'s W&B run. The default group is the run
    directory's name (W&B's id characters only) and a hash of its absolute path, so two runs
    with the same directory name on different paths or machines do not share W&B runs."""
    path = Path(run_dir).resolve()
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
    group = spec.group or f"{_UNSAFE.sub('-', path.name).strip('-')[:40]}-{digest}"
    run_id = f"{_UNSAFE.sub('-', group)[:48]}-{_UNSAFE.sub('-', role)}"[:64]
    return group, run_id, f"{path.name}/{role}"


def import_wandb() -> Any:
    """The wandb package, or a ConfigError saying how to get it (it is an optional extra)."""
    try:
        import wandb
    except ImportError:
        raise ConfigError("system.wandb logs to Weights & Biases, which needs the wandb package: "
                          "pip install 'tbajax[wandb]' (or set system.wandb=null)") from None
    return wandb


def loggable(record: Mapping[str, Any]) -> dict[str, float | int]:
    """The record's numbers (W&B keeps its own time; strings and lists stay in metrics.jsonl)."""
    return {k: v for k, v in record.items()
            if k not in ("time", "role") and isinstance(v, (int, float)) and not isinstance(v, bool)}


class WandbRun:
    """A role's W&B run: `log` takes the records `MetricsWriter` writes to metrics.jsonl."""

    def __init__(self, spec: WandbSpec, run_dir: Path, role: str, config: Mapping[str, Any]):
        wandb = import_wandb()
        group, run_id, name = wandb_names(run_dir, role, spec)
        try:
            self.run = wandb.init(
                project=spec.project, entity=spec.entity, group=group, job_type=role.split("-")[0],
                name=name, id=run_id, resume="allow", dir=str(run_dir), mode=spec.mode,
                tags=list(spec.tags), config=dict(config))
        except Exception as e:  # wandb raises its own types (no login, no network, bad entity)
            hint = (" Log in (`wandb login`, or WANDB_API_KEY) and check the network, or log offline "
                    "with --set system.wandb.mode=offline and upload later with `wandb sync`"
                    if spec.mode == "online" else "")
            raise RuntimeError(f"could not start the W&B run {run_id!r} of project {spec.project!r}: "
                               f"{type(e).__name__}: {e}.{hint}") from e
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, record: Mapping[str, Any]) -> None:
        self.run.log(loggable(record))

    def close(self) -> None:
        self.run.finish()


def open_wandb(config: ExperimentConfig, run_dir: Path, role: str) -> WandbRun | None:
    """`role`'s W&B run when the experiment asks for one (system.wandb), else None."""
    spec = config.system.wandb
    return None if spec is None else WandbRun(spec, Path(run_dir), role, config.to_dict())
