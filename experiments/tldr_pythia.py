"""TBA on TL;DR summarisation preference tuning: Pythia SFT policy, Pythia reward model, gold-RM win rate.

The paper's TL;DR setting (TBA spec §6, §8): K = 20 samples for each of 8 prompts per update, T 0.7,
128 new tokens, β 1.0 → 0.05 (linear, jumping to 0.05 at update 32 as in the reference's
defaults), lr 3e-6 linearly decayed over the 256 updates, recency m = 0.5, reward-branch
softmax(reward · 1), a new policy version every k = 10 updates. Reward: the RM's scalar at the last
token of prompt + response (cut after EOS), −1 without EOS (`tbajax.tasks.preference`). Eval: win
rate of the greedy summary over the human reference under the 6.9B gold RM, KL of the greedy policy
to the SFT model, perplexities. Not measured here (no GPU, no weights offline).

Data: a local copy of the TL;DR set (columns `query`, `reference_response`), one file with both
splits' rows or the train split; the task splits it by prompt hash (10 % eval):

    python -m tbajax.main --experiment=tldr_pythia --set task.options.data_path=/data/tldr/train.jsonl

Size: TBAJAX_TLDR_SIZE=410m|1b|2.8b picks policy + RM checkpoints (default 410m), or set them
directly: `--set model.checkpoint=DIR --set task.options.reward_model=DIR
--set task.options.gold_model=DIR`. The hub ids below are the reference's; with HF_HUB_OFFLINE
they must already be in the HF cache, else pass local directories.

One H200 (141 GB), 410m: trainer and one searcher share the device (`system.memory_fraction=0.45`
each), fp32 weights as in the reference. Larger sizes need the split-device layout (not measured).

`build_standin(directory)` writes random GPT-NeoX policy / RM / gold RM checkpoints and a few
synthetic TL;DR-format rows: the stand-in the tests run this experiment's settings on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tbajax.buffer import BufferConfig
from tbajax.config import EvalSpec, ExperimentConfig, ModelSpec, RolloutSpec, SystemSpec, TaskSpec, TrainSpec
from tbajax.sampling import SamplingConfig
from tbajax.training.config import BetaSchedule, LRSchedule, OptimizerConfig, TrainerConfig

SIZES = {
    "410m": ("mnoukhov/pythia410m-sft-tldr", "mnoukhov/pythia410m-rm-tldr6.9b"),
    "1b": ("mnoukhov/pythia1b-sft-tldr", "mnoukhov/pythia1b-rm-tldr6.9b"),
    "2.8b": ("mnoukhov/pythia2.8b-sft-tldr", "mnoukhov/pythia2.8b-rm-tldr6.9b"),
}
GOLD_RM = "cleanrl/EleutherAI_pythia-6.9b-deduped__reward__tldr"
K = 20
PROMPTS_PER_STEP = 8
STEPS = 256
TEMPERATURE = 0.7


def size() -> str:
    s = os.environ.get("TBAJAX_TLDR_SIZE", "410m")
    if s not in SIZES:
        raise ValueError(f"TBAJAX_TLDR_SIZE={s!r}; choose one of {sorted(SIZES)}")
    return s


def config() -> ExperimentConfig:
    policy, reward_model = SIZES[size()]
    return ExperimentConfig(
        name="tldr_pythia",
        description=__doc__.strip().splitlines()[0],
        model=ModelSpec(checkpoint=policy),
        task=TaskSpec(
            name="preference",
            options={
                "source": "tldr",
                "data_path": "",  # required: --set task.options.data_path=...
                "reward": "reward_model",
                "reward_model": reward_model,
                "no_eos_reward": -1.0,
                "gold": "reward_model",
                "gold_model": GOLD_RM,
                "reference": "data",
                "num_eval": 256,
                "score_batch_rows": 32,
            },
        ),
        rollout=RolloutSpec(
            prompts_per_call=PROMPTS_PER_STEP,
            sampling=SamplingConfig(max_new_tokens=128, num_samples=K, temperature=TEMPERATURE, top_p=1.0),
            max_prompt_tokens=512,  # the reference keeps prompts of at most 512 tokens
        ),
        train=TrainSpec(
            steps=STEPS,
            groups_per_step=PROMPTS_PER_STEP,
            objective="tb",
            trainer=TrainerConfig(
                optimizer=OptimizerConfig(lr=LRSchedule(kind="linear", peak=3e-6, decay_steps=STEPS), max_grad_norm=1.0),
                beta=BetaSchedule(kind="linear", start=1.0, final=0.05, decay_steps=STEPS, stop_step=32),
                temperature=TEMPERATURE,
                num_microbatches=PROMPTS_PER_STEP,
                # a group's post is most of each of its K = 20 rows: scored once per group, the step
                # ran 5.1x faster at these shapes (results/benchmarks/packed_groups_tldr_shape.json)
                pack_groups=True,
                param_dtype="float32",
                compute_dtype="float32",  # the reference trains in fp32
            ),
            checkpoint_every=64,
            length_bucket=64,
        ),
        buffer=BufferConfig(samples_per_group=K, recency_prob=0.5, reward_inv_temp=1.0),
        system=SystemSpec(mode="async", num_searchers=1, sync_every=10),
        eval=EvalSpec(every=32, num_problems=256, batch_size=32, max_new_tokens=128),
    )


# --------------------------------------------------------------------------- stand-in

STANDIN_VOCAB = 19  # the character tokenizer of tbajax.tasks.arithmetic


def _neox(directory: Path, classifier: bool, seed: int) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    config = AutoConfig.for_model(
        "gpt_neox", vocab_size=STANDIN_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, rotary_pct=0.5, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, **({"num_labels": 1} if classifier else {}),
    )
    torch.manual_seed(seed)
    cls = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
    model = cls.from_config(config).float().eval()
    with torch.no_grad():  # HF zero-inits biases and ones-inits norms: perturb everything
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def build_standin(directory: str | os.PathLike[str], rows: int = 40) -> dict[str, Path]:
    """Random GPT-NeoX policy (with the character tokenizer), RM and gold RM, and `rows`
    synthetic TL;DR-format rows (`query` / `reference_response` over the tokenizer's characters)."""
    from tbajax.tasks.arithmetic import build_char_tokenizer

    d = Path(directory)
    out = {"policy": d / "policy", "rm": d / "rm", "gold": d / "gold", "data": d / "tldr.jsonl"}
    for name in ("policy", "rm", "gold"):
        out[name].mkdir(parents=True, exist_ok=True)
    _neox(out["policy"], classifier=False, seed=0)
    build_char_tokenizer(out["policy"])
    _neox(out["rm"], classifier=True, seed=1)
    _neox(out["gold"], classifier=True, seed=2)
    with open(out["data"], "w", encoding="utf-8") as f:
        for i in range(rows):
            a, b = 100 + 37 * i, 7 * i + 3
            f.write(json.dumps({"query": f"{a} {b} {a * b % 997} =", "reference_response": f" {a + b}"}) + "\n")
    return out


def standin_overrides(paths: dict[str, Path]) -> list[str]:
    """`--set` arguments that run this experiment's settings on the stand-in, tiny and short."""
    return [
        f"model.checkpoint={paths['policy']}",
        f"task.options.data_path={paths['data']}",
        f"task.options.reward_model={paths['rm']}",
        f"task.options.gold_model={paths['gold']}",
        "task.options.eval_fraction=0.25",
        "task.options.num_eval=8",
        "task.options.score_batch_rows=16",
        "rollout.sampling.max_new_tokens=8",
        "rollout.sampling.num_samples=4",
        "rollout.max_prompt_tokens=24",
        "rollout.prompts_per_call=2",
        "buffer.samples_per_group=4",
        "train.groups_per_step=2",
        "train.trainer.num_microbatches=1",
        "train.length_bucket=16",
        "system.sync_every=2",
        "eval.num_problems=8",
        "eval.batch_size=8",
        "eval.max_new_tokens=8",
        "train.log_every=1",
    ]
