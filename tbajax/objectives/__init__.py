"""Training objectives as pure, jit-able functions: `fn(batch, logprobs, config) -> (loss, metrics)`.

Built-ins (`OBJECTIVES`): tb (default; VarGrad trajectory balance), tb_learned_logz (a log Z table),
tb_logz_head (log Z from a linear head on the pooled prompt state), tba_prime,
tba_prime_paper (TBA′ with the paper's KL centring), dr_grpo, grpo, rloo, reinforce, online_dpo,
icepop. Each has a frozen config dataclass with
defaults; the trainer builds one from a name plus an overrides dict:

    spec = get_objective("tba_prime")
    config = spec.make_config({"length_norm": "constant", "norm_constant": 4096})
    validate_batch(host_batch, spec)           # eagerly, on the host, outside jit
    loss, metrics = spec(batch, logprobs, config)
    loss.value                                  # Ratio: sum over micro-batches before dividing

Your own objective is a function with the same signature, in your own file, for example:

    # my_project/losses.py
    import dataclasses, jax
    from tbajax.objectives import diagnostics, groups_of, row_mean, seq_sums

    @dataclasses.dataclass(frozen=True)
    class MyConfig:
        scale: float = 1.0

    def my_loss(batch, logprobs, config: MyConfig):
        g = groups_of(batch, logprobs.dtype)
        s = seq_sums(batch, logprobs)
        adv = g.centered(batch.reward) * config.scale             # r − group mean
        loss = row_mean(g, -jax.lax.stop_gradient(adv) * s.policy)  # mean over real rows
        return loss, {**diagnostics(batch, logprobs), "loss": loss}

and pass its path, "my_project/losses.py:my_loss" (or "my_project.losses:my_loss" when the module
is importable; both fit in config.json), or the function itself: `get_objective(my_loss)`. The
config class is taken from the annotation of the third parameter (no annotation: config=None);
`ObjectiveSpec(loss=..., config_cls=..., init_aux=..., inputs=...)` spells everything out.
Per-token param versions reach every objective as `batch.token_versions` and the trainer's
`batch.current_version`; `token_lag(batch)` / `stale_tokens(batch, max_lag)` read them (the
built-in policy-gradient objectives' `stale_token_*` options use these).
Objectives with trainable extras (a learned log Z) declare `init_aux`; objectives that never read
the reference log-probs declare `inputs=ObjectiveInputs(reference_logprobs=False)` and the
trainer skips the reference forward for them (a bare function is assumed to read everything).
"""

from tbajax.objectives.base import Max, Metrics, Min, Objective, Ratio, combine_metrics, metric_values
from tbajax.objectives.common import (
    Groups,
    SeqSums,
    diagnostics,
    groups_of,
    length_normaliser,
    row_mean,
    seq_sum,
    seq_sums,
    stale_tokens,
    token_lag,
    token_mask,
)
from tbajax.objectives.dpo import OnlineDPOConfig, online_dpo
from tbajax.objectives.policy_gradient import (
    DrGRPOConfig,
    GRPOConfig,
    IcePopConfig,
    ReinforceConfig,
    RLOOConfig,
    TBAPrimeConfig,
    TBAPrimePaperConfig,
    dr_grpo,
    grpo,
    icepop,
    reinforce,
    rloo,
    tba_prime,
)
from tbajax.objectives.registry import (
    DEFAULT_OBJECTIVE,
    OBJECTIVES,
    ObjectiveInputs,
    ObjectiveSpec,
    aux_for_loss,
    gather_aux,
    get_objective,
    resolve_objective,
)
from tbajax.objectives.tb import (
    LearnedLogZConfig,
    LogZHeadConfig,
    TBConfig,
    init_log_z_head,
    init_log_z_table,
    log_z_from_head,
    tb,
    tb_learned_logz,
    tb_logz_head,
)
from tbajax.objectives.validate import validate_batch

__all__ = [
    "DEFAULT_OBJECTIVE",
    "OBJECTIVES",
    "DrGRPOConfig",
    "GRPOConfig",
    "Groups",
    "IcePopConfig",
    "LearnedLogZConfig",
    "LogZHeadConfig",
    "Max",
    "Metrics",
    "Min",
    "Objective",
    "ObjectiveInputs",
    "ObjectiveSpec",
    "OnlineDPOConfig",
    "RLOOConfig",
    "Ratio",
    "ReinforceConfig",
    "SeqSums",
    "TBAPrimeConfig",
    "TBAPrimePaperConfig",
    "TBConfig",
    "combine_metrics",
    "diagnostics",
    "dr_grpo",
    "aux_for_loss",
    "gather_aux",
    "get_objective",
    "groups_of",
    "grpo",
    "icepop",
    "init_log_z_head",
    "init_log_z_table",
    "log_z_from_head",
    "length_normaliser",
    "metric_values",
    "online_dpo",
    "reinforce",
    "resolve_objective",
    "rloo",
    "row_mean",
    "seq_sum",
    "seq_sums",
    "stale_tokens",
    "tb",
    "tb_learned_logz",
    "tb_logz_head",
    "tba_prime",
    "token_lag",
    "token_mask",
    "validate_batch",
]
