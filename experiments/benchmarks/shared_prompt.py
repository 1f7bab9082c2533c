"""K samples per prompt: each prompt's KV cache held once vs copied into every sample's row.

    python experiments/benchmarks/shared_prompt.py [--quick] [--json PATH]

A searcher samples K completions of every prompt. With `Sampler(share_prompt_cache=True)` (the
default) the prompt's keys and values are cached once per prompt (`serving.PromptCache`) and a
decode step's attention reads them once for all K samples (`layers.attention_after_prompt`);
with False they are copied into each of the K rows, as before, and every row reads its own copy.
Both arms sample from the same key (`same_rows`: the rows whose tokens agree; `agreement`
checks the log-probs up to a row's first difference); torch transformers `generate`
with `num_return_sequences=K` (which also copies the prompt K times) runs on the same checkpoint
as the reference. The three arms take turns call by call (median of `--rounds`), full-vocabulary
sampling at T = 1, no early stop. Rows: a math-like shape (prompt 64, 128 new tokens, 4 prompts
x K = 8), a TL;DR-like one (prompt 256, 64 new tokens, 2 x K = 16) and one with little to share
(prompt 32, 128 new tokens, 16 x K = 2), on the Llama-style 10M / 50M models of `sampler.py`
(grouped-query) and a 10M GPT-NeoX (multi-head, as Pythia).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from common import (  # noqa: E402
    keep_freed_memory, machine, machine_line, median_seconds_in_turns, print_table, write_json,
)
from sampler import SIZES, build_random_llama, prompts_for  # noqa: E402

from tbajax.models import load_model  # noqa: E402
from tbajax.sampling import Sampler, SamplingConfig  # noqa: E402

MODELS = {
    **{name: SIZES[name] for name in ("10M", "50M")},
    "neox-10M": {"model_type": "gpt_neox", "hidden_size": 256, "intermediate_size": 1024,
                 "num_hidden_layers": 6, "num_attention_heads": 4, "vocab_size": 8192, "rotary_pct": 0.25,
                 "use_parallel_residual": True},
}


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    prompts: int
    samples: int
    prompt_len: int  # searcher_reference.py: the longest prompt (prompts are 1/2 to all of it long)
    new_tokens: int
    temperature: float = 1.0  # searcher_reference.py samples at this temperature


SHAPES = [Shape("math-like", 4, 8, 64, 128), Shape("tldr-like", 2, 16, 256, 64),
          Shape("small K", 16, 2, 32, 128)]
RUNS = [("10M", SHAPES[0]), ("10M", SHAPES[1]), ("10M", SHAPES[2]), ("50M", SHAPES[0]), ("50M", SHAPES[1]),
        ("neox-10M", SHAPES[1])]
QUICK = [("10M", Shape("tldr-like", 2, 16, 128, 16))]


def torch_arm(directory: Path, prompts: list[list[int]], k: int, new_tokens: int) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory).float().eval()
    ids = torch.tensor(prompts)

    def run() -> None:
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 num_return_sequences=k, pad_token_id=0, eos_token_id=2)
        assert out.shape == (len(prompts) * k, ids.shape[1] + new_tokens), out.shape

    return run


def agreement(a: Any, b: Any) -> float:
    """The share of rows with identical tokens; every row's log-probs must agree (1e-4) up to its
    first differing token. The two arms add the same terms in another order, and on a random
    model's near-uniform distribution such a rounding difference can move a draw to the next
    token, after which the row's continuation differs (the continuous engine's note in README)."""
    differs = a.tokens != b.tokens
    first = np.where(differs.any(1), differs.argmax(1), a.tokens.shape[1])
    before = np.arange(a.tokens.shape[1])[None, :] < first[:, None]
    np.testing.assert_allclose(np.where(before, a.logprobs, 0), np.where(before, b.logprobs, 0), atol=1e-4)
    same = float((first == a.tokens.shape[1]).mean())
    assert same >= 0.5, f"only {same:.0%} of rows sampled the same tokens in both arms"
    return same


def bench(name: str, directory: Path, shape: Shape, rounds: int, with_torch: bool) -> dict[str, Any]:
    model = load_model(directory)
    prompts = prompts_for(shape.prompts, shape.prompt_len, model.config.vocab_size)
    config = SamplingConfig(max_new_tokens=shape.new_tokens, num_samples=shape.samples, temperature=1.0,
                            stop_token_ids=())
    kw = dict(max_cache_length=shape.prompt_len + shape.new_tokens, min_prompt_bucket=shape.prompt_len)
    samplers = {"shared": Sampler(model, **kw), "copied": Sampler(model, share_prompt_cache=False, **kw)}
    outs = {arm: s.sample(prompts, config, jax.random.key(0)) for arm, s in samplers.items()}  # compiles
    assert samplers["shared"]._cache.prompt is not None and samplers["copied"]._cache.prompt is None
    same_rows = agreement(outs["shared"], outs["copied"])
    seed = iter(range(1, 1 << 30))

    def arm(sampler: Sampler) -> Any:
        return lambda: sampler.sample(prompts, config, jax.random.key(next(seed)))

    calls = {a: arm(s) for a, s in samplers.items()}
    if with_torch:
        calls["torch"] = torch_arm(directory, prompts, shape.samples, shape.new_tokens)
    t0 = time.perf_counter()
    med = median_seconds_in_turns(calls, rounds, warmup=1)
    tokens = shape.prompts * shape.samples * shape.new_tokens
    row = {
        "model": name, "shape": shape.name, "prompts_x_k": f"{shape.prompts}x{shape.samples}",
        "tokens": f"{shape.prompt_len}+{shape.new_tokens}", "params_M": model.config.num_params() / 1e6,
        "shared_tok_s": tokens / med["shared"], "copied_tok_s": tokens / med["copied"],
        "speedup": med["copied"] / med["shared"], "same_rows": same_rows,
        "shared_kv_mb": samplers["shared"].cache_bytes / 2**20,
        "copied_kv_mb": samplers["copied"].cache_bytes / 2**20,
        "timing_s": time.perf_counter() - t0,
    }
    if with_torch:
        row |= {"torch_tok_s": tokens / med["torch"], "shared_vs_torch": med["torch"] / med["shared"],
                "copied_vs_torch": med["torch"] / med["copied"]}
    print(row, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one small row (< 1 min)")
    ap.add_argument("--rounds", type=int, help="timed rounds per arm (default 5; --quick: 2)")
    ap.add_argument("--no-torch", action="store_true", help="skip the transformers arm")
    ap.add_argument("--json", help="write the figures to this path")
    args = ap.parse_args()
    keep_freed_memory()
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    runs, rounds = (QUICK, args.rounds or 2) if args.quick else (RUNS, args.rounds or 5)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in runs:
            directory = Path(tmp) / name
            if not directory.exists():
                build_random_llama(directory, MODELS[name])
            rows.append(bench(name, directory, shape, rounds, not args.no_torch))
    info = machine()
    columns = ["model", "shape", "prompts_x_k", "tokens", "shared_tok_s", "copied_tok_s", "speedup",
               "shared_kv_mb", "copied_kv_mb", "same_rows"]
    if not args.no_torch:
        columns += ["torch_tok_s", "shared_vs_torch", "copied_vs_torch"]
    print(machine_line(info))
    print_table(rows, columns)
    print("tok/s = generated tokens / s of one call (prefill included), median of alternating calls; "
          "speedup = copied time / shared time; kv_mb = the KV cache the sampler holds; same_rows = rows "
          "of identical tokens in both arms (same key); *_vs_torch = torch time / ours")
    write_json(args.json, {"benchmark": "shared_prompt", "machine": info, "rounds": rounds, "rows": rows,
                           "command": "python experiments/benchmarks/shared_prompt.py --json PATH"})


if __name__ == "__main__":
    main()
