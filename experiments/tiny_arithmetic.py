"""The embedded default: a ~0.8M-parameter policy learns 3-digit addition with TBA on a CPU.

Offline and small on purpose: the policy ships in experiments/assets/tiny-arithmetic/ (built by
experiments/make_tiny_arithmetic.py, warm-started to ~25% greedy accuracy), the task is
generated, and one trainer plus one searcher process share two CPU cores.
"""

from pathlib import Path

from tbajax.buffer import BufferConfig
from tbajax.config import EvalSpec, ExperimentConfig, ModelSpec, RolloutSpec, SystemSpec, TaskSpec, TrainSpec
from tbajax.sampling import SamplingConfig
from tbajax.training.config import BetaSchedule, LRSchedule, OptimizerConfig, TrainerConfig

CHECKPOINT = Path(__file__).resolve().parent / "assets" / "tiny-arithmetic"
K = 8


def config() -> ExperimentConfig:
    return ExperimentConfig(
        name="tiny_arithmetic",
        description=__doc__.strip().splitlines()[0],
        model=ModelSpec(checkpoint=str(CHECKPOINT)),
        task=TaskSpec(name="arithmetic", options={"digits": 3}),
        rollout=RolloutSpec(
            prompts_per_call=16,
            sampling=SamplingConfig(max_new_tokens=6, num_samples=K, temperature=1.0),
            max_prompt_tokens=16,
            max_calls_per_version=2,  # trainer and searcher share 2 cores: do not run ahead
            reference_logprobs=True,  # the searcher scores the reference; the trainer need not
        ),
        train=TrainSpec(
            steps=600,
            groups_per_step=16,
            objective="tb",
            trainer=TrainerConfig(
                optimizer=OptimizerConfig(lr=LRSchedule(kind="constant", peak=5e-5), max_grad_norm=1.0),
                beta=BetaSchedule(kind="constant", start=0.1),
                temperature=1.0,
                param_dtype="float32",
                compute_dtype="float32",
                compute_reference_logprobs=False,
            ),
            checkpoint_every=100,
            length_bucket=16,
        ),
        buffer=BufferConfig(
            samples_per_group=K,
            capacity_per_prompt=32,
            recency_prob=0.95,
            dedup=False,  # every correct answer is the same token sequence
            max_staleness=4,  # bounded lag: the trainer waits rather than replay stale data
        ),
        system=SystemSpec(mode="async", num_searchers=1, sync_every=2),
        eval=EvalSpec(every=100, num_problems=500, batch_size=250),
    )
