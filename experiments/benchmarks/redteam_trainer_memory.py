"""Peak RSS of the red-team trainer's update: the old recipe (full fine-tuning + a reference copy)
vs the new one (LoRA r 32, α 16, no reference copy), on the redteam_smollm2 attacker.

    python experiments/benchmarks/redteam_trainer_memory.py [--quick] [--steps 3] [--json PATH]

Each arm runs in its own process (so its peak RSS is its own): load the attacker as the trainer
does, build the trainer's `Learner` from the `redteam_smollm2` config (with the arm's overrides),
and apply `--steps` updates on synthetic red-team batches shaped like the recipe's (2 groups × K 8
attacks of 20 tokens after the 31-token prompt). It measures the *update side* of the trainer
process only: a sync-mode run adds the victim/prior scorer (one more frozen copy of the weights,
the same in both arms), the BiLSTM judge, the sampler's KV cache and the evaluation, so a whole
run's peak RSS is higher than these figures in both arms. Reported: peak RSS after loading the
model, after building the trainer state, after the updates; the train state's bytes; the
seconds per update (steady state). `--model DIR` (default: the recipe's SmolLM2 directory) and
`--quick` (a tiny random Llama instead, a pipeline check only).

    before: --set model.lora=null --set train.trainer.compute_reference_logprobs=true  (the 2026-12-01 recipe)
    after:  the recipe as shipped
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT)]

from common import machine, make_llama_checkpoint, peak_rss_mb, print_table, write_json  # noqa: E402

ARMS = {
    "before (full FT + reference copy)": ["model.lora=null", "train.trainer.compute_reference_logprobs=true"],
    "after (LoRA r32 a16, no reference)": [],
}
PROMPT_TOKENS = 31
ATTACK_TOKENS = 20


def _child(model_dir: str, overrides: list[str], steps: int) -> dict[str, Any]:
    import jax
    import numpy as np

    from tbajax.config import apply_overrides
    from tbajax.main import load_experiment
    from tbajax.models import load_model
    from tbajax.sharding import make_mesh
    from tbajax.system.trainer import Learner
    from tbajax.trajectory import Trajectory

    config = apply_overrides(load_experiment("redteam_smollm2"), [f"model.checkpoint={model_dir}", *overrides])
    out: dict[str, Any] = {"rss_start_mb": peak_rss_mb()}
    mesh = make_mesh(config.system.trainer_mesh)
    model = load_model(config.model.checkpoint, mesh=mesh, param_dtype=config.model.param_dtype,
                       dtype=config.model.dtype, remat=config.model.remat)
    out["rss_after_load_mb"] = peak_rss_mb()
    learner = Learner(config, model, mesh)
    del model
    out["rss_after_state_mb"] = peak_rss_mb()
    out["state_mb"] = sum(x.nbytes for x in jax.tree.leaves(learner.trainer.state) if hasattr(x, "nbytes")) / 2**20
    vocab = int(learner.trainer.policy().config.vocab_size)
    rng = np.random.default_rng(0)
    k, g = config.buffer.samples_per_group, config.train.groups_per_step
    prompt = rng.integers(3, vocab, PROMPT_TOKENS).astype(np.int32)

    def groups(step: int) -> list[list[Trajectory]]:
        return [[Trajectory(prompt_id=0, group_id=step * g + j, prompt_tokens=prompt,
                            response_tokens=rng.integers(3, vocab, ATTACK_TOKENS).astype(np.int32),
                            behavior_logprobs=np.full(ATTACK_TOKENS, -3.0, np.float32),
                            reward=float(rng.normal(-30, 5)), finished=False)
                 for _ in range(k)] for j in range(g)]

    times = []
    for s in range(steps):
        batch = learner.prepare(groups(s))
        t0 = time.perf_counter()
        learner.trainer.submit(batch)
        metrics = learner.trainer.flush()
        times.append(time.perf_counter() - t0)
        assert metrics is not None and np.isfinite(metrics["loss"]), metrics
    out["rss_after_updates_mb"] = peak_rss_mb()
    out["first_update_s"] = times[0]
    out["update_s"] = min(times[1:]) if len(times) > 1 else times[0]
    out["lora"] = None if config.model.lora is None else {"rank": config.model.lora.rank,
                                                          "alpha": config.model.lora.alpha}
    out["reference_copy"] = bool(learner.trainer.state.ref_params is not None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="attacker checkpoint (default: the recipe's SmolLM2 dir)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a tiny random Llama: checks the pipeline only")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        spec = json.loads(args.child)
        print("RESULT " + json.dumps(_child(spec["model"], spec["overrides"], spec["steps"])), flush=True)
        return
    if args.quick:
        model = str(make_llama_checkpoint("10M"))
    else:
        sys.path.insert(0, str(ROOT / "experiments"))
        from redteam_smollm2 import model_dir

        model = args.model or str(model_dir())
        if not Path(model).is_dir():
            raise SystemExit(f"no attacker checkpoint at {model}: see experiments/redteam_smollm2.py (assets)")
    info = machine()
    rows = []
    for name, overrides in ARMS.items():
        spec = json.dumps({"model": model, "overrides": overrides, "steps": args.steps})
        env = {**os.environ}
        env.pop("XLA_FLAGS", None)
        proc = subprocess.run([sys.executable, __file__, "--child", spec], capture_output=True, text=True, env=env,
                              check=False)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            raise SystemExit(f"arm {name!r} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        rows.append({"arm": name, "overrides": overrides, **json.loads(line.removeprefix("RESULT "))})
    before, after = rows
    ratios = {k: after[k] / before[k] for k in ("rss_after_updates_mb", "state_mb", "update_s")}
    print_table(rows, ["arm", "rss_after_load_mb", "rss_after_state_mb", "rss_after_updates_mb", "state_mb",
                       "first_update_s", "update_s"])
    print("after / before: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    print(f"load average {os.getloadavg()[0]:.1f}, matmul {info['matmul_gflops']:.0f} GFLOP/s")
    write_json(args.json, {"benchmark": "redteam_trainer_memory", "model": model, "quick": args.quick,
                           "steps": args.steps, "arms": rows, "ratios_after_over_before": ratios,
                           "machine": info, "load_average_end": os.getloadavg()[0]})


if __name__ == "__main__":
    main()
