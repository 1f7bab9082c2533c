"""A checkpoint scored by an experiment's held-out evaluation, the one its trainer runs.

    python -m tbajax.evaluate [--experiment NAME | --run-dir RUN] [--model DIR_OR_HUB_ID]
                              [--version N | --checkpoint STEP] [--set KEY=VALUE ...] [--json PATH]

The same eval problems, prompts, greedy (or, for red-teaming, sampled) decoding, graders and
metrics as the trainer's `eval_*` records (`tbajax.system.evaluation.Evaluator`), for any model:
a base model, an export (`python -m tbajax.export`), another library's fine-tune of the same
architecture (`--model` replaces `model.checkpoint`, and its tokenizer too unless
`model.tokenizer` is set), or, with `--run-dir`, a param version or trainer checkpoint the run
stored (`--version`, `--checkpoint`; `tbajax.export.choose_source`), read in place. Without
either, the experiment's own checkpoint is scored: the step-0 figure of its runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def evaluate(config: Any, checkpoint: str | None = None, policy: Any = None) -> dict[str, Any]:
    """{"eval_metric": its name, "eval_score": the task's headline metric, "eval_<name>": every
    metric, "eval_problems": how many, "eval_samples_per_problem": 1 (greedy) or n (sampled)} of
    `policy` (a `CausalLM`), else of `checkpoint` (None: `config.model.checkpoint`), under
    `config`'s evaluation on the searcher mesh."""
    from tbajax.models import load_model
    from tbajax.sharding import make_mesh
    from tbajax.system.evaluation import Evaluator
    from tbajax.system.searcher import make_reward_pool

    if checkpoint is not None:
        model_spec = dataclasses.replace(config.model, checkpoint=str(checkpoint))
        config = dataclasses.replace(config, model=model_spec)
    mesh = make_mesh(config.system.searcher_mesh)
    model = policy if policy is not None else load_model(
        config.model.checkpoint, mesh=mesh, param_dtype=config.model.param_dtype, dtype=config.model.dtype,
        attention=config.model.attention)
    reward_pool = make_reward_pool(config)
    try:
        evaluator = Evaluator(config, model, mesh, reward_pool)
        with progress(len(evaluator.problems), "eval problems") as done:
            out = evaluator.run(model, done)
        out["eval_problems"] = float(len(evaluator.problems))
        out["eval_samples_per_problem"] = float(evaluator.sampling.num_samples)
        return {"eval_metric": evaluator.metric, **out}  # type: ignore[dict-item]
    finally:
        if reward_pool is not None:
            reward_pool.close()


@contextlib.contextmanager
def progress(total: int, unit: str, every_s: float = 10.0) -> Iterator[Callable[[int], None]]:
    """A callback taking how many of `total` are done: a bar on a terminal, else a line on stderr
    at most every `every_s` seconds (and at the end), for logs."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        with tqdm(total=total, unit=unit.split()[-1], desc=unit, dynamic_ncols=True) as bar:
            yield lambda n: bar.update(n - bar.n)
        return
    start = last = time.monotonic()

    def line(n: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= every_s or n >= total:
            last = now
            print(f"{n}/{total} {unit} in {now - start:.0f} s", file=sys.stderr, flush=True)

    yield line


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tbajax.evaluate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    config = ap.add_mutually_exclusive_group()
    config.add_argument("--experiment", help="name or path to a .py file (default: the embedded default)")
    config.add_argument("--run-dir", type=Path, help="take the config of this run")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--model", help="the checkpoint to score: a local HF directory or a hub id "
                                       "(default: model.checkpoint)")
    which.add_argument("--version", type=int, help="with --run-dir: a param version the run published")
    which.add_argument("--checkpoint", type=int, metavar="STEP", help="with --run-dir: a trainer checkpoint")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="config override, as for python -m tbajax.main (e.g. eval.num_problems=100)")
    ap.add_argument("--json", type=Path, help="also write the metrics to this file")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.ERROR)
    # On a GPU a run may still be training on: take memory as the evaluation needs it, not the 75%
    # JAX reserves up front by default (the caller's setting wins; too late once jax has started).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from tbajax.config import ConfigError, apply_overrides
    from tbajax.export import ExportError, read_stored_policy
    from tbajax.main import DEFAULT_EXPERIMENT, load_experiment
    from tbajax.models import CheckpointError
    from tbajax.stores.params import ParamStoreError, ParamVersionError
    from tbajax.system import rundir
    from tbajax.system.run_model import with_run_tokenizer

    stored = args.version is not None or args.checkpoint is not None
    try:
        if stored and args.run_dir is None:
            raise ConfigError("--version and --checkpoint name what a run stored: give its --run-dir")
        if args.run_dir is not None:
            config = rundir.load_config(args.run_dir)
            if stored:  # the run's own tokenizer copy, where it has one (`--set model.tokenizer` still wins)
                config = with_run_tokenizer(args.run_dir, config)
        else:
            config = load_experiment(args.experiment or DEFAULT_EXPERIMENT)
        config = apply_overrides(config, args.overrides)
        if stored:
            policy = read_stored_policy(args.run_dir, version=args.version, checkpoint=args.checkpoint)
            model, out = f"{args.run_dir}: {policy.source}", evaluate(config, policy=policy.model())
        else:
            model, out = args.model or config.model.checkpoint, evaluate(config, args.model)
    except (ConfigError, CheckpointError, ExportError, ParamStoreError, ParamVersionError,
            FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n, k = int(out["eval_problems"]), int(out["eval_samples_per_problem"])
    how = "greedy" if k == 1 else f"{k} samples each"
    print(f"{config.name}: {model} on {n} eval problem{'s' if n != 1 else ''} ({how})")
    shown = {k: v for k, v in out.items() if k not in ("eval_problems", "eval_samples_per_problem")}
    width = max(len(k) for k in shown)
    for k, v in shown.items():
        print(f"  {k.ljust(width)}  {v if isinstance(v, str) else f'{v:.4f}'}")
    if args.json is not None:
        record = {"experiment": config.name, "model": str(model), **out}
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
