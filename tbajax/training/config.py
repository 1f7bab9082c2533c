"""Frozen configs of the trainer: optimizer, learning-rate and β schedules, precision, accumulation.

Every field is static under jit (the configs are hashable), so changing one means a new compile,
never a silent retrace with stale values.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

LRKind = Literal["constant", "linear", "cosine", "wsd"]
DecayShape = Literal["cosine", "linear"]
_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class LRSchedule:
    """Learning rate as a function of the number of updates already applied (0-based, like optax).

    Every kind is one warmup-stable-decay curve:
      warmup:  step < W                 lr = peak · step / W     (step 0 gets lr 0, as in optax / HF)
      stable:  W ≤ step < W + S         lr = peak
      decay:   W + S ≤ step < W + S + D lr = final + (peak − final) · shape((step − W − S) / D)
      after:                            lr = final = peak · final_fraction
    with shape(x) = 1 − x (linear) or (1 + cos πx) / 2 (cosine).
    constant = warmup then stable forever; linear / cosine = warmup then decay over `decay_steps`;
    wsd = all three phases (GSM8K: peak 1e-5, W 50, S 350, cosine D 600, training stops at 700).
    """

    kind: LRKind = "constant"
    peak: float = 1e-5
    warmup_steps: int = 0
    stable_steps: int = 0
    decay_steps: int = 0
    decay_shape: DecayShape = "cosine"
    final_fraction: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("constant", "linear", "cosine", "wsd"):
            raise ValueError(f"LRSchedule.kind={self.kind!r}; choose constant, linear, cosine or wsd")
        if self.decay_shape not in ("cosine", "linear"):
            raise ValueError(f"decay_shape={self.decay_shape!r}; choose 'cosine' or 'linear'")
        if self.peak < 0 or self.warmup_steps < 0 or self.stable_steps < 0 or self.decay_steps < 0:
            raise ValueError(f"learning rate and phase lengths must be >= 0, got {self}")
        if not 0.0 <= self.final_fraction <= 1.0:
            raise ValueError(f"final_fraction must be in [0, 1], got {self.final_fraction}")
        if self.kind == "constant" and (self.stable_steps or self.decay_steps):
            raise ValueError("a constant schedule has no stable/decay phase; use kind='wsd' to decay")
        if self.kind in ("linear", "cosine"):
            if self.decay_steps <= 0:
                raise ValueError(f"a {self.kind} schedule needs decay_steps > 0 (the decay length)")
            if self.stable_steps:
                raise ValueError(f"a {self.kind} schedule has no stable phase; use kind='wsd'")
        if self.kind == "wsd" and self.decay_steps <= 0:
            raise ValueError("a wsd schedule needs decay_steps > 0")

    @property
    def shape(self) -> DecayShape:
        """The decay curve actually used (linear/cosine kinds fix it)."""
        if self.kind in ("linear", "cosine"):
            return self.kind  # type: ignore[return-value]
        return self.decay_shape


@dataclasses.dataclass(frozen=True)
class BetaSchedule:
    """KL coefficient β(u) at update u = 1, 2, ... (TBA spec §3).

    linear: β(u) = start + (final − start) · (u − 1) / decay_steps for u < stop_step, else final
    (stop_step defaults to decay_steps; GSM8K: 0.014 → 0.004, decay_steps = stop_step = 500).
    constant: β(u) = start (TBA′: 0.005).
    """

    kind: Literal["constant", "linear"] = "constant"
    start: float = 0.005
    final: float | None = None
    decay_steps: int = 0
    stop_step: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("constant", "linear"):
            raise ValueError(f"BetaSchedule.kind={self.kind!r}; choose 'constant' or 'linear'")
        if self.kind == "linear":
            if self.final is None or self.decay_steps <= 0:
                raise ValueError("a linear β schedule needs `final` and decay_steps > 0")
            if self.stop_step is not None and self.stop_step < 1:
                raise ValueError(f"stop_step must be >= 1, got {self.stop_step}")
        elif self.final not in (None, self.start) or self.decay_steps or self.stop_step is not None:
            raise ValueError("a constant β schedule takes only `start`; use kind='linear' to decay")

    @property
    def stop(self) -> int:
        return self.decay_steps if self.stop_step is None else self.stop_step


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW (decoupled weight decay on every parameter, like torch.optim.AdamW over
    model.parameters()) with optional global-norm clipping (None = off; TBA′ uses 1.0)."""

    lr: LRSchedule = LRSchedule()
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = None

    def __post_init__(self) -> None:
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
            raise ValueError(f"Adam betas must be in [0, 1), got b1={self.b1}, b2={self.b2}")
        if self.eps <= 0 or self.weight_decay < 0:
            raise ValueError(f"eps must be > 0 and weight_decay >= 0, got {self.eps}, {self.weight_decay}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}")


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """What one trainer step does.

    temperature: the *sampling* temperature; log-probs of policy and reference are taken from
      logits / temperature, the distribution the trajectories were drawn from.
    beta: schedule written into `batch.beta` inside the step from the state's step counter;
      None keeps the β the batch carries.
    num_microbatches: the batch is cut into this many equal contiguous slices, processed one after
      another (lax.scan) with gradients of the loss sums accumulated: the update equals the one of
      the whole batch. A group must not straddle two slices (checked inside the step).
    compute_reference_logprobs: score the batch under the reference params in the step (stop-grad);
      False takes `batch.reference_logprobs` as given and keeps no reference params.
    reference_reset_every: ρ; after every ρ-th update the reference becomes a copy of the policy
      (TBA′: 50), also re-initialising the Adam moments when `reset_optimizer_on_reference_reset`.
    param_dtype / compute_dtype: master weights and optimizer state in param_dtype, forward and
      backward in compute_dtype (default fp32 master + bf16 compute; "float32" twice = pure fp32).
    aux_table_size: for objectives with per-prompt trainable params (`tb_learned_logz`), the
      number of distinct prompt ids, i.e. the largest `batch.prompt_id` + 1 (ids index the table
      directly; a batch with an id outside [0, size) is refused on the host). The table and its
      Adam state are dense and replicated on every device: 16 bytes per entry, fine up to a few
      million ids (a 1e6-problem generated task costs 16 MB). Unused by other objectives.
    pack_groups: score each group as one packed row (its prompt once, then its K responses, each
      attending to the prompt and itself; `tbajax.batch.PackedGroups`). Same log-probs, K times
      less prompt work; worth it when prompts are long next to the responses (a packed row is
      P + K·R tokens long, and attention is quadratic in that). Batches need `collate(...,
      pack_microbatches=num_microbatches)`.
    pack_strided: with pack_groups, lay each group out at fixed strides (the prompt in P slots,
      each response in R: the batch's longest, bucketed) and run attention per response over the
      prompt and itself (`layers.StridedGroups`): the prompt still runs once per group, and
      attention costs what the row layout's does, for long responses too. Responses shorter
      than R leave padding slots. Batches need `collate(..., pack_strided=True)`.
      pack_groups="auto" instead picks one of the three layouts (rows, packed, strided) per batch:
      the one of least estimated cost (`training.layout`), among those the objective can take (an
      objective that reads prompt features takes rows only); the step compiles one program per
      layout it meets. pack_strided must then be False.
    layout_attention_weight: with pack_groups="auto", how much an attention FLOP costs next to a
      weight-product FLOP (`layout.step_cost`). With 2.0 the estimate picks the layout that ran
      fastest at each of the three shapes `experiments/benchmarks/packed_groups.py` timed on 2 CPU
      cores (`packed_groups_*_shape.json`); so does any weight from 1 to 6 (`tests/test_layout.py`).
      Not measured on a GPU.
    router_aux_loss_coef: for a mixture-of-experts policy, the weight of the router's
      load-balancing loss added to the objective's (`moe.load_balancing_loss`, transformers'
      `load_balancing_loss_func` over every real token the forward runs: a packed group's prompt
      once). None = as the checkpoint's config says, as transformers and TRL add it: its
      router_aux_loss_coef where output_router_logits is true, else none; 0 = none. Logged as
      `router_aux_loss` whenever it is added. A value > 0 for a model without experts is an error.
    """

    optimizer: OptimizerConfig = OptimizerConfig()
    beta: BetaSchedule | None = None
    temperature: float = 1.0
    num_microbatches: int = 1
    compute_reference_logprobs: bool = True
    reference_reset_every: int | None = None
    reset_optimizer_on_reference_reset: bool = False
    param_dtype: str = "float32"
    compute_dtype: str = "bfloat16"
    seed: int = 0
    aux_table_size: int = 0
    pack_groups: bool | Literal["auto"] = False
    pack_strided: bool = False
    layout_attention_weight: float = 2.0
    router_aux_loss_coef: float | None = None

    def __post_init__(self) -> None:
        if self.router_aux_loss_coef is not None and self.router_aux_loss_coef < 0:
            raise ValueError(f"router_aux_loss_coef must be >= 0 or None, got {self.router_aux_loss_coef}")
        if self.pack_groups not in (True, False, "auto"):
            raise ValueError(f"pack_groups={self.pack_groups!r}; choose true, false or 'auto'")
        if self.pack_strided and self.pack_groups == "auto":
            raise ValueError("pack_groups='auto' chooses the strided layout itself per batch: "
                             "leave pack_strided=false")
        if self.pack_strided and not self.pack_groups:
            raise ValueError("pack_strided lays out packed groups: set pack_groups=True too")
        if self.layout_attention_weight <= 0:
            raise ValueError(f"layout_attention_weight must be > 0, got {self.layout_attention_weight}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        if self.reference_reset_every is not None:
            if self.reference_reset_every < 1:
                raise ValueError(
                    f"reference_reset_every must be >= 1 or None, got {self.reference_reset_every}"
                )
            if not self.compute_reference_logprobs:
                raise ValueError(
                    "reference_reset_every needs compute_reference_logprobs=True: with reference "
                    "log-probs taken from the batch the trainer holds no reference to reset"
                )
        if self.aux_table_size < 0:
            raise ValueError(f"aux_table_size must be >= 0, got {self.aux_table_size}")
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"{name}={getattr(self, name)!r}; choose one of {_DTYPES}")
