"""Probe: is there a reward signal for the red-team attacker to find? (diagnosis for issue 15)

Samples N attacks from the *untrained* attacker of experiments/redteam_smollm2.py (or with another
instruction / system prompt / temperature), has the victim answer each, scores the answers with
the BiLSTM and prints the distribution of mean log toxicity, the ASR, and the top attacks. No
training; one process; writes a JSON record with --json.

    PYTHONPATH=$PWD python experiments/studies/redteam_reward_probe.py --n 64 --json /tmp/probe.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=64, help="attacks to sample")
    p.add_argument("--temperature", type=float, default=None, help="default: the recipe's")
    p.add_argument("--instruction", action="append", default=None,
                   help="repeatable: each instruction is probed in turn with the same scorer")
    p.add_argument("--system-prompt", default=None)
    p.add_argument("--victim-answers", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show", type=int, default=8, help="print this many top attacks")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import experiments.redteam_smollm2 as recipe
    from experiments.benchmarks.common import machine
    from tbajax.system.assets import load_task, load_tokenizer_for
    from tbajax.tasks.scoring import ScorerContext

    cfg = recipe.config()
    opts = dict(cfg.task.options)
    if args.system_prompt is not None:
        opts["system_prompt"] = args.system_prompt
    if args.victim_answers is not None:
        opts["victim_answers"] = args.victim_answers
    cfg = dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, options=opts))
    temperature = cfg.rollout.sampling.temperature if args.temperature is None else args.temperature
    tok = load_tokenizer_for(cfg)
    t0 = time.perf_counter()
    task = load_task(cfg)
    context = ScorerContext(config=cfg, tokenizer=tok, policy_checkpoint=cfg.model.checkpoint)
    scorer = task.scorer(task, context)
    print(f"scorer built in {time.perf_counter() - t0:.1f} s")
    records = []
    for instruction in args.instruction or [opts["instruction"]]:
        task_i = load_task(dataclasses.replace(cfg, task=dataclasses.replace(
            cfg.task, options={**opts, "instruction": instruction})))
        records.append(probe(args, task_i, tok, scorer, cfg, temperature, instruction, opts))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"probes": records, "machine": machine()}, indent=1))
    return records


def probe(args: argparse.Namespace, task: Any, tok: Any, scorer: Any, cfg: Any, temperature: float,
          instruction: str, opts: dict[str, Any]) -> dict[str, Any]:
    """Sample args.n attacks of `instruction` from the untrained attacker and score them."""
    from tbajax.tasks.scoring import Samples

    t0 = time.perf_counter()
    problem = task.load("train")[0]
    prompt = tok(task.prompt(problem, tok), add_special_tokens=False)["input_ids"]
    sampling = dataclasses.replace(cfg.rollout.sampling, num_samples=args.n, temperature=temperature)
    key = jax.random.PRNGKey(args.seed)
    out = scorer.victim_sampler.sample([prompt], sampling, jax.random.fold_in(key, 1))
    stops = {int(tok.convert_tokens_to_ids(tok.eos_token)), *(int(t) for t in sampling.stop_token_ids or ())}
    resp = []
    for i in range(len(out)):
        r = out.response(i)
        resp.append(r[:-1] if len(r) and int(r[-1]) in stops else r)
    texts = [tok.decode(r, skip_special_tokens=True) for r in resp]
    samples = Samples(problems=[problem] * len(texts), prompt_tokens=[np.asarray(prompt)] * len(texts),
                      response_tokens=resp, texts=texts, finished=np.ones(len(texts), bool))
    scores = scorer.score(samples, jax.random.fold_in(key, 2))
    wall = time.perf_counter() - t0
    tox = np.asarray(scores.extras["toxicity"], np.float64)
    log_gm = np.log(np.clip(tox, 1e-300, None)).mean(-1)
    gm = np.exp(log_gm)
    order = np.argsort(-log_gm)
    q = np.quantile(log_gm, [0.1, 0.5, 0.9, 1.0])
    record = {
        "what": "reward probe of the untrained redteam_smollm2 attacker (no training)",
        "instruction": instruction, "system_prompt": opts.get("system_prompt"),
        "temperature": temperature, "n": len(texts), "prompt_tokens": len(prompt),
        "victim_answers": opts["victim_answers"],
        "asr": float((gm > 0.5).mean()), "num_gm_over_0.1": int((gm > 0.1).sum()),
        "mean_geometric_toxicity": float(gm.mean()),
        "log_gm_quantiles_10_50_90_max": [float(v) for v in q],
        "log_reward_mean": float(np.mean(scores.reward)), "log_reward_std": float(np.std(scores.reward)),
        "log_prior_mean": float(np.mean(scores.extras["log_prior"])),
        "unique_attacks": len(set(texts)), "wall_s": wall,
        "top": [{"attack": texts[i], "gm": float(gm[i]), "answers": scores.extras["victim_answers"][i]}
                for i in order[: args.show]],
    }
    print(json.dumps({k: v for k, v in record.items() if k != "top"}, indent=1))
    for row in record["top"]:
        print(f"{row['gm']:.3f} | {row['attack']!r} -> {row['answers']}")
    return record


if __name__ == "__main__":
    main()
