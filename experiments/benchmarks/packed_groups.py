"""Trainer step with groups packed (`TrainerConfig.pack_groups`, back to back or strided) vs the row layout.

    python experiments/benchmarks/packed_groups.py [--checkpoint DIR] [--quick] [--json PATH]

The K samples of a prompt share that prompt. The row layout scores it K times (K rows of P + R
tokens); packing scores it once (one row of P + K·R tokens whose responses attend to the prompt and
to themselves only). Both steps run the same TB update (reference forward + policy forward and
backward + AdamW) on the same groups: the loss must agree, and the reference for the speed-up is
the row-layout step measured in this run. "token ratio" is the speed-up if time were proportional
to tokens scored; attention over the longer packed rows and the unchanged per-step overheads are
what keep the measured figure below it.

The strided layout (`TrainerConfig.pack_strided`) also runs the prompt once per group, but puts
each response at a fixed stride (the longest response, bucketed) and runs attention per response
over the prompt and itself: more (padding) tokens than packing where responses vary in length,
but no attention across the whole packed row, which grows as (P + K·R)^2. The three layouts'
steps are compiled first and then timed in alternating rounds.

`pack_groups="auto"` (`tbajax.training.layout`) would pick the layout of least estimated cost:
the table gives each layout's estimated speed-up (rows' estimated cost / its own) beside the
measured one, and the script says whether the pick is the layout that ran fastest.

A second table times the packed step with its attention in causal blocks (the packed mask as a
`CausalMask`: the blocks above the diagonal skipped) and over whole rows, in alternating rounds in
this process; `models.decoder.PACKED_CAUSAL_BLOCKS_MIN` picks between them by row width.

Default shapes are the SmolLM2 Countdown experiment's: prompts of ~160 tokens, answers of ~12,
4 groups of K = 8. Without --checkpoint a random 50M Llama-style checkpoint is generated.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT)]

import numpy as np  # noqa: E402
from common import machine, make_llama_checkpoint, print_table, write_json  # noqa: E402


def make_groups(groups: int, k: int, prompt: int, response: int, vocab: int, seed: int = 0) -> list[list[Any]]:
    """Groups of K trajectories sharing a random prompt; responses of response/2 .. response tokens."""
    from tbajax.trajectory import Trajectory

    r = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        p = r.integers(3, vocab, prompt).astype(np.int32)
        rows = []
        for _ in range(k):
            n = int(r.integers(max(1, response // 2), response + 1))
            rows.append(Trajectory(
                prompt_id=g, group_id=g, prompt_tokens=p,
                response_tokens=r.integers(3, vocab, n).astype(np.int32),
                behavior_logprobs=np.zeros(n, np.float32), reward=float(r.integers(0, 2)),
            ))
        out.append(rows)
    return out


LAYOUTS = {"rows": (False, False), "packed": (True, False), "strided": (True, True)}


def run(checkpoint: str, groups: int, k: int, prompt: int, response: int, repeats: int,
        length_bucket: int = 32) -> list[dict[str, Any]]:
    """The TB step in each layout (`LAYOUTS`: pack_groups, pack_strided), compiled first, then
    timed in alternating rounds (median of `repeats`), each from its own copy of the state;
    `length_bucket` rounds row lengths as `train.length_bucket` does."""
    import jax

    from tbajax.batch import collate
    from tbajax.models import load_model
    from tbajax.training import LRSchedule, OptimizerConfig, TrainerConfig, init_train_state, make_train_step

    model = load_model(checkpoint)
    vocab = model.config.vocab_size
    data = make_groups(groups, k, prompt, response, vocab)
    base = TrainerConfig(optimizer=OptimizerConfig(lr=LRSchedule(peak=1e-6)), temperature=0.7, compute_dtype="float32")
    arms: dict[str, dict[str, Any]] = {}
    for layout, (pack, strided) in LAYOUTS.items():
        config = dataclasses.replace(base, pack_groups=pack, pack_strided=strided)
        batch = jax.device_put(collate(data, beta=0.05, pack_microbatches=1 if pack else None,
                                       pack_strided=strided, length_bucket=length_bucket))
        graphdef, state = init_train_state(model, config)
        step = make_train_step(graphdef, config, "tb")
        t0 = time.perf_counter()
        state, out = step(state, batch)
        arms[layout] = {"step": step, "state": state, "batch": batch, "times": [],
                        "first_loss": float(out.metrics["loss"]), "first_step_s": time.perf_counter() - t0}
    for _ in range(repeats):
        for arm in arms.values():
            t0 = time.perf_counter()
            arm["state"], out = arm["step"](arm["state"], arm["batch"])
            out.metrics["loss"].block_until_ready()
            arm["times"].append(time.perf_counter() - t0)
    from tbajax.training.layout import layout_work, step_cost

    weight = base.layout_attention_weight  # pack_groups="auto"'s default
    costs = {layout: step_cost(layout_work(arm["batch"]), model.config, weight)
             for layout, arm in arms.items()}
    results = []
    for layout, arm in arms.items():
        batch = arm["batch"]
        pk = batch.packed
        results.append({
            "layout": layout,
            "estimated_cost": costs[layout],
            "auto_picks": layout == min(costs, key=costs.get),
            "tokens_in_step": int(batch.tokens.size if pk is None else pk.tokens.size),
            "real_tokens": int(batch.attention_mask.sum() if pk is None else (pk.segments >= 0).sum()),
            "step_s": float(np.median(arm["times"])),
            "step_times": arm["times"],
            "first_step_s": arm["first_step_s"],
            "first_loss": arm["first_loss"],
        })
    rows = results[0]
    for r in results:
        r["speedup"] = rows["step_s"] / r["step_s"]
        r["estimated_speedup"] = rows["estimated_cost"] / r["estimated_cost"]
        r["attention_weight"] = weight
        r["token_ratio"] = rows["tokens_in_step"] / r["tokens_in_step"]
        r["share_of_token_ratio"] = r["speedup"] / r["token_ratio"]
        r["loss_rel_diff"] = abs(r["first_loss"] - rows["first_loss"]) / max(abs(rows["first_loss"]), 1e-12)
    results[1]["block_arms"] = _causal_block_arms(model, data, base, repeats, length_bucket)
    return results


def _causal_block_arms(model: Any, data: list, base: Any, repeats: int, length_bucket: int) -> dict[str, Any]:
    """The packed step compiled with the causal blocks at any width and at none (the threshold is
    read at trace time), each from its own copy of the state, timed in alternating rounds."""
    import jax

    from tbajax.batch import collate
    from tbajax.models import decoder
    from tbajax.training import init_train_state, make_train_step

    config = dataclasses.replace(base, pack_groups=True)
    batch = jax.device_put(collate(data, beta=0.05, pack_microbatches=1, length_bucket=length_bucket))
    default = decoder.PACKED_CAUSAL_BLOCKS_MIN
    steps, states = {}, {}
    try:
        for arm, threshold in (("causal blocks", 0), ("whole rows", 1 << 30)):
            decoder.PACKED_CAUSAL_BLOCKS_MIN = threshold
            graphdef, states[arm] = init_train_state(model, config)
            steps[arm] = make_train_step(graphdef, config, "tb").lower(states[arm], batch).compile()
            states[arm], out = steps[arm](states[arm], batch)  # warm-up
            out.metrics["loss"].block_until_ready()
    finally:
        decoder.PACKED_CAUSAL_BLOCKS_MIN = default
    times: dict[str, list[float]] = {arm: [] for arm in steps}
    for _ in range(max(repeats, 5)):
        for arm, step in steps.items():
            t0 = time.perf_counter()
            states[arm], out = step(states[arm], batch)
            out.metrics["loss"].block_until_ready()
            times[arm].append(time.perf_counter() - t0)
    width = int(batch.packed.tokens.shape[1])
    return {
        "width": width,
        "default_uses_blocks": width >= default,
        "causal_blocks_s": float(np.median(times["causal blocks"])),
        "whole_rows_s": float(np.median(times["whole rows"])),
        "blocks_speedup": float(np.median([w / c for c, w in zip(times["causal blocks"],
                                                                  times["whole rows"])])),
        "times": times,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="HF checkpoint dir (default: a generated random 50M Llama)")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=160)
    ap.add_argument("--response", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--length-bucket", type=int, default=32,
                    help="row lengths' rounding (train.length_bucket)")
    ap.add_argument("--quick", action="store_true", help="10M model, 2 groups of 4, 1 repeat")
    ap.add_argument("--json", help="write the figures to this path")
    args = ap.parse_args()
    if args.quick:
        args.groups, args.k, args.repeats = 2, 4, 1
    checkpoint = args.checkpoint or str(make_llama_checkpoint("10M" if args.quick else "50M"))
    results = run(checkpoint, args.groups, args.k, args.prompt, args.response, args.repeats,
                  args.length_bucket)
    print(f"\n{args.groups} groups x K={args.k}, prompt {args.prompt}, responses <= {args.response} tokens, "
          f"length bucket {args.length_bucket}; checkpoint {checkpoint}")
    print_table(results, ["layout", "tokens_in_step", "real_tokens", "step_s", "speedup", "token_ratio",
                          "share_of_token_ratio", "estimated_speedup", "auto_picks", "first_loss",
                          "loss_rel_diff"])
    fastest = max(results, key=lambda r: r["speedup"])["layout"]
    picked = next(r["layout"] for r in results if r["auto_picks"])
    print(f"pack_groups='auto' picks {picked} (estimated cost, attention weight "
          f"{results[0]['attention_weight']}); measured fastest: {fastest}")
    arms = results[1]["block_arms"]
    block_rows = [{k: v for k, v in arms.items() if k != "times"}]
    print("\npacked step, attention in causal blocks vs over whole rows (median s over alternating rounds; "
          "blocks_speedup = whole rows' time / blocks', median of the rounds' ratios)")
    print_table(block_rows, ["width", "default_uses_blocks", "causal_blocks_s", "whole_rows_s",
                             "blocks_speedup"])
    write_json(args.json, {"benchmark": "packed_groups", "machine": machine(), "args": vars(args),
                           "checkpoint": checkpoint, "results": results, "block_rows": block_rows})


if __name__ == "__main__":
    main()
