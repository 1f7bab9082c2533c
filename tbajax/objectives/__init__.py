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

from tbajax._lazy import lazy_exports

_EXPORTS = {  # public name -> the submodule that defines it (configs and the registry import no jax)
    "DEFAULT_OBJECTIVE": "registry",
    "DrGRPOConfig": "configs",
    "GRPOConfig": "configs",
    "Groups": "common",
    "IcePopConfig": "configs",
    "LearnedLogZConfig": "configs",
    "LogZHeadConfig": "configs",
    "Max": "base",
    "Metrics": "base",
    "Min": "base",
    "OBJECTIVES": "registry",
    "Objective": "base",
    "ObjectiveInputs": "registry",
    "ObjectiveSpec": "registry",
    "OnlineDPOConfig": "configs",
    "RLOOConfig": "configs",
    "Ratio": "base",
    "ReinforceConfig": "configs",
    "SeqSums": "common",
    "TBAPrimeConfig": "configs",
    "TBAPrimePaperConfig": "configs",
    "TBConfig": "configs",
    "aux_for_loss": "registry",
    "combine_metrics": "base",
    "diagnostics": "common",
    "dr_grpo": "policy_gradient",
    "gather_aux": "registry",
    "get_objective": "registry",
    "groups_of": "common",
    "grpo": "policy_gradient",
    "icepop": "policy_gradient",
    "init_log_z_head": "tb",
    "init_log_z_table": "tb",
    "length_normaliser": "common",
    "log_z_from_head": "tb",
    "metric_values": "base",
    "online_dpo": "dpo",
    "reinforce": "policy_gradient",
    "resolve_objective": "registry",
    "rloo": "policy_gradient",
    "row_mean": "common",
    "seq_sum": "common",
    "seq_sums": "common",
    "stale_tokens": "common",
    "tb": "tb",
    "tb_learned_logz": "tb",
    "tb_logz_head": "tb",
    "tba_prime": "policy_gradient",
    "token_lag": "common",
    "token_mask": "common",
    "validate_batch": "validate",
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
