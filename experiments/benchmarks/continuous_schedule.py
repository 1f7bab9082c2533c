"""How full the continuous engine's slots stay, by prompt-pool size: a model of its scheduling.

Not a timing. `schedule` replays `ContinuousEngine`'s rules on given response lengths (no model
runs): a prompt enters when K slots and a prompt-pool entry are free (its K samples' first tokens
come from the prefill), a chunk runs at least one decode step and ends early once no slot is live
or a waiting prompt could enter, a sample frees its slot when it ends and its prompt's entry
frees with the last of its K samples. It counts decode steps, occupancy and chunks exactly as
the engine's `EngineStats` does: the test suite checks it against the engine on random
workloads, and it reproduces `continuous_batching.py`'s measured decode steps (1,422 at the
math-like shape, 294 at the default one). Ring tiers do not change these counts (a move happens
between chunks) except where a sample pauses for a free row of a longer tier (1-2 pauses in the
benchmark's runs).

The question it answers: a prompt holds its pool entry until its *longest* sample ends, so with
long-tailed response lengths a pool of 2 x slots / K entries (the default before
`default_prompt_pool`) fills with stragglers' prompts and slots idle while prompts wait. Sweeps the pool size (times slots / K) over the
benchmark's workloads, as they are (a finite batch, whose tail of long samples idles slots
whatever the pool) and ten times longer (closer to a searcher's endless stream). Time per step
grows with the pool (every decode step reads it whole): `continuous_batching.py --compare-pool`
and `continuous_shared_prompt.py` measure that side.

    python experiments/benchmarks/continuous_schedule.py \
        --json experiments/results/benchmarks/continuous_schedule.json
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from experiments.benchmarks.common import print_table, write_json  # noqa: E402


def workload_lengths(n_prompts: int, k: int, median: int, cap: int) -> np.ndarray:
    """[n_prompts * K] response lengths exactly as `continuous_batching.py` draws them for the
    10M model (log-normal, the longest ~cap / median times the median, capped), prompt-major."""
    from experiments.benchmarks.continuous_batching import workload
    from experiments.benchmarks.sampler import SIZES

    return workload(n_prompts, k, median, cap, SIZES["10M"]["vocab_size"])[1]


def schedule(lengths: np.ndarray, k: int, slots: int, chunk: int, pool: int) -> dict[str, Any]:
    """Decode steps, occupancy and chunks of `ContinuousEngine(slots, chunk, prompt_pool=pool)`
    (a shared prompt pool) generating `lengths` [prompts * K] (prompt-major), prompts submitted
    at once in order."""
    lengths = np.asarray(lengths).reshape(-1, k)
    queue = collections.deque(range(len(lengths)))
    free_slots, free_entries = slots, pool
    running: dict[int, int] = {}  # prompt -> its samples still generating
    left: list[list[int]] = []  # [prompt, tokens still to generate] per live sample
    steps = live_steps = chunks = 0

    def end(prompt: int) -> None:
        nonlocal free_slots, free_entries
        free_slots += 1
        running[prompt] -= 1
        if not running[prompt]:
            del running[prompt]
            free_entries += 1

    def could_enter() -> bool:
        return bool(queue) and free_slots >= k and free_entries > 0

    while queue or left:
        take = min(len(queue), free_slots // k, free_entries)  # admission: first tokens sampled
        for _ in range(take):
            p = queue.popleft()
            free_slots, free_entries = free_slots - k, free_entries - 1
            running[p] = k
            for n in lengths[p]:
                if n <= 1:
                    end(p)
                else:
                    left.append([p, int(n) - 1])
        if not left:
            continue
        chunks += 1
        for _ in range(chunk):  # decode steps; the exit test follows each step
            steps += 1
            live_steps += len(left)
            for sample in left:
                sample[1] -= 1
            for p, _ in [s for s in left if s[1] == 0]:
                end(p)
            left = [s for s in left if s[1] > 0]
            if not left or could_enter():
                break
    return {"decode_steps": steps, "occupancy": live_steps / max(1, steps * slots), "chunks": chunks}


SHAPES = {  # name: (prompts, K, median, cap, slots, chunk)
    "math-like (continuous_batching.py --math-like)": (96, 16, 64, 512, 128, 16),
    "default (continuous_batching.py)": (128, 4, 16, 256, 64, 16),
    "K 8, median 32, cap 512, 64 slots": (96, 8, 32, 512, 64, 16),
    "K 16, median 128, cap 1024, 256 slots": (96, 16, 128, 1024, 256, 16),
}
FACTORS = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--stream", type=int, default=10, help="the longer workload: this many times the prompts")
    args = ap.parse_args(argv)
    rows = []
    for name, (n, k, median, cap, slots, chunk) in SHAPES.items():
        for scale in (1, args.stream):
            lengths = workload_lengths(n * scale, k, median, cap)
            ideal = float(lengths.sum()) / slots
            base = None
            for factor in FACTORS:
                pool = max(1, int(factor * (slots // k)))
                r = schedule(lengths, k, slots, chunk, pool)
                if factor == 2.0:
                    base = r["decode_steps"]
                rows.append({"shape": name, "prompts": n * scale, "k": k, "slots": slots,
                             "median_len": median, "cap": cap, "pool_factor": factor, "pool": pool, **r,
                             "ideal_steps": ideal, "steps_over_ideal": r["decode_steps"] / ideal})
            for row in rows[-len(FACTORS):]:
                row["steps_vs_pool_2x"] = row["decode_steps"] / base
    print("pool = factor x slots / K; decode steps of the engine's schedule, ideal = "
          "tokens / slots")
    print_table(rows, ["shape", "prompts", "pool_factor", "pool", "decode_steps", "steps_vs_pool_2x",
                       "occupancy", "chunks", "steps_over_ideal"])
    write_json(args.json, {"benchmark": "continuous_schedule", "stream": args.stream, "rows": rows})


if __name__ == "__main__":
    main()
