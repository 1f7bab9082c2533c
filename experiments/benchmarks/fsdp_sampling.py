"""Sampling on a mesh split over fsdp: the serving weights gathered once per params version
(`sampling.sampler.serving_shardings`, the sampler's default) or resharded as tensor shards
(`rollout.fsdp_weights=tensor`) vs gathered by every prompt pass and decode step
(`rollout.fsdp_weights=split`), against a data mesh that holds every weight whole.

    python experiments/benchmarks/fsdp_sampling.py [--quick] [--cpu-devices 2] [--json PATH]

A trainer that samples itself (system.mode=sync) samples on its training mesh, and a searcher
may be given an fsdp mesh. Arms, each a `Sampler` over the same N host devices (XLA's
--xla_force_host_platform_device_count), timed call by call in turns (`Sampler.sample`, 64
prompt + 128 new tokens, full-vocabulary sampling at T = 1 with no early stop):
  data             MeshConfig(data=N): the reference, no weight ever moves
  fsdp, once       MeshConfig(data=1, fsdp=N), the sampler's default (`fsdp_weights="whole"`)
  fsdp as tensor   the same mesh sampled as tensor=N (`fsdp_weights="tensor"`: weights / N a
                   device, resharded once per version; `sharding.fsdp_as_tensor`)
  fsdp, per step   the same with the serving weights left split over fsdp as trained
                   (`Sampler(fsdp_weights="split")`, what the sampler did before)
Per arm: seconds a call (median), generated tok/s, vs the data mesh (its time / the arm's), the
all-gathers in the compiled generate program, and `Sampler.prepare_params` (a new version placed
and laid out, the once-per-version gather included; median).

On CPU host devices an all-gather is a copy within one machine's memory; on GPUs it crosses the
interconnect, so the per-step gather weighs more there (not measured: no GPU in these runs).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]

from common import host_devices_flag  # noqa: E402

# before jax: XLA reads the host device count when it opens its CPU backend (2 unless given)
_given = any(a.startswith("--cpu-devices") for a in sys.argv[1:])
_argv = sys.argv[1:] if _given else ["--cpu-devices", "2"]
os.environ["XLA_FLAGS"] = host_devices_flag(_argv, os.environ.get("XLA_FLAGS", ""))

import jax  # noqa: E402
from common import (  # noqa: E402
    keep_freed_memory, machine, machine_line, median_seconds_in_turns, print_table, write_json,
)
from sampler import SIZES, build_random_llama, prompts_for  # noqa: E402

from tbajax.models import load_model  # noqa: E402
from tbajax.sampling import Sampler, SamplingConfig  # noqa: E402
from tbajax.sharding import MeshConfig, make_mesh  # noqa: E402


def arm_samplers(directory: Path, devices: int) -> dict[str, tuple[Sampler, Any]]:
    """(sampler, a loaded model to re-prepare) per arm, each on its own mesh over the same devices."""
    fsdp = MeshConfig(data=1, fsdp=devices)
    arms = {"data": (MeshConfig(data=devices), "whole"), "fsdp, once": (fsdp, "whole"),
            "fsdp as tensor": (fsdp, "tensor"), "fsdp, per step": (fsdp, "split")}
    out = {}
    for name, (config, fsdp_weights) in arms.items():
        mesh = make_mesh(config, devices=jax.devices()[:devices])
        model = load_model(directory, mesh=mesh)
        out[name] = (Sampler(model, mesh=mesh, fsdp_weights=fsdp_weights), model)
    return out


def all_gathers(sampler: Sampler) -> int:
    (generate,) = (c for (kind, _), c in sampler._compiled.items() if kind == "generate")
    return sum(" all-gather(" in line for line in generate.as_text().splitlines())


def bench(size: str, batch: int, prompt_len: int, new_tokens: int, devices: int, rounds: int) -> list[dict]:
    directory = build_random_llama(Path(tempfile.mkdtemp(prefix=f"fsdp-sampling-{size}-")), SIZES[size])
    samplers = arm_samplers(directory, devices)
    vocab = next(iter(samplers.values()))[0].config.vocab_size
    prompts = prompts_for(batch, prompt_len, vocab)
    config = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0, stop_token_ids=())
    key = jax.random.key(0)

    def call(s: Sampler) -> Any:
        return lambda: s.sample(prompts, config, key)

    def prepare(s: Sampler, model: Any) -> Any:
        return lambda: s.prepare_params(model)

    seconds = median_seconds_in_turns({n: call(s) for n, (s, _) in samplers.items()}, rounds)
    prepare_s = median_seconds_in_turns({n: prepare(s, m) for n, (s, m) in samplers.items()}, rounds,
                                        warmup=1)
    outputs = {n: s.sample(prompts, config, key) for n, (s, _) in samplers.items()}
    reference = outputs["data"]
    rows = []
    for name, (s, _) in samplers.items():
        same = (outputs[name].tokens == reference.tokens).all(axis=1).mean()
        rows.append({
            "model": size, "batch": batch, "tokens": f"{prompt_len}+{new_tokens}", "devices": devices,
            "arm": name, "s": seconds[name], "tok_s": batch * new_tokens / seconds[name],
            "vs_data": seconds["data"] / seconds[name], "all_gathers": all_gathers(s),
            "prepare_s": prepare_s[name], "rows_as_data_mesh": float(same),
        })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10M, batch 8, 16 + 16 tokens, 2 rounds")
    ap.add_argument("--cpu-devices", type=int, default=2, help="host devices of every arm's mesh (default 2)")
    ap.add_argument("--models", nargs="+", default=["10M", "50M"], choices=["10M", "50M"])
    ap.add_argument("--rounds", type=int, default=5, help="calls per arm, in turns")
    ap.add_argument("--json", help="write the figures to this path")
    args = ap.parse_args()
    keep_freed_memory()
    if len(jax.devices()) < args.cpu_devices:
        raise SystemExit(f"needs {args.cpu_devices} devices, this backend has {len(jax.devices())}")
    t0 = time.perf_counter()
    if args.quick:
        rows = bench("10M", 8, 16, 16, args.cpu_devices, 2)
    else:
        rows = [r for size in args.models for r in bench(size, 32, 64, 128, args.cpu_devices, args.rounds)]
    info = machine()
    print(machine_line(info))
    print_table(rows, ["model", "batch", "tokens", "devices", "arm", "s", "tok_s", "vs_data", "all_gathers",
                       "prepare_s", "rows_as_data_mesh"])
    print("s: median seconds a call, arms in turns; vs_data = the data mesh's time / the arm's "
          "(> 1: faster); all_gathers: in the compiled generate program; prepare_s: median "
          "Sampler.prepare_params; rows_as_data_mesh: share of rows with the data mesh's tokens (same keys)")
    print(f"({time.perf_counter() - t0:.0f} s in all)")
    write_json(args.json, {"benchmark": "fsdp_sampling", "machine": info, "rows": rows})


if __name__ == "__main__":
    main()
