"""Build the tiny default policy shipped in experiments/assets/tiny-arithmetic/ (reproducibly).

A ~0.8M-parameter Llama-style decoder with a character tokenizer, warm-started by supervised
learning on 3-digit addition and stopped on purpose once greedy held-out accuracy first reaches
`--target` (default 25%; accuracy jumps during training, so the shipped one stopped at 33.2%),
so that RL has room to improve it. Writes an ordinary HF checkpoint
(config.json + model.safetensors + tokenizer files) that transformers and tbajax both load.

    python experiments/make_tiny_arithmetic.py [--out DIR] [--target 0.25]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from tbajax.batch import token_logprobs
from tbajax.models import CausalLM, ModelConfig, save_model
from tbajax.sampling import Sampler, SamplingConfig
from tbajax.tasks.arithmetic import CHAR_VOCAB, arithmetic_task, build_char_tokenizer

OUT = Path(__file__).resolve().parent / "assets" / "tiny-arithmetic"


def model_config(vocab: int) -> ModelConfig:
    return ModelConfig(
        model_type="llama", vocab_size=vocab, hidden_size=128, intermediate_size=512, num_layers=4,
        num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
    )


def supervised_batch(problems, tokenizer, start: int, size: int, seq: int = 16):
    tokens = np.zeros((size, seq), np.int32)
    mask = np.zeros((size, seq), bool)
    target = np.zeros((size, seq), bool)
    for i in range(size):
        p = problems[start + i]
        prompt = tokenizer(p.question)["input_ids"]
        answer = tokenizer(p.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = prompt + answer
        tokens[i, : len(ids)] = ids
        mask[i, : len(ids)] = True
        target[i, len(prompt) : len(ids)] = True
    return jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(target)


def greedy_accuracy(sampler: Sampler, model: CausalLM, problems, tokenizer, task) -> float:
    sampler.update_params(nnx.state(model, nnx.Param))
    prompts = [tokenizer(p.question)["input_ids"] for p in problems]
    out = sampler.sample(prompts, SamplingConfig(max_new_tokens=6, greedy=True), jax.random.PRNGKey(0))
    correct = 0
    for i, p in enumerate(problems):
        resp = out.response(i)
        text = tokenizer.decode(resp[:-1] if out.finished[i] else resp, skip_special_tokens=True)
        correct += task.reward(text, p.answer)[0] == 1.0
    return correct / len(problems)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--target", type=float, default=0.25, help="stop at this greedy held-out accuracy")
    ap.add_argument("--max-steps", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=5, help="supervised steps between accuracy checks")
    args = ap.parse_args()

    task = arithmetic_task(digits=3)
    train, evals = task.load("train"), list(task.load("eval"))[:500]
    tokenizer = build_char_tokenizer()
    model = CausalLM(model_config(len(CHAR_VOCAB)), rngs=nnx.Rngs(args.seed))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3, weight_decay=0.0), wrt=nnx.Param)
    sampler = Sampler(model, max_cache_length=32)

    @nnx.jit
    def step(model, optimizer, tokens, mask, target):
        def loss_fn(model):
            logits, _ = model(tokens, attention_mask=mask)
            lp = token_logprobs(logits, tokens)
            return -(lp * target).sum() / target.sum()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    t0 = time.time()
    acc, s = 0.0, 0
    for s in range(1, args.max_steps + 1):
        loss = step(model, optimizer, *supervised_batch(train, tokenizer, (s - 1) * 256, 256))
        if s % args.eval_every == 0:
            acc = greedy_accuracy(sampler, model, evals, tokenizer, task)
            print(f"step {s:4d}  loss {float(loss):.3f}  greedy held-out accuracy {acc:.3f}  ({time.time() - t0:.0f}s)")
            if acc >= args.target:
                break
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(args.out)
    save_model(model, args.out)
    (args.out / "warm_start.json").write_text(
        json.dumps({"supervised_steps": s, "batch": 256, "lr": 1e-3, "eval_accuracy": acc,
                    "eval_problems": len(evals), "eval_every": args.eval_every, "target": args.target,
                    "seed": args.seed}, indent=2)
    )
    print(f"wrote {args.out} after {s} supervised steps (accuracy {acc:.3f}, {model.config.num_params():,} params)")


if __name__ == "__main__":
    main()
