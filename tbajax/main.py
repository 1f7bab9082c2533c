"""Command line: `python -m tbajax.main [--experiment=NAME] [--set key=value ...]`.

With no arguments it runs the embedded default experiment (a tiny arithmetic policy trained with
TBA on CPU, offline). `--role=trainer|searcher|evaluator` runs one role alone, so a scheduler can place the
roles on different hosts that share the run directory (or a bucket URL via --store).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

DEFAULT_EXPERIMENT = "tiny_arithmetic"


def experiment_dirs() -> list[Path]:
    """Where `--experiment=NAME` is looked up: $TBAJAX_EXPERIMENTS, ./experiments, the repo's."""
    dirs = []
    if os.environ.get("TBAJAX_EXPERIMENTS"):
        dirs.append(Path(os.environ["TBAJAX_EXPERIMENTS"]))
    dirs.append(Path.cwd() / "experiments")
    dirs.append(Path(__file__).resolve().parent.parent / "experiments")
    seen: list[Path] = []
    for d in dirs:
        if d.is_dir() and d.resolve() not in [s.resolve() for s in seen]:
            seen.append(d)
    return seen


def list_experiments() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for d in experiment_dirs():
        for p in sorted(d.glob("*.py")):
            if not p.name.startswith("_") and p.stem not in found and "def config(" in p.read_text():
                found[p.stem] = p
    return found


def load_experiment(name: str):  # -> ExperimentConfig
    """An experiment by name (experiments/<name>.py) or by path to a .py file with `config()`."""
    from tbajax.config import ConfigError

    path = Path(name)
    if path.suffix != ".py":
        available = list_experiments()
        if name not in available:
            raise ConfigError(f"unknown experiment {name!r}; available: {', '.join(available) or 'none found'}")
        path = available[name]
    if not path.exists():
        raise ConfigError(f"experiment file {path} does not exist")
    from tbajax.imports import load_module

    module = load_module(str(path))
    if not hasattr(module, "config"):
        raise ConfigError(f"{path} defines no `config()` function returning an ExperimentConfig")
    return module.config()


def build_parser() -> argparse.ArgumentParser:
    from tbajax.config import describe_fields

    experiments = ", ".join(list_experiments()) or "(none found)"
    epilog = (
        f"experiments: {experiments}\n\n"
        "overrides (--set key=value, repeatable; values parsed as JSON when possible):\n  "
        + "\n  ".join(describe_fields())
        + "\n\nexamples:\n"
        "  python -m tbajax.main                                  # tiny offline default on CPU\n"
        "  python -m tbajax.main --experiment=math_qwen --set model.checkpoint=/ckpt/Qwen2.5-7B\n"
        "  python -m tbajax.main --objective=dr_grpo --mode=sync --set train.steps=50\n"
        "  python -m tbajax.main --run-dir=runs/x --role=searcher --searcher-id=3   # one role alone\n"
        "  python -m tbajax.main --launcher=ray --ray-address=auto --set system.ray.trainer_gpus=1\n"
    )
    ap = argparse.ArgumentParser(
        prog="python -m tbajax.main",
        description="Asynchronous off-policy LLM post-training with Trajectory Balance (TBA).",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--experiment", default=None, help=f"name or path to a .py file (default: {DEFAULT_EXPERIMENT})")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field, e.g. --set train.steps=200")
    ap.add_argument("--objective", help="shortcut for --set train.objective=NAME (tb, tba_prime, dr_grpo, grpo, ...)")
    ap.add_argument("--mode", choices=["async", "sync"], help="shortcut for --set system.mode=MODE")
    ap.add_argument("--run-dir", type=Path, help="where everything of the run is written (default: runs/<experiment>-<time>)")
    ap.add_argument("--store", help="URL of the stores (file://, gs://, s3://); default: the run dir")
    ap.add_argument("--resume", action="store_true", help="continue the run in --run-dir after a crash")
    ap.add_argument("--role", choices=["launcher", "trainer", "searcher", "evaluator"], default="launcher",
                    help="run one role alone (default: launch trainer + searchers (+ the evaluator with "
                         "eval.mode=process) as processes)")
    ap.add_argument("--searcher-id", type=int, default=0)
    ap.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--launcher", choices=["process", "ray"], default="process",
                    help="how the launcher runs the roles: local processes (default) or Ray actors placed by "
                         "system.ray.* resources (pip install 'tbajax[ray]'; the run dir must be on a shared filesystem)")
    ap.add_argument("--ray-address", help="--launcher=ray: the cluster to join (auto, host:port, ray://host:port); "
                                          "default: start a local Ray instance")
    ap.add_argument("--coordinator-address", help="multi-host trainer: jax.distributed coordinator host:port")
    ap.add_argument("--num-processes", type=int, help="multi-host trainer: number of JAX processes")
    ap.add_argument("--process-id", type=int, help="multi-host trainer: this process's index")
    ap.add_argument("--heartbeat-timeout", type=int, default=30, metavar="S",
                    help="multi-host trainer: a process silent this long is declared dead and every process "
                         "stops, naming it (default: 30 s)")
    return ap


def resolve_config(args: argparse.Namespace):  # -> ExperimentConfig
    """The experiment with its overrides applied. `--resume` without `--experiment` starts from
    the run's stored config.json, so `--run-dir=X --resume --set train.steps=N` extends a run."""
    from tbajax.config import apply_overrides
    from tbajax.system import rundir

    stored = args.run_dir is not None and (args.run_dir / "config.json").is_file()
    if args.resume and args.experiment is None and args.role == "launcher" and stored:
        config = rundir.load_config(args.run_dir)
    else:
        config = load_experiment(args.experiment or DEFAULT_EXPERIMENT)
    overrides = list(args.overrides)
    if args.objective:
        overrides.append(f"train.objective={args.objective}")
    if args.mode:
        overrides.append(f"system.mode={args.mode}")
    return apply_overrides(config, overrides)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {args.role}{'-' + str(args.searcher_id) if args.role == 'searcher' else ''} "
        "%(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,  # importing jax may already have configured the root logger
    )
    for noisy in ("absl", "jax._src", "orbax", "tensorstore", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from tbajax.config import ConfigError
    from tbajax.models import CheckpointError

    try:
        return _run(args)
    except (ConfigError, CheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SyntaxError as e:  # a user's experiment / objective / task file
        print(f"error: SyntaxError in {e.filename}, line {e.lineno}: {e.msg}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    import time

    from tbajax.system import rundir

    if args.coordinator_address:
        from tbajax.config import ConfigError

        if args.role != "trainer":
            raise ConfigError(
                f"--coordinator-address is for the trainer only, not --role={args.role}: a searcher is one "
                "process on one host's devices (it decides no prompts with peers; see system.searcher_mesh). "
                "For more generation throughput run more single-host searchers (system.num_searchers); "
                "the launcher starts a multi-process trainer itself with system.trainer_processes")
        from tbajax.system import distributed

        try:
            distributed.initialize(args.coordinator_address, args.num_processes, args.process_id,
                                   heartbeat_timeout_s=args.heartbeat_timeout)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    given_config = args.experiment is not None or args.overrides or args.objective or args.mode
    if args.role != "launcher" and args.run_dir is not None and not given_config:
        config = rundir.load_config(args.run_dir)  # a role started by the launcher / a scheduler
    else:
        config = resolve_config(args)
    if args.print_config:
        print(config.to_json())
        return 0
    run_dir: Path = args.run_dir or Path("runs") / f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if args.role == "trainer":
        if args.coordinator_address and config.system.mode == "sync":
            from tbajax.config import ConfigError

            raise ConfigError("a multi-process trainer (--coordinator-address) needs system.mode=async: in sync mode "
                              "the trainer generates its own batches, and generation runs in one process")
        if given_config:
            _write_or_check_config(run_dir, config)
        from tbajax.system.out_of_memory import explain_out_of_memory
        from tbajax.system.trainer import run_trainer

        if args.coordinator_address:
            from tbajax.system.distributed import fail_fast

            try:
                with explain_out_of_memory(config, "trainer"):
                    summary = run_trainer(run_dir, resume=args.resume, store_url=args.store)
            except BaseException as e:  # noqa: BLE001 - tell the peers, skip JAX's shutdown barrier
                fail_fast(e)
        else:
            with explain_out_of_memory(config, "trainer"):
                summary = run_trainer(run_dir, resume=args.resume, store_url=args.store)
        print(json.dumps(summary, indent=2))
        return 0
    if args.role == "searcher":
        if given_config:
            _write_or_check_config(run_dir, config)
        from tbajax.system.out_of_memory import explain_out_of_memory
        from tbajax.system.searcher import run_searcher

        with explain_out_of_memory(config, "searcher"):
            run_searcher(run_dir, args.searcher_id, store_url=args.store)
        return 0
    if args.role == "evaluator":
        if given_config:
            _write_or_check_config(run_dir, config)
        from tbajax.system.evaluator import run_evaluator
        from tbajax.system.out_of_memory import explain_out_of_memory

        with explain_out_of_memory(config, "evaluator"):
            run_evaluator(run_dir, store_url=args.store)
        return 0

    from tbajax.config import ConfigError
    from tbajax.system.launcher import launch, read_summary, resume_command

    if args.launcher != "ray" and args.ray_address:
        raise ConfigError("--ray-address needs --launcher=ray")
    if args.launcher == "ray" and config.system.trainer_processes > 1:
        raise ConfigError(
            f"system.trainer_processes={config.system.trainer_processes}: --launcher=ray starts the trainer as one "
            "actor; start a multi-process trainer with the process launcher (one machine) or one "
            "`--role=trainer --coordinator-address=...` per host (see the README's multi-host section)")
    evaluator = config.system.mode == "async" and config.eval.mode == "process"
    searchers = config.system.num_searchers if config.system.mode == "async" else 0
    units = ("Ray actor", "Ray actors") if args.launcher == "ray" else ("process", "processes")
    print(f"tbajax: experiment {config.name!r} ({config.system.mode}, objective {config.train.objective}, "
          f"{searchers} searcher {units[searchers != 1]}"
          f"{' + an evaluator' if evaluator else ', evaluation inline in the trainer'}) -> {run_dir}",
          flush=True)
    if config.system.compile_cache is not None:
        from tbajax.system.launcher import compile_cache_dir

        cache = compile_cache_dir(config.system.compile_cache, os.environ)
        print(f"compiled programs are kept in {cache} (system.compile_cache; null turns it off)", flush=True)
    if config.system.mode == "sync" and config.eval.mode == "process":
        print("note: eval.mode=process needs async mode; this sync run evaluates inline, in its one process",
              flush=True)
    session_start = time.time() - 1.0  # file times can be coarser than time.time()
    if args.launcher == "ray":
        from tbajax.system import ray_launcher

        code = ray_launcher.launch(config, run_dir, resume=args.resume, quiet=args.quiet,
                                   address=args.ray_address, store=args.store)
    else:
        code = launch(config, run_dir, resume=args.resume, quiet=args.quiet)
    summary = read_summary(run_dir, since=session_start)  # never a previous session's table
    if summary is not None:
        print_summary(summary, run_dir)
        if summary.get("stopped_early"):
            steps = rundir.checkpoint_steps(run_dir)
            print(f"stopped early at trainer step {summary['trainer_steps']} of {config.train.steps}"
                  f"{f' (last checkpoint: step {steps[-1]})' if steps else ''}; continue with: "
                  f"{resume_command(run_dir)}{' --launcher=ray' if args.launcher == 'ray' else ''}")
    return code


def _write_or_check_config(run_dir: Path, config) -> None:  # noqa: ANN001
    from tbajax.config import ConfigError
    from tbajax.system import rundir

    path = run_dir / "config.json"
    rundir.make_run_dir(run_dir)
    if path.exists():
        if json.loads(path.read_text()) != config.to_dict():
            raise ConfigError(f"{path} holds a different configuration; use the same experiment and overrides")
    else:
        rundir.write_json_atomic(path, config.to_dict())


def print_summary(summary: dict, run_dir: Path) -> None:
    rows = [
        (f"eval {summary.get('eval_metric', 'accuracy')} (start -> end)",
         f"{summary.get('eval_score_start', summary.get('eval_accuracy_start', float('nan'))):.3f} -> "
         f"{summary.get('eval_score_end', summary.get('eval_accuracy_end', float('nan'))):.3f}"),
        ("trainer steps", summary["trainer_steps"]),
        ("samples generated", summary["samples_generated"]),
        ("wall time", f"{summary['wall_time_s']:.1f} s"),
        ("trainer waiting for data", f"{summary['trainer_wait_s']:.1f} s"),
        ("policy lag (mean / max)", f"{summary.get('policy_lag_mean', float('nan')):.2f} / {summary.get('policy_lag_max', '-')} versions"),
        ("final param version", summary["final_version"]),
        ("run directory", str(run_dir)),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n" + "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows))
    print(f"(summary.json, metrics.jsonl, tensorboard/ and plots/learning_curve.png are in {run_dir}; "
          f"`python -m tbajax.export {run_dir}` writes the policy as a Hugging Face checkpoint)")


def entry_point() -> int:
    """`python -m tbajax.main` and the `tbajax` command: the process is ours, so its host allocator
    is set up first, before any thread allocates (tbajax/system/host_memory.py); `main()` called
    from other code leaves the caller's process alone."""
    from tbajax.system.host_memory import keep_freed_memory

    try:
        keep_freed_memory()
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return main()


if __name__ == "__main__":
    sys.exit(entry_point())
