"""Continuous batching vs static buckets on a mixed-length workload, and the in-flight swap latency.

Workload: a random-init Llama (the sampler benchmark's 10M architecture), prompts of random
lengths, K samples each, and response lengths drawn log-normal (median `median`, the longest
~cap/median times the median: 16 by default, 8 with `--math-like`; capped at `cap`). Both engines generate exactly those lengths:
sampling runs with no stop ids and each sample's new-token cap is its drawn length
(`Sampler.sample(max_new_per_row=...)` / `ContinuousEngine.submit(max_new_per_sample=...)`), and
with the same per-sample keys both produce the same tokens (checked: `agreement` in the JSON).
Static = the searcher's static path: `Sampler.sample` on `prompts_per_call` prompts at a time,
each call decoding until its longest sample ends. Continuous = `ContinuousEngine` with as many slots as a static call has rows.
Continuous, ring tiers = the same engine with its slots in `--ring-tiers` tiers of rings
(`geometric_ring_tiers`: halving lengths, half of the slots in the shortest), so a decode step's
attention reads each sample's tier ring instead of the longest one for every slot; `moves` and
`pauses` count samples moved to a longer tier and samples that waited for a free row there.
`--compare-pool N` adds the ring-tier engine (the one-ring engine with `--ring-tiers 1`) with a
prompt pool of N entries beside the default's (`pool` in the JSON), in the same run.
All are warmed up on the same workload first (every program compiled), then timed alternately;
`step_ms` = a run's time over the decode steps it ran (admissions included).
`agreement.max_logprob_diff_up_to_first_difference` includes the first differing token itself
(two different tokens' log-probs), so it is large whenever any sample diverged.

Swap: a real param store in a temp dir; mid-run the benchmark publishes new params, the engine
loop notices them, loads and lays them out for serving (`prepare_params`: what the searcher's
loader thread does while decoding goes on; here in line), swaps between chunks and goes on.
Reported: publish -> swapped in, publish -> end of the first chunk with new-version tokens, one
decode step (the chunks' time over the steps they ran: a chunk ends early once K slots are free,
so chunk time / chunk length undercounts it), one param load, one load + serving layout, the
swap itself.

    python experiments/benchmarks/continuous_batching.py --quick
    python experiments/benchmarks/continuous_batching.py --math-like --json experiments/results/benchmarks/continuous_batching_math_like.json
    python experiments/benchmarks/continuous_batching.py \
        --json experiments/results/benchmarks/continuous_batching.json
"""

from __future__ import annotations

import argparse
import os
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
from flax import nnx  # noqa: E402

from experiments.benchmarks.common import machine, print_table, write_json  # noqa: E402
from experiments.benchmarks.sampler import SIZES, build_random_llama  # noqa: E402
from tbajax.models import load_model  # noqa: E402
from tbajax.sampling import Sampler, SamplingConfig  # noqa: E402
from tbajax.sampling.continuous import ContinuousEngine, request_keys  # noqa: E402
from tbajax.stores import ParamPublisher, ParamReader, param_store_url  # noqa: E402
from tbajax.system.publishing import SearcherParams  # noqa: E402


def workload(
    n_prompts: int, k: int, median: int, cap: int, vocab: int, seed: int = 0
) -> tuple[list, np.ndarray]:
    """Prompts (8..40 tokens) and [n_prompts * K] response lengths (prompt-major, as the samplers
    order rows): log-normal with the given median and a spread that puts the longest of n draws at
    ~cap/median times the median (a geometric tail is too light: its longest of 512 is ~9x), capped."""
    rng = np.random.default_rng(seed)
    prompts = [[1, *rng.integers(3, vocab, rng.integers(7, 40)).tolist()] for _ in range(n_prompts)]
    n = n_prompts * k
    top_z = np.sqrt(2 * np.log(n)) - 0.75  # ~ the largest of n standard normals
    sigma = np.log(cap / median) / top_z
    lengths = np.exp(np.log(median) + sigma * rng.standard_normal(n))
    return prompts, np.clip(np.round(lengths), 1, cap).astype(np.int32)


def run_static(sampler: Sampler, cfg: SamplingConfig, prompts: list, lengths: np.ndarray, key: Any,
               per_call: int) -> dict[str, Any]:
    k = cfg.num_samples
    t0 = time.perf_counter()
    tokens, logprobs, rows, steps = [], [], 0, 0
    for start in range(0, len(prompts), per_call):
        batch = prompts[start:start + per_call]
        caps = lengths[start * k:(start + len(batch)) * k]
        out = sampler.sample(batch, cfg, jax.random.fold_in(key, start), max_new_per_row=caps)
        tokens += [out.response(i) for i in range(len(out))]
        logprobs += [out.logprobs[i, : out.length[i]] for i in range(len(out))]
        rows += len(out)
        steps += len(out) * int(out.length.max())  # every row of the call runs to its longest
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": tokens, "logprobs": logprobs,
            "occupancy": float(lengths.sum()) / steps}


def run_continuous(engine: ContinuousEngine, prompts: list, lengths: np.ndarray, key: Any,
                   per_call: int) -> dict[str, Any]:
    k = engine.config.num_samples
    before = engine.stats.slot_steps_live, engine.stats.decode_steps, engine.stats.moves, engine.stats.pauses
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):  # the static run's keys: call key fold_in(key, start), row in call
        start = i - i % per_call
        engine.submit(p, request_keys(jax.random.fold_in(key, start), (i - start) * k, k), tag=i,
                      max_new_per_sample=lengths[i * k:(i + 1) * k])
    groups = sorted(engine.run(), key=lambda g: g.tag)
    seconds = time.perf_counter() - t0
    live = engine.stats.slot_steps_live - before[0]
    steps = engine.stats.decode_steps - before[1]
    return {"seconds": seconds, "tokens": [t for g in groups for t in g.tokens],
            "logprobs": [lp for g in groups for lp in g.logprobs],
            "occupancy": live / max(1, steps * engine.slots), "decode_steps": steps,
            "moves": engine.stats.moves - before[2], "pauses": engine.stats.pauses - before[3]}


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """How far the two engines' samples agree: identical samples, and for the others where they
    first differ and the largest log-prob difference before that (float rounding of a different
    batch layout can move a near-uniform random model's draw across a CDF boundary; the tokens
    after a flip then differ as a different continuation)."""
    identical, first, before = 0, [], 0.0
    for ta, tb, la, lb in zip(a["tokens"], b["tokens"], a["logprobs"], b["logprobs"]):
        diff = np.flatnonzero(ta != tb)
        end = int(diff[0]) if len(diff) else len(ta)
        identical += not len(diff)
        if len(diff):
            first.append(end)
        before = max(before, float(np.abs(la[: end + 1] - lb[: end + 1]).max()))  # the flip's own lp too
    return {"identical_samples": identical, "samples": len(a["tokens"]),
            "first_difference_positions": first, "max_logprob_diff_up_to_first_difference": before}


def measure_swap(engine: ContinuousEngine, model: Any, prompts: list, lengths: np.ndarray, key: Any,
                 directory: Path) -> dict[str, float]:
    """Publish new params while the engine decodes; time how long until they are used."""
    k = engine.config.num_samples
    state = nnx.state(model, nnx.Param)
    url = param_store_url(directory)
    publisher = ParamPublisher(url, "bench", dtype="float32", keep=2)
    reader = ParamReader(url, "bench-searcher")
    resident = SearcherParams(state, engine.sampler.mesh)
    engine.version = publisher.publish(nnx.to_pure_dict(state))  # what the engine runs now
    t0 = time.perf_counter()
    jax.block_until_ready(resident.load(reader, engine.version))
    load_s = time.perf_counter() - t0
    for i, p in enumerate(prompts):
        engine.submit(p, request_keys(jax.random.fold_in(key, 10_000 + i), 0, k), tag=i,
                      max_new_per_sample=lengths[i * k:(i + 1) * k])
    chunk_s: list[float] = []
    chunk_steps: list[int] = []
    published = swapped = first = None
    prepare_s = float("nan")
    new = jax.tree.map(lambda x: x * 1.01, nnx.to_pure_dict(state))
    while not engine.idle:
        if published is None and len(chunk_s) == 2:
            publisher.publish(new)
            published = time.perf_counter()
        if published is not None and swapped is None:
            latest = reader.latest_version()
            if latest is not None and latest > engine.version:
                loaded = time.perf_counter()
                # what the searcher's loader thread does while decoding goes on
                prepared = engine.prepare_params(resident.load(reader, latest))
                prepare_s = time.perf_counter() - loaded
                engine.update_params(prepared, latest)
                swapped = time.perf_counter()
        t, steps = time.perf_counter(), engine.stats.decode_steps
        done = engine.step()
        chunk_s.append(time.perf_counter() - t)
        chunk_steps.append(engine.stats.decode_steps - steps)
        if swapped is not None and first is None:
            first = time.perf_counter()
        del done
    publisher.close()
    # a chunk ends early once K slots are free (or none is live), and its time includes admitting
    # prompts: the step is the total time over the steps run, the first chunk (compiles) left out
    step_s = sum(chunk_s[1:]) / max(1, sum(chunk_steps[1:]))
    if published is None or swapped is None or first is None:
        raise RuntimeError(f"the run ended before the swap was used ({len(chunk_s)} chunks): "
                           "give it more prompts")
    return {"load_s": load_s, "load_and_prepare_s": prepare_s, "swap_s": engine.stats.last_swap_s,
            "decode_step_s": step_s,
            "chunk_s": float(np.median(chunk_s[1:])), "chunk_steps": float(np.median(chunk_steps[1:])),
            "publish_to_swapped_s": swapped - published,
            "publish_to_first_chunk_done_s": first - published,
            "publish_to_first_token_est_s": swapped - published + step_s}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smaller workload (about a minute)")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per engine after the warm-up")
    ap.add_argument("--math-like", action="store_true",
                    help="a math run's shape, scaled down: 96 prompts x K=16, lengths median 64 capped at "
                         "512 (long-tailed chains of thought), static calls of 8 prompts = 128 slots")
    ap.add_argument("--ring-tiers", type=int, default=3,
                    help="adds the continuous engine with this many ring tiers "
                         "(`geometric_ring_tiers`; 1: no such arm)")
    ap.add_argument("--compare-pool", type=int, default=None, metavar="N",
                    help="adds the last continuous engine again with a prompt pool of N entries")
    args = ap.parse_args(argv)
    if args.quick and args.math_like:
        ap.error("--quick and --math-like are two different workloads: pick one")
    if args.quick:
        n_prompts, k, median, cap, per_call, chunk = 32, 4, 8, 128, 8, 16
    elif args.math_like:
        n_prompts, k, median, cap, per_call, chunk = 96, 16, 64, 512, 8, 16
    else:
        n_prompts, k, median, cap, per_call, chunk = 128, 4, 16, 256, 16, 16
    info = machine()
    arch = SIZES["10M"]
    prompts, lengths = workload(n_prompts, k, median, cap, arch["vocab_size"])
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(build_random_llama(Path(tmp) / "ckpt", arch))
        cfg = SamplingConfig(max_new_tokens=cap, num_samples=k, temperature=1.0, stop_token_ids=())
        sampler = Sampler(model, max_cache_length=64 + cap)
        engine = ContinuousEngine(sampler, cfg, slots=per_call * k, chunk=chunk, max_prompt_tokens=64)
        tiered = None
        if args.ring_tiers > 1:
            tiered = ContinuousEngine(sampler, cfg, slots=per_call * k, chunk=chunk, max_prompt_tokens=64,
                                      ring_tiers=args.ring_tiers)
        pooled = None
        if args.compare_pool is not None:
            pooled = ContinuousEngine(sampler, cfg, slots=per_call * k, chunk=chunk, max_prompt_tokens=64,
                                      ring_tiers=args.ring_tiers, prompt_pool=args.compare_pool)
        key = jax.random.key(0)
        t0 = time.perf_counter()
        ref = run_static(sampler, cfg, prompts, lengths, key, per_call)  # warm-up: compiles
        warm_static = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = run_continuous(engine, prompts, lengths, key, per_call)
        warm_cont = time.perf_counter() - t0
        agreement = compare(ref, got)
        same = agreement["identical_samples"] == len(lengths)
        assert [len(t) for t in got["tokens"]] == lengths.tolist() == [len(t) for t in ref["tokens"]]
        arms = {"static": lambda: run_static(sampler, cfg, prompts, lengths, key, per_call),
                "continuous": lambda: run_continuous(engine, prompts, lengths, key, per_call)}
        warm_tiered = tiered_agreement = None
        if tiered is not None:
            t0 = time.perf_counter()
            got_tiered = run_continuous(tiered, prompts, lengths, key, per_call)
            warm_tiered = time.perf_counter() - t0
            tiered_agreement = compare(got, got_tiered)  # the same engine's samples, other rings
            assert [len(t) for t in got_tiered["tokens"]] == lengths.tolist()
            arms["continuous, ring tiers"] = lambda: run_continuous(tiered, prompts, lengths, key, per_call)
        warm_pooled = pooled_agreement = None
        if pooled is not None:
            t0 = time.perf_counter()
            got_pooled = run_continuous(pooled, prompts, lengths, key, per_call)
            warm_pooled = time.perf_counter() - t0
            pooled_agreement = compare(got, got_pooled)
            assert [len(t) for t in got_pooled["tokens"]] == lengths.tolist()
            name = f"{'continuous, ring tiers' if tiered is not None else 'continuous'}, pool {pooled.pool}"
            arms[name] = lambda: run_continuous(pooled, prompts, lengths, key, per_call)
        print(f"warm-up (compiles): static {warm_static:.1f} s, continuous {warm_cont:.1f} s"
              + (f", ring tiers {warm_tiered:.1f} s" if tiered is not None else "")
              + (f", pool {pooled.pool} {warm_pooled:.1f} s" if pooled is not None else ""), flush=True)
        best: dict[str, dict[str, Any]] = {}
        for _ in range(args.repeats):  # alternate, keep the best of each (a shared machine)
            for name, fn in arms.items():
                r = fn()
                print(f"{name}: {r['seconds']:.1f} s", flush=True)
                if name not in best or r["seconds"] < best[name]["seconds"]:
                    best[name] = r
        swap = measure_swap(engine, model, prompts, lengths, key,
                            Path(tmp) / "store")
    samples, tokens = len(lengths), int(lengths.sum())
    rows = []
    for name, r in best.items():
        rows.append({"engine": name, "samples": samples, "tokens": tokens, "seconds": r["seconds"],
                     "samples_per_s": samples / r["seconds"], "tokens_per_s": tokens / r["seconds"],
                     "slot_occupancy": r["occupancy"],
                     "vs_static": best["static"]["seconds"] / r["seconds"],
                     **({"decode_steps": r["decode_steps"], "step_ms": 1e3 * r["seconds"] / r["decode_steps"],
                         "moves": r["moves"], "pauses": r["pauses"]} if "decode_steps" in r else {})})
    print(f"\n10M Llama, {n_prompts} prompts x K={k}, response lengths log-normal median "
          f"{int(np.median(lengths))} max {int(lengths.max())} (cap {cap}); static calls of {per_call} "
          f"prompts, continuous {per_call * k} slots x chunk {chunk}; identical samples in both: "
          f"{agreement['identical_samples']}/{len(lengths)} (max |log-prob diff| up to the first difference "
          f"{agreement['max_logprob_diff_up_to_first_difference']:.2g})")
    print(f"machine: {info['cpu_count']} CPUs, matmul {info['matmul_gflops']:.1f} GFLOP/s, "
          f"load average {info['load_average_1m']:.1f} (before) / {os.getloadavg()[0]:.1f} (after)")
    if tiered is not None:
        same_tiered = tiered_agreement["identical_samples"]
        print(f"ring tiers (rows, ring slots): {tiered.ring_tiers} against one ring of {engine.ring} slots; "
              f"samples identical to the one-ring engine's: {same_tiered}/{len(lengths)}")
    print_table(rows, ["engine", "samples", "tokens", "seconds", "samples_per_s", "tokens_per_s",
                       "slot_occupancy", "vs_static", "step_ms", "moves", "pauses"])
    print(f"\nin-flight swap (ms; a chunk ran {swap['chunk_steps']:.0f} decode steps, median):")
    timed = [k2 for k2 in swap if k2.endswith("_s")]
    print_table([{k2: 1e3 * swap[k2] for k2 in timed}], timed)
    write_json(args.json, {
        "benchmark": "continuous_batching", "quick": args.quick, "math_like": args.math_like, "machine": info,
        "load_average_1m_after": os.getloadavg()[0],
        "workload": {"model": "10M", "prompts": n_prompts, "num_samples": k,
                     "median_len": float(np.median(lengths)),
                     "max_len": int(lengths.max()), "cap": cap, "mean_len": float(lengths.mean()),
                     "prompts_per_call": per_call, "decode_slots": per_call * k, "decode_chunk": chunk,
                     "pool": engine.pool},
        "same_tokens": same, "agreement": agreement,
        "warmup_s": {"static": warm_static, "continuous": warm_cont, "ring_tiers": warm_tiered,
                     "compared_pool": warm_pooled},
        "ring_tiers": list(tiered.ring_tiers) if tiered is not None else None, "ring": engine.ring,
        "ring_tiers_agreement": tiered_agreement,
        "compared_pool": pooled.pool if pooled is not None else None,
        "compared_pool_agreement": pooled_agreement,
        "rows": rows, "swap": swap,
    })


if __name__ == "__main__":
    main()
