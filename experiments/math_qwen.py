"""TBA′ on MATH: Qwen2.5-7B base, 420 steps on 8 GPUs (4 trainer + 4 searchers), MATH-500 accuracy.

Reproduces the paper's MATH experiment (TBA spec §6-7, Bartoldson et al. 2025): TBA′ (constant
β = 0.005, reference reset every 50 steps, clipped ratio ≤ 8, grad clip 1.0, lr 1e-6) with
rollouts up to 10 policy versions old, 32 prompts × 16 samples per step, temperature 1.0, a 4096
token context. The paper's target: TBA′ beats Dr. GRPO (`--objective=dr_grpo`, i.e. β = 0) on
MATH-500 accuracy, more clearly as asynchrony grows (`--set buffer.async_level=2` vs 10).

Data: MATH train + MATH-500 test, fetched from the HF hub when online (`datasets`), otherwise
`--set task.options.data_path=DIR` (DIR/train.jsonl and DIR/test.jsonl with fields problem +
answer or solution). Checkpoint: the hub id below, or `--set model.checkpoint=/path/Qwen2.5-7B`.

    python -m tbajax.main --experiment=math_qwen --set model.checkpoint=/ckpt/Qwen2.5-7B \\
        --set task.options.data_path=/data/math

On 8 GPUs (80 GB each): trainer on GPUs 0-3 with an FSDP mesh (fp32 master weights, Adam moments
and the fp32 reference ≈ 140 GB, 35 GB per GPU), bf16 compute, full remat, 32 micro-batches of
one group each; one bf16 searcher per GPU 4-7. The trainer's fp32 logits (0.6 MB per token of
the 152k vocabulary) are computed a chunk of 1 GiB at a time (`model.head_chunk_tokens=auto`):
XLA's CPU buffer assignment for one 16 × 4096 group of the 7B takes 52 GiB of scratch against 85 GiB
with all logits at once (`experiments/benchmarks/head_chunks.py`); not measured on a GPU.

Scaling down to ONE GPU. The 7B fp32 master weights + Adam alone need ~120 GB, so use a smaller
Qwen2.5 (same family, same code path), a shorter context and fewer groups, and let both roles
share the device (an estimate for one 141 GB H200, not measured; on an 80 GB GPU use
Qwen2.5-0.5B):

    python -m tbajax.main --experiment=math_qwen \\
        --set model.checkpoint=/ckpt/Qwen2.5-1.5B --set task.options.data_path=/data/math \\
        --set system.devices=shared --set system.trainer_mesh.fsdp=1 \\
        --set system.num_searchers=1 --set system.memory_fraction=0.45 \\
        --set train.groups_per_step=8 --set train.trainer.num_microbatches=8 \\
        --set rollout.prompts_per_call=8 --set rollout.reward_workers=2 \\
        --set rollout.max_prompt_tokens=512 --set rollout.sampling.max_new_tokens=1024

`system.memory_fraction` is each process's share of the GPU (trainer + 1 searcher = 2 × 0.45).
A micro-batch holds one whole group (16 rows); its activations grow with the context: shorten the
context first when memory runs out.
"""

from tbajax.buffer import BufferConfig
from tbajax.config import EvalSpec, ExperimentConfig, ModelSpec, RolloutSpec, SystemSpec, TaskSpec, TrainSpec
from tbajax.sampling import SamplingConfig
from tbajax.sharding import MeshConfig
from tbajax.training.config import BetaSchedule, LRSchedule, OptimizerConfig, TrainerConfig

CHECKPOINT = "Qwen/Qwen2.5-7B"
K = 16  # samples per prompt, all trained
GROUPS_PER_STEP = 32
TEMPERATURE = 1.0
# <|endoftext|> ends a base-model completion; <|im_end|> too, as Qwen2.5 base knows ChatML
STOP_TOKEN_IDS = (151643, 151645)


def config() -> ExperimentConfig:
    return ExperimentConfig(
        name="math_qwen",
        description=__doc__.strip().splitlines()[0],
        model=ModelSpec(checkpoint=CHECKPOINT, param_dtype="bfloat16", dtype="bfloat16", remat="full"),
        # base model: the plain prompt "{problem}\nPlease reason step by step, ... \boxed{}."
        task=TaskSpec(name="math", options={"data_path": None}, chat_template=False),
        rollout=RolloutSpec(
            prompts_per_call=8,  # 4 searchers × 8 prompts = one step's 32 groups
            sampling=SamplingConfig(
                max_new_tokens=3072, num_samples=K, temperature=TEMPERATURE, stop_token_ids=STOP_TOKEN_IDS
            ),
            max_prompt_tokens=1024,  # + 3072 new = the paper's 4096-token context
            reward_workers=8,  # math-verify can hang: grade in killable workers
            reward_timeout_s=10.0,
        ),
        train=TrainSpec(
            steps=420,
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
            checkpoint_every=60,
            keep_checkpoints=1,  # a 7B trainer state is ~110 GB
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
        eval=EvalSpec(every=60, num_problems=500, batch_size=64),
    )
