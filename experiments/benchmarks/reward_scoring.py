"""Reward-model scoring of K samples per prompt: packed prompt groups vs padded rows vs torch.

    python experiments/benchmarks/reward_scoring.py [--quick] [--json PATH]

The preference task scores every sample, `prompt + response`, with a sequence-classification
reward model, and the K samples of a prompt share that prompt (TL;DR: posts of a few hundred
tokens, summaries of tens, K = 20 in the paper's setup). Three ways to score the same sequences
with the same random GPT-NeoX (Pythia-shaped) reward model, timed in turns round by round:

- packed: `RewardModel.score_samples`, what the preference task runs: each prompt once, its K
  responses after it in one row (`SequenceScorer.score_prompt_groups`);
- rows: `RewardModel.score`, every sequence in its own row, rows and length rounded up to powers
  of two, `score_batch_rows` rows a call (the preference task's path before packing);
- torch: transformers' `AutoModelForSequenceClassification` on chunks of `score_batch_rows`
  sequences right-padded to each chunk's longest, read at each row's last real token (how TRL's
  reward scoring batches), with torch's threads = the machine's cores.

All three must give the same scores (max abs difference printed). Ratios are torch's time / ours
(and rows' / packed's), medians over the rounds; tokens: the sequences' real tokens per second.
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

import numpy as np  # noqa: E402
from common import (  # noqa: E402
    PAD, keep_freed_memory, machine, machine_line, make_neox_checkpoint, print_table, write_json,
)


def workload(groups: int, k: int, prompt: tuple[int, int], response: tuple[int, int], vocab: int,
             seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(prompts, responses) per sample: `groups` prompts of uniform length in `prompt`, each with
    k responses of uniform length in `response`, the samples of a prompt next to each other."""
    r = np.random.default_rng(seed)
    prompts, responses = [], []
    for _ in range(groups):
        p = r.integers(3, vocab, int(r.integers(*prompt))).astype(np.int32)
        for _ in range(k):
            prompts.append(p)
            responses.append(r.integers(3, vocab, int(r.integers(*response))).astype(np.int32))
    return prompts, responses


def bench(size: str, groups: int, k: int, prompt: tuple[int, int], response: tuple[int, int],
          batch_rows: int, rounds: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForSequenceClassification

    from tbajax.tasks.preference import RewardModel

    with tempfile.TemporaryDirectory(prefix=f"bench-rm-{size}-") as d:
        directory = make_neox_checkpoint(size, reward_model=True, directory=d)
        rm = RewardModel(str(directory), mesh=None, pad_id=PAD, batch_rows=batch_rows)
        ref = AutoModelForSequenceClassification.from_pretrained(directory, dtype=torch.float32).eval()
    torch.set_num_threads(os.cpu_count() or 1)
    prompts, responses = workload(groups, k, prompt, response, rm.vocab_size)
    seqs = [np.concatenate([p, r]) for p, r in zip(prompts, responses)]

    def torch_scores() -> np.ndarray:
        out = []
        with torch.inference_mode():
            for a in range(0, len(seqs), batch_rows):
                chunk = seqs[a:a + batch_rows]
                width = max(map(len, chunk))
                ids = torch.full((len(chunk), width), PAD, dtype=torch.long)
                mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for i, s in enumerate(chunk):
                    ids[i, :len(s)], mask[i, :len(s)] = torch.from_numpy(s.astype(np.int64)), 1
                logits = ref(input_ids=ids, attention_mask=mask).logits  # [rows, 1]: at the last real token
                out.append(logits[:, 0].numpy())
        return np.concatenate(out)

    arms = {
        "packed": lambda: rm.score_samples(prompts, responses),
        "rows": lambda: rm.score(seqs),
        "torch": torch_scores,
    }
    first, scores = {}, {}
    for name, fn in arms.items():  # compile / warm-up, and the scores to compare
        t0 = time.perf_counter()
        scores[name] = np.asarray(fn(), np.float64)
        first[name] = time.perf_counter() - t0
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, fn in arms.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {name: float(np.median(t)) for name, t in times.items()}
    real = sum(map(len, seqs))
    prompt_share = sum(len(p) for p in prompts) / real
    per_group = [len(prompts[g * k]) + sum(map(len, responses[g * k:(g + 1) * k])) for g in range(groups)]
    return {
        "size": size,
        "groups": groups,
        "k": k,
        "prompt_tokens": f"{prompt[0]}-{prompt[1] - 1}",
        "response_tokens": f"{response[0]}-{response[1] - 1}",
        "batch_rows": batch_rows,
        "sequences": len(seqs),
        "real_tokens": real,
        "prompt_share": prompt_share,
        "packed_tokens": int(sum(per_group)),
        "packed_s": med["packed"],
        "rows_s": med["rows"],
        "torch_s": med["torch"],
        "packed_tok_s": real / med["packed"],
        "rows_tok_s": real / med["rows"],
        "torch_tok_s": real / med["torch"],
        "packed_vs_rows": float(np.median([r / p for p, r in zip(times["packed"], times["rows"])])),
        "packed_vs_torch": float(np.median([t / p for p, t in zip(times["packed"], times["torch"])])),
        "rows_vs_torch": float(np.median([t / r for r, t in zip(times["rows"], times["torch"])])),
        "max_abs_diff_packed_rows": float(np.abs(scores["packed"] - scores["rows"]).max()),
        "max_abs_diff_packed_torch": float(np.abs(scores["packed"] - scores["torch"]).max()),
        "first_call_s": first,
        "times": times,
        "rounds": rounds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10M, one small case, 2 rounds")
    ap.add_argument("--json", help="write the figures to this path")
    args = ap.parse_args()
    keep_freed_memory()
    # (size, groups, K, prompt range, response range, score_batch_rows, rounds): TL;DR-shaped
    # (K = 20, posts of 150-400 tokens, summaries of 16-64), then K = 4 with short prompts
    cases = ([("10M", 2, 8, (40, 120), (8, 32), 16, 2)] if args.quick else
             [("10M", 2, 20, (150, 401), (16, 65), 32, 3), ("50M", 2, 20, (150, 401), (16, 65), 32, 3),
              ("50M", 8, 4, (16, 65), (32, 129), 32, 3)])
    rows = [bench(*case) for case in cases]
    info = {**machine(), "load_avg": os.getloadavg()}
    print(f"reward-model scoring (GPT-NeoX sequence classifier, fp32), {info['cpu_count']} CPU cores")
    print(machine_line(info))
    print_table(rows, ["size", "groups", "k", "prompt_tokens", "response_tokens", "real_tokens",
                       "prompt_share", "packed_tokens", "packed_s", "rows_s", "torch_s", "packed_vs_rows",
                       "packed_vs_torch", "rows_vs_torch", "max_abs_diff_packed_torch"])
    print("packed_vs_rows = rows' time / packed's, packed_vs_torch = torch's time / packed's, rows_vs_torch "
          "= torch's / rows' (medians over rounds taken in turns; > 1: the first is faster); packed_tokens: "
          "the packed rows' real slots (each prompt once)")
    write_json(args.json, {"benchmark": "reward_scoring", "machine": info, "rows": rows})


if __name__ == "__main__":
    main()
