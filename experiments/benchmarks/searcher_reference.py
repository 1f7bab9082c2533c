"""A searcher call with reference log-probs: each prompt's K responses scored packed behind it vs
K rows of prompt + response.

    python experiments/benchmarks/searcher_reference.py [--quick] [--json PATH]

With `rollout.reference_logprobs` (the default experiment, `pft_smollm2`) a searcher scores every
sample under the frozen reference right after sampling it (`Sampler.sample(...,
reference_logprobs=True)`). As K rows of prompt + response the reference runs each prompt K
times; packed (`core.score_packed`, chosen by `sampler.packing_is_cheaper`) it runs each prompt
once, followed by its K responses, each attending to the prompt and itself. Arms, taking turns
call by call (median of `--rounds`), on the same sampler and prompts: `packed` and `rows` (a whole
call: sample, then score), and `sample only` (no reference), whose time is the floor;
`reference_saving` = the share of the rows arm's scoring time (rows - sample only) that packing
saves. `max_abs_diff`: the two arms' reference log-probs on the same samples.
Rows: the default experiment's model and shape (16 prompts x K = 8, prompts of up to 16 tokens, 6
new tokens), and a TL;DR-like shape on the 10M Llama of `sampler.py` (2 x 16, 256 + 64).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

import jax  # noqa: E402
import numpy as np  # noqa: E402
from common import (  # noqa: E402
    keep_freed_memory, machine, machine_line, median_seconds_in_turns, print_table, write_json,
)
from shared_prompt import Shape  # noqa: E402

from tbajax.models import load_model  # noqa: E402
from tbajax.sampling import Sampler, SamplingConfig  # noqa: E402
from tbajax.sampling import sampler as sampler_module  # noqa: E402

DEFAULT_CHECKPOINT = Path(__file__).resolve().parents[1] / "assets" / "tiny-arithmetic"


def bench(name: str, directory: Path, shape: Shape, rounds: int) -> dict[str, Any]:
    model = load_model(directory)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    lengths = rng.integers(shape.prompt_len // 2, shape.prompt_len + 1, shape.prompts)
    prompts = [rng.integers(3, vocab, n).tolist() for n in lengths]
    config = SamplingConfig(max_new_tokens=shape.new_tokens, num_samples=shape.samples,
                            temperature=shape.temperature, stop_token_ids=())
    sampler = Sampler(model, reference=load_model(directory),
                      max_cache_length=shape.prompt_len + shape.new_tokens)
    rows_only = mock.patch.object(sampler_module, "packing_is_cheaper", lambda *a: False)
    packed_out = sampler.sample(prompts, config, jax.random.key(0), reference_logprobs=True)
    assert "score_packed" in {e.kind for e in sampler.compile_events}, "packing was not chosen at this shape"
    with rows_only:
        rows_out = sampler.sample(prompts, config, jax.random.key(0), reference_logprobs=True)
    np.testing.assert_array_equal(packed_out.tokens, rows_out.tokens)
    diff = float(np.abs(packed_out.reference_logprobs - rows_out.reference_logprobs).max())
    seed = iter(range(1, 1 << 30))

    def call(reference: bool, rows: bool = False) -> Any:
        def run() -> None:
            if rows:
                with rows_only:
                    sampler.sample(prompts, config, jax.random.key(next(seed)), reference_logprobs=reference)
            else:
                sampler.sample(prompts, config, jax.random.key(next(seed)), reference_logprobs=reference)

        return run

    arms = {"packed": call(True), "rows": call(True, rows=True), "sample": call(False)}
    med = median_seconds_in_turns(arms, rounds, warmup=1)
    row = {
        "model": name, "shape": shape.name, "prompts_x_k": f"{shape.prompts}x{shape.samples}",
        "tokens": f"{shape.prompt_len}+{shape.new_tokens}", "packed_s": med["packed"], "rows_s": med["rows"],
        "sample_only_s": med["sample"], "speedup": med["rows"] / med["packed"],
        "reference_saving": (med["rows"] - med["packed"]) / (med["rows"] - med["sample"]),
        "max_abs_diff": diff,
    }
    print(row, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the default experiment's shape only, few rounds")
    ap.add_argument("--rounds", type=int, help="timed rounds per arm (default 21; --quick: 5)")
    ap.add_argument("--json", help="write the figures to this path")
    args = ap.parse_args()
    keep_freed_memory()
    rounds = args.rounds or (5 if args.quick else 21)
    default = Shape("default experiment", 16, 8, 16, 6, 0.7)
    rows = [bench("tiny-arithmetic", DEFAULT_CHECKPOINT, default, rounds)]
    if not args.quick:
        from sampler import SIZES, build_random_llama

        with tempfile.TemporaryDirectory() as tmp:
            directory = build_random_llama(Path(tmp) / "10M", SIZES["10M"])
            rows.append(bench("10M", directory, Shape("tldr-like", 2, 16, 256, 64, 1.0), rounds))
    info = machine()
    print(machine_line(info))
    print_table(rows, ["model", "shape", "prompts_x_k", "tokens", "packed_s", "rows_s", "sample_only_s",
                       "speedup", "reference_saving", "max_abs_diff"])
    print("s = one searcher call (sample, then score under the reference), median of alternating calls; "
          "speedup = rows / packed; reference_saving = (rows - packed) / (rows - sample only)")
    write_json(args.json, {"benchmark": "searcher_reference", "machine": info, "rounds": rounds, "rows": rows,
                           "command": "python experiments/benchmarks/searcher_reference.py --json PATH"})


if __name__ == "__main__":
    main()
