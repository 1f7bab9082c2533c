"""Continuous batching with each prompt's KV cache held once in a prompt pool vs copied into its K rows.

    python experiments/benchmarks/continuous_shared_prompt.py [--quick] [--json PATH]

`ContinuousEngine(share_prompt_cache=True)` (the default) writes a prompt's keys/values once into
an entry of a pool of `prompt_pool` prompts; each decode step gathers every entry's K queries,
reads its keys/values once and gathers the results back to the rows; the rows' ring holds
generated tokens only. With False each prompt is copied into its K rows (as before). The pool is
read whole at every step and a prompt holds its entry until its last sample ends, so its size
trades bytes read against slots left idle behind stragglers: the arms are the copied layout and
pools of 1x, 2x, 3x and 4x slots / K entries (`continuous_schedule.py` models the occupancy
side alone).

Workloads (`continuous_batching.py`'s mixed lengths: log-normal response lengths whose longest is
~16x the median; each sample's cap is its drawn length, no stop ids, so every arm generates the
same tokens): short prompts (8-40 tokens, K = 4, as `continuous_batching.py`) and long prompts
(128-256 tokens, K = 8, a math- or TL;DR-like prompt). 10M Llama of `sampler.py`, one engine per
arm over one sampler; the arms take turns run by run (median of `--rounds` after a warm-up run
that compiles). `identical`: samples equal to the copied arm's (a different summation order can
move a near-uniform draw of the random model; see `continuous_batching.py`). `kv_mb`: the
engine's whole cache (rows' ring + pool).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import jax  # noqa: E402

from experiments.benchmarks.common import (  # noqa: E402
    keep_freed_memory, machine, machine_line, print_table, write_json,
)
from experiments.benchmarks.continuous_batching import compare, run_continuous, workload  # noqa: E402
from experiments.benchmarks.sampler import SIZES, build_random_llama  # noqa: E402
from tbajax.models import load_model  # noqa: E402
from tbajax.sampling import Sampler, SamplingConfig  # noqa: E402
from tbajax.sampling.continuous import ContinuousEngine  # noqa: E402

# name, prompts, K, prompt tokens (low, high), median / cap of the response lengths, prompts per slot set
WORKLOADS = [
    ("short prompts", 128, 4, (8, 40), 16, 256, 16),
    ("long prompts", 64, 8, (128, 256), 16, 128, 8),
]
QUICK = [("long prompts", 16, 8, (64, 128), 8, 64, 4)]
POOLS = {"copied": None, "pool 1x": 1, "pool 2x": 2, "pool 3x": 3, "pool 4x": 4}


def prompts_of(n: int, low: int, high: int, vocab: int, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[1, *rng.integers(3, vocab, rng.integers(low, high)).tolist()] for _ in range(n)]


def measure(model: Any, spec: tuple, rounds: int) -> list[dict[str, Any]]:
    name, n_prompts, k, (low, high), median, cap, per_call = spec
    vocab = model.config.vocab_size
    _, lengths = workload(n_prompts, k, median, cap, vocab)
    prompts = prompts_of(n_prompts, low, high, vocab)
    slots = per_call * k
    cfg = SamplingConfig(max_new_tokens=cap, num_samples=k, temperature=1.0, stop_token_ids=())
    sampler = Sampler(model, max_cache_length=high + cap)
    engines = {arm: ContinuousEngine(sampler, cfg, slots=slots, chunk=16, max_prompt_tokens=high,
                                     share_prompt_cache=factor is not None,
                                     prompt_pool=None if factor is None else factor * slots // k)
               for arm, factor in POOLS.items()}
    key = jax.random.key(0)
    first = {arm: run_continuous(e, prompts, lengths, key, per_call) for arm, e in engines.items()}  # compiles
    seconds: dict[str, list[float]] = {arm: [] for arm in engines}
    occupancy: dict[str, float] = {}
    for _ in range(rounds):
        for arm, e in engines.items():
            r = run_continuous(e, prompts, lengths, key, per_call)
            seconds[arm].append(r["seconds"])
            occupancy[arm] = r["occupancy"]
        print(f"  {name}: " + ", ".join(f"{a} {s[-1]:.2f} s" for a, s in seconds.items()), flush=True)
    base = statistics.median(seconds["copied"])
    rows = []
    for arm, e in engines.items():
        s = statistics.median(seconds[arm])
        agree = compare(first["copied"], first[arm])
        rows.append({
            "workload": name, "arm": arm, "prompts_x_k": f"{n_prompts} x {k}",
            "prompt_tokens": f"{low}-{high}", "median_len": float(np.median(lengths)),
            "max_len": int(lengths.max()), "slots": slots, "pool": e.pool, "seconds": s,
            "samples_per_s": len(lengths) / s, "vs_copied": base / s,
            "vs_copied_min": min(seconds["copied"]) / max(seconds[arm]),
            "vs_copied_max": max(seconds["copied"]) / min(seconds[arm]),
            "slot_occupancy": occupancy[arm], "kv_mb": e._cache.nbytes() / 2**20,
            "identical": agree["identical_samples"], "samples": agree["samples"],
            "times": seconds[arm],
        })
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one small workload (< 1 min)")
    ap.add_argument("--rounds", type=int, default=None, help="timed runs per arm (default 5; --quick: 1)")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    keep_freed_memory()
    rounds = args.rounds or (1 if args.quick else 5)
    info = machine()
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(build_random_llama(Path(tmp) / "ckpt", SIZES["10M"]))
        for spec in QUICK if args.quick else WORKLOADS:
            rows += measure(model, spec, rounds)
    print(f"\n10M Llama, continuous batching, chunk 16; {rounds} timed runs per arm, median "
          f"({time.perf_counter() - t0:.0f} s in all)")
    print_table(rows, ["workload", "arm", "prompts_x_k", "prompt_tokens", "slots", "pool", "seconds",
                       "samples_per_s", "vs_copied", "slot_occupancy", "kv_mb", "identical", "samples"])
    print(machine_line(info))
    write_json(args.json, {"benchmark": "continuous_shared_prompt", "quick": args.quick, "machine": info,
                           "load_average_1m_after": os.getloadavg()[0], "rounds": rounds, "rows": rows})


if __name__ == "__main__":
    main()
