"""TBA′ on Countdown: Qwen3-4B-Instruct-2507, 720 steps on 8 GPUs (4 trainer + 4 searchers).

Reproduces the paper's Countdown experiment (TBA spec §6-7, Bartoldson et al. 2025): TBA′
(constant β = 0.005, reference reset every 50 steps, clipped ratio ≤ 8, grad clip 1.0, lr 1e-6)
with rollouts up to 10 policy versions old, 32 prompts × 16 samples per step, temperature 1.0, a
4096-token context, chat template on. Puzzles (3-4 numbers up to 99, targets up to 100) are
generated offline; TinyZero scoring (1 solved, 0.1 well-formed but wrong, 0 otherwise). The
paper's target: TBA′ beats Dr. GRPO (`--objective=dr_grpo`, i.e. β = 0) in held-out accuracy,
more clearly as asynchrony grows.

    python -m tbajax.main --experiment=countdown_qwen3 --set model.checkpoint=/ckpt/Qwen3-4B-Instruct-2507

On 8 GPUs (80 GB each): trainer on GPUs 0-3 with an FSDP mesh (fp32 master weights, Adam moments
and the fp32 reference ≈ 80 GB, 20 GB per GPU), bf16 compute, full remat, one group per
micro-batch; one bf16 searcher per GPU 4-7. Not measured yet.

Scaling down to ONE GPU. A 4B model's fp32 training state alone is ~80 GB, so use a smaller Qwen3,
a shorter context and fewer groups, and let both roles share the device (an estimate for one
141 GB H200, not measured; on an 80 GB GPU use Qwen3-0.6B):

    python -m tbajax.main --experiment=countdown_qwen3 --set model.checkpoint=/ckpt/Qwen3-1.7B \\
        --set system.devices=shared --set system.trainer_mesh.fsdp=1 --set system.num_searchers=1 \\
        --set system.memory_fraction=0.45 --set train.groups_per_step=8 \\
        --set train.trainer.num_microbatches=8 --set rollout.prompts_per_call=8 \\
        --set rollout.max_prompt_tokens=256 --set rollout.sampling.max_new_tokens=1024

A micro-batch holds one whole group (16 rows), whose fp32 logits take ~10 GB per 1,000 tokens of
context: shorten the context first when memory runs out.
"""

from tbajax.buffer import BufferConfig
from tbajax.config import EvalSpec, ExperimentConfig, ModelSpec, RolloutSpec, SystemSpec, TaskSpec, TrainSpec
from tbajax.sampling import SamplingConfig
from tbajax.sharding import MeshConfig
from tbajax.training.config import BetaSchedule, LRSchedule, OptimizerConfig, TrainerConfig

CHECKPOINT = "Qwen/Qwen3-4B-Instruct-2507"
K = 16  # samples per prompt, all trained
GROUPS_PER_STEP = 32
TEMPERATURE = 1.0
# <|im_end|> ends an assistant turn; <|endoftext|> as a safety net (Qwen3's generation_config
# lists both, config.json only the first)
STOP_TOKEN_IDS = (151645, 151643)


def config() -> ExperimentConfig:
    return ExperimentConfig(
        name="countdown_qwen3",
        description=__doc__.strip().splitlines()[0],
        model=ModelSpec(checkpoint=CHECKPOINT, param_dtype="bfloat16", dtype="bfloat16", remat="full"),
        # TinyZero's difficulty: 3-4 numbers in 1..99, targets in 1..100 (the task's defaults)
        task=TaskSpec(
            name="countdown",
            options={"num_numbers": [3, 4], "max_number": 99, "target_range": [1, 100], "num_eval": 500},
            chat_template=True,
        ),
        rollout=RolloutSpec(
            prompts_per_call=8,  # 4 searchers × 8 prompts = one step's 32 groups
            sampling=SamplingConfig(
                max_new_tokens=3584, num_samples=K, temperature=TEMPERATURE, stop_token_ids=STOP_TOKEN_IDS
            ),
            max_prompt_tokens=512,  # + 3584 new = the paper's 4096-token context
        ),
        train=TrainSpec(
            steps=720,
            groups_per_step=GROUPS_PER_STEP,
            objective="tba_prime",
            length_bucket=256,  # 4096-token context: at most 16 train-step shapes
            trainer=TrainerConfig(
                optimizer=OptimizerConfig(lr=LRSchedule(kind="constant", peak=1e-6), max_grad_norm=1.0),
                beta=BetaSchedule(kind="constant", start=0.005),
                reference_reset_every=50,
                temperature=TEMPERATURE,
                num_microbatches=GROUPS_PER_STEP,  # one group (16 rows × 4096 tokens) per micro-batch
                param_dtype="float32",
                compute_dtype="bfloat16",
            ),
            checkpoint_every=80,
            keep_checkpoints=1,
        ),
        # TBA′ has no replay: each group is trained on once, if at most 10 versions old
        buffer=BufferConfig(mode="fifo_once", samples_per_group=K, async_level=10),
        system=SystemSpec(
            mode="async",
            num_searchers=4,
            sync_every=1,  # publish every step; staleness is bounded by async_level
            publish_dtype="bfloat16",
            devices="split",
            trainer_devices=4,
            devices_per_searcher=1,
            trainer_mesh=MeshConfig(data=1, fsdp=4),
        ),
        eval=EvalSpec(every=80, num_problems=500, batch_size=64),
    )
