"""The experiment configuration: one tree of frozen dataclasses, overridable from the command line.

`--set section.field=value` (repeatable) replaces any leaf; values are parsed as JSON when they
look like JSON (numbers, true/false/null, lists) and checked against the field's type. A key that
does not exist is an error that lists the valid keys (with the closest match), never ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from tbajax.buffer import BufferConfig
from tbajax.models.lora_config import LoraConfig
from tbajax.sampling.config import SamplingConfig
from tbajax.sharding import MeshConfig
from tbajax.training.config import TrainerConfig


class ConfigError(ValueError):
    """A configuration key or value is invalid."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """checkpoint: local HF directory or hub id (downloaded only when online).
    tokenizer: same forms; None = the checkpoint's own tokenizer files.
    lora: train LoRA adapters (rank, alpha, targets: weight names or glob patterns such as
      "q_proj" or "layers.*_proj"; dropout must stay 0) on the frozen checkpoint instead of all
      its weights; null = full fine-tuning. E.g. `--set model.lora.rank=8`.
    scan_layers: the trainer's forward and backward apply the layers as one scan (`true`: compile
      time flat in depth) or unrolled (`false`: faster for a few layers, much longer to compile
      for deep models); "auto" unrolls up to `models.config.UNROLLED_MAX_LAYERS` (8) layers.
    attention: the attention of training, scoring and prompt passes: "xla" (tbajax's own, every
      platform and dtype) or "cudnn" (cuDNN's fused flash attention: NVIDIA GPUs, dtype bfloat16 or
      float16; not yet run on a GPU by these sessions, see the README's status).
    head_chunk_tokens: the trainer's vocabulary projection + log-softmax runs this many tokens a
      device at a time, its backward computing each chunk's logits again: "auto" chunks when a
      device's share of a micro-batch's fp32 logits exceeds 1 GiB (a long context with a 150k-word
      vocabulary), null never chunks.
    """

    checkpoint: str = ""
    tokenizer: str | None = None
    param_dtype: str = "float32"
    dtype: str = "float32"
    remat: Literal["none", "full", "dots"] = "none"
    scan_layers: bool | Literal["auto"] = "auto"
    attention: Literal["xla", "cudnn"] = "xla"
    head_chunk_tokens: int | Literal["auto"] | None = "auto"
    lora: LoraConfig | None = None


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """name: a registered task (tbajax.tasks) or `path/to/file.py:factory` for a user task.
    options: keyword arguments of the task's factory (e.g. data_path, digits)."""

    name: str = "arithmetic"
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    chat_template: bool = False


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """What each searcher does per generation call.

    prompts_per_call: prompts sampled together in one batched `Sampler.sample`.
    sampling.num_samples: K' samples generated per prompt (>= train.samples_per_group).
    reward_workers: 0 scores in-process (fine for cheap graders); > 0 uses a killable pool.
    reference_logprobs: searchers score each sample under the reference policy (the initial
      checkpoint, which they load anyway) so the trainer does not have to; needs
      train.trainer.compute_reference_logprobs=False and no reference resets.
    max_calls_per_version: a searcher that has made this many generation calls with one param
      version pauses until the trainer publishes the next (None: never pause). For searchers that
      share devices with the trainer (a CPU, one GPU), where generating far ahead only steals time.
    fail_fast_grades: a searcher exits with the grader's first error when this many consecutive
      grades all failed (ERROR/TIMEOUT): a broken reward function, not a hard problem.
    engine: "static" decodes each call's prompts as one bucket until its longest sample ends;
      "continuous" keeps `decode_slots` samples decoding in compiled chunks of `decode_chunk`
      steps, refills a slot as soon as its sample ends, sends each prompt's K samples to the
      scorer and the store as soon as they are all done (in stream order), and swaps newly
      published params in between chunks (samples in flight carry tokens of both versions:
      `Trajectory.token_versions`). See tbajax/sampling/continuous.py.
    decode_slots: samples decoded at once (continuous; >= sampling.num_samples, a multiple of
      the searcher mesh's batch shards; with a prompt pool, >= K x the batch shards: a prompt's
      K samples decode on its pool entry's device). decode_chunk: decode steps between harvests /
      swaps.
    random_temperature: (low, high, prob): each generation call samples at a temperature drawn
      uniform in [low, high] with probability prob, else at `sampling.temperature` (the
      red-teaming reference's exploration: [0.5, 2.0] half the time, else 1.0). Only to explore:
      needs train.exploration_temperature=true (the trainer scores at its own temperature) and
      the static engine. The temperature is a traced knob: no recompiles.
    first_decode_phase: the static engine decodes its first this-many new tokens over a cache of
      prompt + this many slots, then over caches with room for twice as many (attention reads
      every slot of its cache; `tbajax.sampling.core.phase_slots`); 0: one full-length cache (one
      compiled loop body, no second cache in memory).
    share_prompt_cache: each prompt's keys/values are cached once for its K samples and their
      decode attention reads them once (`Sampler(share_prompt_cache=...)`; the continuous engine
      holds them in a pool of `prompt_pool` prompts); false copies the prompt into each sample's
      row, as before.
    prompt_pool: prompts whose keys/values the continuous engine holds at once (None: 3 x
      decode_slots / K, or 2 x where the prompt bucket is longer than max_new_tokens:
      `sampling.continuous.default_prompt_pool`). A prompt waits for a free entry and holds it until
      its last sample ends; every decode step reads the whole pool, so a larger pool costs time, a
      smaller one idles slots behind stragglers.
    ring_tiers: the continuous engine's decode slots split into this many tiers of rings whose
      lengths halve from the longest (`sampling.continuous.geometric_ring_tiers`): a decode step's
      attention reads each sample's tier ring, and samples move to a longer tier as they grow.
      1: one ring of the longest length for every slot. Worth it when responses are long and
      their lengths spread (chains of thought). On a mesh with several batch shards each shard
      holds its share of every tier.
    fsdp_weights: on a sampling mesh with fsdp > 1 (system.searcher_mesh, or trainer_mesh where
      the trainer samples itself): "whole" holds the serving weights whole along fsdp, gathered
      once per params version (weights / tensor a device; every decode step reads every weight;
      `tbajax.sampling.sampler.serving_shardings`); "tensor" samples on the same devices with the
      fsdp devices as more tensor shards (weights / (fsdp x tensor) a device, resharded once per
      version, the batch split over data only: `tbajax.sharding.fsdp_as_tensor`), for weights
      that do not fit whole; "split" leaves them split as trained, all-gathered by every prompt
      pass and decode step.
    """

    prompts_per_call: int = 8
    sampling: SamplingConfig = SamplingConfig()
    max_prompt_tokens: int = 256
    reward_workers: int = 0
    reward_timeout_s: float = 10.0
    max_calls_per_version: int | None = None
    reference_logprobs: bool = False
    fail_fast_grades: int = 64
    engine: Literal["static", "continuous"] = "static"
    decode_slots: int = 64
    decode_chunk: int = 16
    random_temperature: tuple[float, float, float] | None = None
    first_decode_phase: int = 64
    share_prompt_cache: bool = True
    prompt_pool: int | None = None
    ring_tiers: int = 1
    fsdp_weights: Literal["whole", "tensor", "split"] = "whole"

    def __post_init__(self) -> None:
        if self.ring_tiers > 1 and self.engine != "continuous":
            raise ConfigError(f"rollout.ring_tiers={self.ring_tiers} splits the continuous engine's decode "
                              "slots; set rollout.engine=continuous, or ring_tiers=1")
        if self.prompt_pool is not None and self.prompt_pool < 1:
            raise ConfigError(f"rollout.prompt_pool={self.prompt_pool} must hold at least one prompt "
                              "(or null for the engine's default)")
        if self.first_decode_phase < 0:
            raise ConfigError(f"rollout.first_decode_phase={self.first_decode_phase} must be >= 0 "
                              "(0: decode over one full-length cache)")
        if self.random_temperature is not None:
            t = tuple(float(x) for x in self.random_temperature)
            if len(t) != 3 or not (0 < t[0] <= t[1] and 0 <= t[2] <= 1):
                raise ConfigError(f"rollout.random_temperature={self.random_temperature!r} must be "
                                  "[low, high, prob] with 0 < low <= high and prob in [0, 1]")
            if self.engine != "static":
                raise ConfigError("rollout.random_temperature draws one temperature per generation call: "
                                  "use rollout.engine=static (the continuous engine has no calls)")
            object.__setattr__(self, "random_temperature", t)


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """steps: trainer updates. groups_per_step: prompts per batch (B / K).
    objective: a registered objective name (tbajax.objectives) or `path/to/file.py:function`."""

    steps: int = 100
    groups_per_step: int = 8
    objective: str = "tb"
    objective_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    trainer: TrainerConfig = TrainerConfig()
    score_stop_token: bool = True
    length_bucket: int = 32  # batches are padded to a multiple of this: few shapes, little waste
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    log_every: int = 1
    # True: searchers sample at rollout.sampling.temperature only to explore, and the trainer scores
    # the policy at train.trainer.temperature (red-teaming samples hotter and trains the untempered
    # policy). Sound for TB, an off-policy objective whose loss never uses the sampling
    # distribution; ratio/clipping objectives would compare log-probs of different distributions.
    exploration_temperature: bool = False
    # True: the asynchronous mode's trainer draws the next batch in a background thread and
    # dispatches update n+1 before checking update n, so the device does not wait for the host
    # (same updates, same order, same params: see tbajax.system.trainer.StepLoop). False: the
    # serial loop. Sync mode is always serial (its next batch is generated with update n's params).
    pipeline: bool = True


@dataclasses.dataclass(frozen=True)
class RaySpec:
    """Where `--launcher=ray` places the roles (the process launcher ignores this section).

    trainer_cpus / trainer_gpus, searcher_cpus / searcher_gpus: the Ray resources each role's
      actor reserves (fractions allowed: two roles with 0.5 GPU share one). An actor with GPUs
      gets its CUDA_VISIBLE_DEVICES from Ray, which then replaces system.devices="split".
    trainer_resources / searcher_resources: custom Ray resources the actor needs, e.g.
      {"trainer_host": 1} with `ray start --resources='{"trainer_host": 1}'` on that node.
    trainer_labels / searcher_labels: node labels the actor needs (Ray's label_selector, in
      recent Ray versions; tested with 2.60), e.g. {"ray.io/accelerator-type": "H100"}.
    """

    trainer_cpus: float = 1.0
    trainer_gpus: float = 0.0
    searcher_cpus: float = 1.0
    searcher_gpus: float = 0.0
    trainer_resources: Mapping[str, float] = dataclasses.field(default_factory=dict)
    searcher_resources: Mapping[str, float] = dataclasses.field(default_factory=dict)
    trainer_labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    searcher_labels: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:  # Ray would reject these only when the roles start
        for kind in ("trainer", "searcher"):
            for name, amount in getattr(self, f"{kind}_resources").items():
                if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount >= 0:
                    raise ConfigError(f"system.ray.{kind}_resources: {name!r}: {amount!r} must be a number >= 0")
            for name, value in getattr(self, f"{kind}_labels").items():
                if not isinstance(value, str):
                    raise ConfigError(f"system.ray.{kind}_labels: {name!r}: {value!r} must be a string")


@dataclasses.dataclass(frozen=True)
class WandbSpec:
    """Weights & Biases logging (`pip install 'tbajax[wandb]'`): every role's metrics records, as
    they go to metrics.jsonl, also go to a W&B run of its own, all of them in one W&B group per
    tbajax run (W&B's layout for a job of several processes), each resumed where it stopped when
    its role restarts. Enable with `--set system.wandb.project=NAME`.

    project / entity (None: your default entity) / tags: where the runs go and how they are marked.
    group: None = the run directory's name and a hash of its path (what the run ids build on).
    mode: "online" (needs `wandb login` or WANDB_API_KEY and network) or "offline": written under
      RUN_DIR/wandb/, uploaded later with `wandb sync RUN_DIR/wandb/offline-run-*`.
    """

    project: str = "tbajax"
    entity: str | None = None
    group: str | None = None
    tags: tuple[str, ...] = ()
    mode: Literal["online", "offline"] = "online"


@dataclasses.dataclass(frozen=True)
class SystemSpec:
    """How the roles run.

    mode: "async" = trainer and searchers as separate processes that never wait for each other;
      "sync" = one process alternates generate-then-train on the current params (on-policy).
    sync_every: k, publish params (and start a new "recent" window) every k trainer steps.
    searcher_mesh / trainer_mesh: each process's own mesh over its own devices. A searcher reads
      every weight at every token: split its weights over `tensor` (or replicate them over
      `data`); a sampling mesh with `fsdp` > 1 moves its weights once per params version, not at
      every decode step (`rollout.fsdp_weights`).
    devices: "shared" = every process sees all local devices (on one GPU each takes
      `memory_fraction`, null: 0.9 over the processes the run starts, `launcher.memory_share`);
      "split" = the launcher gives the trainer `trainer_devices` GPUs and each
      searcher `devices_per_searcher` GPUs (CUDA_VISIBLE_DEVICES).

    Supervision by the launcher (a budget per time window, so that a few transient crashes over
    a multi-day run are survived while a crash loop ends the run):
    max_searcher_restarts: restarts of one searcher allowed within `restart_window_s`.
    max_trainer_restarts: automatic restarts of a failed trainer (with --resume semantics: from
      its last checkpoint) within `restart_window_s`; 0 = a trainer failure ends the run.
    restart_window_s: the sliding window the restart budgets count in.
    restart_backoff_s: delay before a restart; doubles with each earlier restart of that role
      still in the window (capped at 60 s), so a crash loop does not spin.
    stall_timeout_s: end the run, naming the stuck role, when the trainer's step has not advanced
      for this long (waiting for data no searcher delivers, or hung); a searcher silent this long
      while the trainer keeps stepping is killed and restarted. None = wait forever. Counts from
      the start too, so it must cover model loading, compilation and the first evaluation.
    stop_grace_s: after a stop request, how long each role gets to checkpoint and exit before it
      is killed (a second Ctrl-C kills at once).
    ray: where `--launcher=ray` places the roles (resources, node labels); see RaySpec.
    publish: what the trainer publishes to the searchers. "adapters": only the LoRA adapters
      (searchers merge them into the base weights they hold; needs model.lora); "full": every
      weight (under LoRA, the merged policy); "auto" = "adapters" with model.lora, else "full".
      Sync mode hands the merged params over in memory either way.
    trainer_processes: the process launcher starts the trainer as this many JAX processes on one
      global mesh (jax.distributed over localhost; process 0 decides every batch and alone
      writes, see tbajax.system.distributed). With devices="split" each process gets
      trainer_devices / trainer_processes GPUs. Searchers are always single-process.
    cpu_devices_per_trainer_process: on CPU, the fake devices each trainer process gets
      (XLA --xla_force_host_platform_device_count), to try a multi-process mesh without
      accelerators; None = leave XLA_FLAGS as it is.
    cpu_devices_per_searcher: on CPU, the host devices each searcher process gets (XLA
      --xla_force_host_platform_device_count); with searcher_mesh's default (data=-1) its batches
      are split over them. XLA:CPU runs a decode step's attention on one core: with a device per
      core, a 2-core machine ran the 10M model's generate 1.15-1.3x faster and the 50M model's
      0.97-1.06x (`experiments/results/benchmarks/sampler_cpu_devices.json`). For a searcher
      with cores of its own: in the default run, whose trainer shares the two cores, it took 1.22x
      the wall time (`default_engines_searcher_devices.json`); None = leave XLA_FLAGS as it is.
    compile_cache: the directory where every role the launchers start keeps the programs XLA
      compiled (JAX's persistent compilation cache), so that a restarted searcher or trainer, a
      resumed run and the next run of the same experiment load them instead of compiling again.
      "auto" = $JAX_COMPILATION_CACHE_DIR when set, else $TBAJAX_CACHE/xla (~/.cache/tbajax/xla);
      a path or a bucket URL; None = off (an inherited $JAX_COMPILATION_CACHE_DIR too). A role
      started by hand uses $JAX_COMPILATION_CACHE_DIR.
    wandb: also log every role's metrics to Weights & Biases (see WandbSpec); None = off.
    """

    mode: Literal["async", "sync"] = "async"
    num_searchers: int = 1
    sync_every: int = 1
    publish_dtype: Literal["float32", "bfloat16"] = "float32"
    keep_param_versions: int = 3
    trainer_mesh: MeshConfig = MeshConfig()
    searcher_mesh: MeshConfig = MeshConfig()
    devices: Literal["shared", "split"] = "shared"
    trainer_devices: int = 1
    devices_per_searcher: int = 1
    memory_fraction: float | None = None
    max_searcher_restarts: int = 3
    max_trainer_restarts: int = 0
    restart_window_s: float = 3600.0
    restart_backoff_s: float = 2.0
    stall_timeout_s: float | None = 3600.0
    stop_grace_s: float = 60.0
    ray: RaySpec = RaySpec()
    publish: Literal["auto", "full", "adapters"] = "auto"
    trainer_processes: int = 1
    cpu_devices_per_trainer_process: int | None = None
    cpu_devices_per_searcher: int | None = None
    compile_cache: str | None = "auto"
    wandb: WandbSpec | None = None


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """Greedy held-out accuracy every `every` trainer steps (0 = start and end only).

    mode: who evaluates. "inline": the trainer, between updates (training waits for it; nothing
      else to run: right for tiny runs, where a second model process costs more than it saves).
      "process": the evaluator role, a separate process (`--role=evaluator`, started and
      supervised by the launcher beside the searchers) that loads the params the trainer
      publishes, and pins, at every eval step, and evaluates them while training goes on; its
      records (role "evaluator") name the step and version they evaluated. Sync mode (one
      process) always evaluates inline and says so in its log.
    wait_timeout_s: "process" mode: after its last step the trainer waits for the evaluator to
      finish the final evaluation before writing summary.json; it gives up (and says so in the
      log and the summary) once the evaluator has written no new result for this long.
    """

    every: int = 0
    num_problems: int = 200
    max_new_tokens: int | None = None  # None = rollout.sampling.max_new_tokens
    batch_size: int = 64
    mode: Literal["inline", "process"] = "inline"
    wait_timeout_s: float = 900.0


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    name: str
    description: str = ""
    seed: int = 0
    model: ModelSpec = ModelSpec()
    task: TaskSpec = TaskSpec()
    rollout: RolloutSpec = RolloutSpec()
    train: TrainSpec = TrainSpec()
    buffer: BufferConfig = BufferConfig()
    system: SystemSpec = SystemSpec()
    eval: EvalSpec = EvalSpec()

    def __post_init__(self) -> None:
        k = self.buffer.samples_per_group
        if self.rollout.sampling.num_samples < k:
            raise ConfigError(
                f"rollout.sampling.num_samples={self.rollout.sampling.num_samples} samples per prompt "
                f"cannot fill groups of buffer.samples_per_group={k}"
            )
        t_sample, t_train = self.rollout.sampling.temperature, self.train.trainer.temperature
        if self.rollout.random_temperature is not None and not self.train.exploration_temperature:
            raise ConfigError("rollout.random_temperature samples at other temperatures than the trainer "
                              "scores: set train.exploration_temperature=true (TB only needs full support)")
        if t_sample > 0 and t_sample != t_train and not self.train.exploration_temperature:
            raise ConfigError(
                f"train.trainer.temperature={t_train} must equal rollout.sampling.temperature={t_sample}: "
                "TBA scores trajectories under the distribution they were sampled from (set "
                "train.exploration_temperature=true to sample hotter only to explore, for TB)"
            )
        trainer = self.train.trainer
        if self.rollout.reference_logprobs == trainer.compute_reference_logprobs and not (
            not trainer.compute_reference_logprobs and self._objective_reads_no_reference()
        ):
            raise ConfigError(
                "exactly one side must compute reference log-probs: set rollout.reference_logprobs=true "
                "with train.trainer.compute_reference_logprobs=false (searchers score the initial "
                "policy), or the reverse (the trainer scores its reference in the step); neither side "
                "only for an objective that reads no reference log-probs"
            )
        if self.system.publish == "adapters" and self.model.lora is None:
            raise ConfigError(
                "system.publish='adapters' publishes LoRA adapters, but model.lora is null (full "
                "fine-tuning): set model.lora (e.g. model.lora.rank=8) or system.publish=auto"
            )
        if self.model.attention == "cudnn":
            for key, dtype in (("model.dtype", self.model.dtype),
                               ("train.trainer.compute_dtype", self.train.trainer.compute_dtype)):
                if dtype not in ("bfloat16", "float16"):
                    raise ConfigError(
                        f"model.attention=cudnn computes in bfloat16 or float16, and {key}={dtype}: set "
                        f"{key}=bfloat16 (on an NVIDIA GPU) or keep model.attention=xla")
        self._check_ranges()
        r = self.rollout
        if r.engine == "continuous" and r.decode_slots < r.sampling.num_samples:
            raise ConfigError(
                f"rollout.decode_slots={r.decode_slots} cannot hold one prompt's "
                f"rollout.sampling.num_samples={r.sampling.num_samples} samples: raise rollout.decode_slots"
            )
        mesh = self.system.searcher_mesh
        fsdp = 1 if r.fsdp_weights == "tensor" else mesh.fsdp  # fsdp_as_tensor: batch over data only
        shards = mesh.data * fsdp if mesh.data > 0 and fsdp > 0 else 0  # 0: known at run time
        if (r.engine == "continuous" and r.share_prompt_cache and r.sampling.num_samples > 1 and shards
                and r.decode_slots < r.sampling.num_samples * shards):
            # the engine checks it too, once the searcher's mesh is made (data=-1: all its devices)
            raise ConfigError(
                f"rollout.decode_slots={r.decode_slots} over the searcher's {shards} batch shards gives each "
                f"{r.decode_slots // shards} slots, and a shared prompt cache decodes a prompt's "
                f"{r.sampling.num_samples} samples on one shard: raise rollout.decode_slots to at least "
                f"{r.sampling.num_samples * shards} or set rollout.share_prompt_cache=false"
            )
        self._check_recency_supply()
        self._check_trainer_processes()
        if (self.train.groups_per_step * k) % self.train.trainer.num_microbatches:
            raise ConfigError(
                f"{self.train.groups_per_step} groups x K={k} rows do not split into "
                f"train.trainer.num_microbatches={self.train.trainer.num_microbatches} equal micro-batches"
            )

    def _objective_reads_no_reference(self) -> bool:
        """True when `train.objective` (with its options) declares it reads no reference log-probs
        (e.g. red-teaming's TB_NO_REFERENCE, rloo without its KL term): then neither side needs to
        compute them, and the trainer keeps no reference copy. An objective that does not resolve
        counts as reading them (the trainer reports why it does not resolve when it starts)."""
        from tbajax.objectives import resolve_objective  # jax-heavy: only for this corner case

        try:
            spec, cfg = resolve_objective(self.train.objective, overrides=dict(self.train.objective_options))
        except Exception:  # noqa: BLE001 - the caller raises its own clear error
            return False
        return not spec.inputs_for(cfg).reference_logprobs

    def _check_ranges(self) -> None:
        """Every numeric field of the top-level specs in its range, named by its full key: a
        `train.checkpoint_every=0` found here costs nothing, found after a step it costs a run."""
        for key, (lo, lo_open), optional in _RANGES:
            value: Any = self
            for part in key.split("."):
                value = getattr(value, part)
            if value is None and optional:
                continue
            if value is None or (value <= lo if lo_open else value < lo) or value != value:  # NaN too
                bound = f"> {lo:g}" if lo_open else f">= {lo:g}"
                raise ConfigError(f"{key}={value!r} must be {bound}{' (or null)' if optional else ''}")
        if self.system.memory_fraction is not None and self.system.memory_fraction > 1:
            raise ConfigError(f"system.memory_fraction={self.system.memory_fraction} must be in (0, 1]")
        chunk = self.model.head_chunk_tokens
        if isinstance(chunk, int) and chunk < 1:
            raise ConfigError(f"model.head_chunk_tokens={chunk} must be >= 1 tokens "
                              "(or 'auto', or null: never chunk)")

    def _check_trainer_processes(self) -> None:
        s = self.system
        if s.trainer_processes == 1:
            return
        if s.mode == "sync":
            raise ConfigError(
                f"system.trainer_processes={s.trainer_processes} needs system.mode=async: in sync mode the "
                "trainer generates its own batches, and generation runs in one process (run async, or one "
                "trainer process on more devices)")
        if s.devices == "split" and s.trainer_devices % s.trainer_processes:
            raise ConfigError(
                f"system.trainer_devices={s.trainer_devices} GPUs do not split evenly over "
                f"system.trainer_processes={s.trainer_processes} processes")

    def _check_recency_supply(self) -> None:
        """Refuse a configuration that deadlocks: a trainer that waits for unused recent groups,
        and searchers that stop after max_calls_per_version calls until the next sync."""
        b, r, s = self.buffer, self.rollout, self.system
        if not (s.mode == "async" and b.mode == "replay" and b.max_recent_uses is not None
                and b.recency_fallback == "wait" and b.recency_prob > 0 and r.max_calls_per_version is not None):
            return
        needed = s.sync_every * self.train.groups_per_step * b.recency_prob
        supplied = s.num_searchers * r.max_calls_per_version * r.prompts_per_call * b.max_recent_uses
        if needed > supplied:
            raise ConfigError(
                f"between two syncs the trainer wants ~{needed:.0f} recent groups (system.sync_every="
                f"{s.sync_every} x train.groups_per_step={self.train.groups_per_step} x buffer.recency_prob="
                f"{b.recency_prob}) but the searchers make at most {supplied} (num_searchers x "
                f"rollout.max_calls_per_version x rollout.prompts_per_call x buffer.max_recent_uses) and then "
                "wait for new params, while buffer.recency_fallback='wait' makes the trainer wait for them: "
                "raise rollout.max_calls_per_version (or set it to null), raise buffer.max_recent_uses (or "
                "null), or set buffer.recency_fallback=reward"
            )

    # ------------------------------------------------------------------ (de)serialisation

    def to_dict(self) -> dict[str, Any]:
        return to_jsonable(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ExperimentConfig:
        return from_jsonable(cls, d, "")

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


# (key, (lower bound, bound excluded), None allowed): the numeric ranges `_check_ranges` enforces
_RANGES: tuple[tuple[str, tuple[float, bool], bool], ...] = (
    ("rollout.prompts_per_call", (1, False), False),
    ("rollout.max_prompt_tokens", (1, False), False),
    ("rollout.reward_workers", (0, False), False),
    ("rollout.reward_timeout_s", (0, True), False),
    ("rollout.max_calls_per_version", (1, False), True),
    ("rollout.fail_fast_grades", (1, False), False),
    ("rollout.decode_slots", (1, False), False),
    ("rollout.decode_chunk", (1, False), False),
    ("rollout.ring_tiers", (1, False), False),
    ("train.steps", (1, False), False),
    ("train.groups_per_step", (1, False), False),
    ("train.length_bucket", (1, False), False),
    ("train.checkpoint_every", (1, False), False),
    ("train.keep_checkpoints", (1, False), False),
    ("train.log_every", (1, False), False),
    ("system.num_searchers", (1, False), False),
    ("system.sync_every", (1, False), False),
    ("system.keep_param_versions", (1, False), False),
    ("system.trainer_devices", (1, False), False),
    ("system.devices_per_searcher", (1, False), False),
    ("system.memory_fraction", (0, True), True),
    ("system.max_searcher_restarts", (0, False), False),
    ("system.max_trainer_restarts", (0, False), False),
    ("system.restart_window_s", (0, True), False),
    ("system.restart_backoff_s", (0, False), False),
    ("system.stall_timeout_s", (0, True), True),
    ("system.stop_grace_s", (0, False), False),
    ("system.trainer_processes", (1, False), False),
    ("system.cpu_devices_per_trainer_process", (1, False), True),
    ("system.cpu_devices_per_searcher", (1, False), True),
    ("system.ray.trainer_cpus", (0, False), False),
    ("system.ray.trainer_gpus", (0, False), False),
    ("system.ray.searcher_cpus", (0, False), False),
    ("system.ray.searcher_gpus", (0, False), False),
    ("eval.every", (0, False), False),
    ("eval.num_problems", (1, False), False),
    ("eval.max_new_tokens", (1, False), True),
    ("eval.batch_size", (1, False), False),
    ("eval.wait_timeout_s", (0, True), False),
)

# Keys `--resume` may change: how long to train and how often to evaluate, checkpoint and log,
# schedule lengths, supervision budgets. None of them changes what a checkpoint or a stored row
# means; anything else would (a different model, task, objective, batch shape, buffer policy).
RESUME_SAFE_KEYS: tuple[str, ...] = (
    "description",
    "train.steps",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.log_every",
    "train.pipeline",  # the same updates either way: only whether host and device overlap
    # the same updates with less device memory (after an out-of-memory error): exact gradient
    # accumulation, recomputed activations, the vocabulary projection a chunk of tokens at a time
    "train.trainer.num_microbatches",
    "model.remat",
    "model.head_chunk_tokens",
    # how many sequences a searcher decodes at once and each process's share of a shared device:
    # the same samples' distribution, the same stored rows (a resumed searcher continues its prompt
    # stream where its committed rows end)
    "rollout.prompts_per_call",
    "rollout.decode_slots",
    "rollout.prompt_pool",
    "rollout.ring_tiers",
    "rollout.fsdp_weights",
    "system.memory_fraction",
    "train.trainer.optimizer.lr.warmup_steps",
    "train.trainer.optimizer.lr.stable_steps",
    "train.trainer.optimizer.lr.decay_steps",
    "train.trainer.beta.decay_steps",
    "train.trainer.beta.stop_step",
    "eval.every",
    "eval.num_problems",
    "eval.batch_size",
    "eval.max_new_tokens",
    "eval.wait_timeout_s",
    "system.max_searcher_restarts",
    "system.max_trainer_restarts",
    "system.restart_window_s",
    "system.restart_backoff_s",
    "system.stall_timeout_s",
    "system.stop_grace_s",
    "system.compile_cache",  # where compiled programs are kept, not what they compute
    "system.ray",  # a section: every key under it (placement only, e.g. on another cluster)
    "system.wandb",  # where metrics are also logged
)


def config_differences(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two `to_dict()` trees (a sub-tree that exists on
    one side only counts as one key)."""
    out = []
    for key in sorted(set(old) | set(new)):
        where = _join(prefix, key)
        a, b = old.get(key, _MISSING), new.get(key, _MISSING)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out.extend(config_differences(a, b, where))
        elif a != b:
            out.append(where)
    return out


def check_resume_changes(stored: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """The keys `--resume` changes, all of them safe; ConfigError listing the unsafe ones."""
    changed = config_differences(stored, new)
    unsafe = [k for k in changed if not any(k == s or k.startswith(s + ".") for s in RESUME_SAFE_KEYS)]
    if unsafe:
        shown = ", ".join(f"{k} ({_get(stored, k)!r} -> {_get(new, k)!r})" for k in unsafe[:8])
        more = f" and {len(unsafe) - 8} more" if len(unsafe) > 8 else ""
        raise ConfigError(
            f"--resume: the configuration differs from the stored one in {shown}{more}; these cannot "
            "change on resume (only " + ", ".join(RESUME_SAFE_KEYS[1:]) + " can). Resume with the same "
            "experiment and overrides, or start a new --run-dir"
        )
    return changed


_MISSING = object()


def _get(tree: Mapping[str, Any], key: str) -> Any:
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return "(absent)"
        node = node[part]
    return node


# ---------------------------------------------------------------------------- generic machinery


def to_jsonable(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: to_jsonable(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, Mapping):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return [to_jsonable(v) for v in x]
    return x


def from_jsonable(tp: Any, value: Any, where: str) -> Any:
    """Rebuild a value of type `tp` from JSON data, validating as it goes."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where or 'config'}: expected a mapping, got {value!r}")
        hints = typing.get_type_hints(tp)
        names = [f.name for f in dataclasses.fields(tp)]
        unknown = [k for k in value if k not in names]
        if unknown:
            raise ConfigError(_unknown_key_message(where, unknown[0], names))
        kwargs = {k: from_jsonable(hints[k], v, _join(where, k)) for k, v in value.items()}
        try:
            return tp(**kwargs)
        except ConfigError:
            raise  # already names its keys
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where or 'config'}: {e}") from None
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return from_jsonable(a, value, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: {value!r} is not valid")
    if origin is Literal:
        if value is None and "none" in args:  # `--set model.remat=none` parses as YAML null
            return "none"
        if value not in args:
            raise ConfigError(f"{where}={value!r}; choose one of {list(args)}")
        return value
    if origin in (tuple, Sequence) or tp is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        return tuple(from_jsonable(inner, v, where) for v in value)
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return int(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _unknown_key_message(where: str, key: str, names: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, names, n=1)
    hint = f" Did you mean {_join(where, close[0])!r}?" if close else ""
    return f"unknown config key {_join(where, key)!r}.{hint} Valid keys here: {', '.join(names)}"


def parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        lowered = {"true": True, "false": False, "none": None, "null": None}
        return lowered.get(text.strip().lower(), text)


def apply_overrides(config: ExperimentConfig, overrides: Sequence[str]) -> ExperimentConfig:
    """Apply `a.b.c=value` overrides (validated against the dataclass types)."""
    data = config.to_dict()
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. train.steps=100)")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        node: Any = data
        tp: Any = ExperimentConfig
        for i, part in enumerate(parts):
            where = ".".join(parts[:i])
            is_last = i == len(parts) - 1
            if dataclasses.is_dataclass(tp):
                names = [f.name for f in dataclasses.fields(tp)]
                if part not in names:
                    raise ConfigError(_unknown_key_message(where, part, names))
                tp = _unwrap_optional(typing.get_type_hints(tp)[part])
            elif isinstance(node, Mapping):
                tp = Any  # free-form options dicts: any key
            else:
                raise ConfigError(f"{where} is a value, not a section; cannot set {key!r}")
            if is_last:
                node[part] = parse_value(text)
            else:
                if node.get(part) is None:
                    node[part] = {}
                node = node[part]
    return ExperimentConfig.from_dict(data)


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        non_none = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(non_none) == 1:
            return non_none[0]
    return tp


def describe_fields(tp: Any = ExperimentConfig, prefix: str = "") -> list[str]:
    """Every settable key with its type, for --help."""
    out = []
    hints = typing.get_type_hints(tp)
    for f in dataclasses.fields(tp):
        t = _unwrap_optional(hints[f.name])
        key = _join(prefix, f.name)
        if dataclasses.is_dataclass(t):
            out.extend(describe_fields(t, key))
        else:
            out.append(f"{key}: {_type_name(hints[f.name])}")
    return out


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))
