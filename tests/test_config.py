"""Experiment configs: overrides are typed and validated, unknown keys are errors, JSON round trips."""

import json

import pytest

from tbajax.config import ConfigError, ExperimentConfig, apply_overrides, describe_fields
from tbajax.main import list_experiments, load_experiment


def test_every_shipped_experiment_resolves_and_round_trips():
    names = list_experiments()
    assert "tiny_arithmetic" in names
    for name in names:
        cfg = load_experiment(name)
        assert ExperimentConfig.from_dict(json.loads(cfg.to_json())) == cfg


def test_overrides_are_typed():
    cfg = load_experiment("tiny_arithmetic")
    out = apply_overrides(
        cfg,
        [
            "train.steps=7",
            "train.trainer.optimizer.lr.peak=3e-4",
            "train.objective=dr_grpo",
            "system.mode=sync",
            "rollout.sampling.stop_token_ids=[2, 5]",
            "task.options.digits=2",
            "train.trainer.optimizer.max_grad_norm=null",
            "model.remat=none",  # YAML reads `none` as null; the literal "none" is meant
            "model.scan_layers=false",
        ],
    )
    assert out.model.scan_layers is False and cfg.model.scan_layers == "auto"
    assert apply_overrides(cfg, ["model.scan_layers=true"]).model.scan_layers is True
    assert apply_overrides(cfg, ["rollout.share_prompt_cache=false"]).rollout.share_prompt_cache is False
    assert apply_overrides(cfg, ["rollout.prompt_pool=6"]).rollout.prompt_pool == 6
    with pytest.raises(ConfigError, match="prompt_pool=0"):
        apply_overrides(cfg, ["rollout.prompt_pool=0"])
    tiered = apply_overrides(cfg, ["rollout.engine=continuous", "rollout.ring_tiers=3"])
    assert tiered.rollout.ring_tiers == 3
    with pytest.raises(ConfigError, match="rollout.engine=continuous"):
        apply_overrides(cfg, ["rollout.ring_tiers=3"])  # the static engine has no slots to split
    with pytest.raises(ConfigError, match="ring_tiers"):
        apply_overrides(cfg, ["rollout.engine=continuous", "rollout.ring_tiers=0"])
    # a prompt pool's K samples decode on one of the searcher mesh's batch shards: K slots each
    k = cfg.rollout.sampling.num_samples
    sharded = ["rollout.engine=continuous", f"rollout.decode_slots={4 * k}", "system.searcher_mesh.data=4"]
    assert apply_overrides(cfg, sharded).rollout.decode_slots == 4 * k
    with pytest.raises(ConfigError, match=f"raise rollout.decode_slots to at least {8 * k}"):
        apply_overrides(cfg, [*sharded, "system.searcher_mesh.data=8"])
    apply_overrides(cfg, [*sharded, "system.searcher_mesh.data=8", "rollout.share_prompt_cache=false"])
    # fsdp splits the batch too, unless the sampler takes the fsdp devices as tensor shards
    with pytest.raises(ConfigError, match=f"raise rollout.decode_slots to at least {8 * k}"):
        apply_overrides(cfg, [*sharded, "system.searcher_mesh.fsdp=2"])
    apply_overrides(cfg, [*sharded, "system.searcher_mesh.fsdp=2", "rollout.fsdp_weights=tensor"])
    with pytest.raises(ConfigError, match="fsdp_weights"):
        apply_overrides(cfg, ["rollout.fsdp_weights=gathered"])
    assert out.train.steps == 7 and isinstance(out.train.steps, int)
    assert out.train.trainer.optimizer.lr.peak == 3e-4
    assert out.train.objective == "dr_grpo" and out.system.mode == "sync"
    assert out.rollout.sampling.stop_token_ids == (2, 5)
    assert out.task.options == {"digits": 2}
    assert out.train.trainer.optimizer.max_grad_norm is None
    assert out.model.remat == "none"
    bf16 = ["model.dtype=bfloat16", "train.trainer.compute_dtype=bfloat16"]
    cudnn = apply_overrides(cfg, [*bf16, "model.attention=cudnn"]).model
    assert (cudnn.attention, cfg.model.attention) == ("cudnn", "xla")
    with pytest.raises(ConfigError, match="train.trainer.compute_dtype=float32"):
        apply_overrides(cfg, ["model.dtype=bfloat16", "model.attention=cudnn"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.stpes=3", r"unknown config key 'train.stpes'.*Did you mean 'train.steps'"),
        ("train.steps=three", "expected an integer"),
        ("system.mode=fast", r"choose one of \['async', 'sync'\]"),
        ("rollout.sampling.temperature=-1", "temperature must be >= 0"),
        ("train.steps", "not of the form key=value"),
        ("buffer.samples_per_group=16", "cannot fill groups"),
        ("buffer.max_recent_uses=0", "max_recent_uses must be None or >= 1"),
        ("rollout.first_decode_phase=-1", r"first_decode_phase=-1 must be >= 0"),
        # trainer waits for unused recent groups, searchers wait for params: refused up front
        ("system.sync_every=32", r"wants ~486 recent groups.*searchers make at most 32"),
        ("model.attention=flash", r"choose one of \['xla', 'cudnn'\]"),
        ("model.attention=cudnn", r"attention=cudnn computes in bfloat16 or float16, and model.dtype=float32"),
    ],
)
def test_bad_overrides_are_clear_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        apply_overrides(load_experiment("tiny_arithmetic"), [override])


def test_help_lists_fields():
    fields = describe_fields()
    assert "train.trainer.optimizer.lr.peak: float" in fields
    assert any(f.startswith("system.mode: 'async' | 'sync'") for f in fields)


def test_unknown_experiment():
    with pytest.raises(ConfigError, match="unknown experiment 'nope'; available: .*tiny_arithmetic"):
        load_experiment("nope")


def test_recency_supply_check_passes_when_either_side_gives_way():
    base = load_experiment("tiny_arithmetic")
    for extra in ("rollout.max_calls_per_version=null", "buffer.max_recent_uses=null", "buffer.recency_fallback=reward",
                  "system.num_searchers=16"):
        cfg = apply_overrides(base, ["system.sync_every=32", extra])
        assert cfg.system.sync_every == 32


def test_neither_side_computes_reference_logprobs_only_for_an_objective_that_reads_none():
    """Both rollout.reference_logprobs and compute_reference_logprobs false: allowed for an objective
    that declares it reads no reference (the trainer then keeps no reference copy), refused otherwise."""
    from tbajax.config import ConfigError, ExperimentConfig, RolloutSpec, apply_overrides
    from tbajax.sampling import SamplingConfig

    base = ExperimentConfig(name="x", rollout=RolloutSpec(sampling=SamplingConfig(num_samples=20)))
    off = ["train.trainer.compute_reference_logprobs=false"]
    with pytest.raises(ConfigError, match="exactly one side.*reads no reference"):
        apply_overrides(base, off)  # tb reads the reference log-probs
    for objective in ("tbajax.tasks.redteam:TB_NO_REFERENCE", "rloo", "dr_grpo"):
        cfg = apply_overrides(base, [*off, f"train.objective={objective}"])
        assert not cfg.train.trainer.compute_reference_logprobs and not cfg.rollout.reference_logprobs
    with pytest.raises(ConfigError, match="exactly one side"):  # rloo with its KL term reads it
        apply_overrides(base, [*off, "train.objective=rloo", 'train.objective_options={"kl_in_reward": true}'])


def test_reading_a_config_imports_no_jax():
    """The launcher, `--print-config` and bad-input errors read configs only: no jax, flax or
    transformers import (seconds of CPU per process on a small machine)."""
    import subprocess
    import sys
    from pathlib import Path

    probe = ("import sys; from tbajax.config import apply_overrides; from tbajax.main import load_experiment; "
             "c = apply_overrides(load_experiment('tiny_arithmetic'), ['model.lora.rank=4', 'system.trainer_mesh.data=1']); "
             "print(sorted(m for m in ('jax', 'flax', 'transformers', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr


def test_the_launchers_preflight_imports_no_jax_for_built_in_objectives():
    """Preflight (checkpoint headers, tokenizer, objective and its options, task) runs before any
    role starts, so every second of it delays the run: never jax, flax or ml_dtypes (the objective
    table defers its losses until called), and no transformers for a local tokenizer.json of the
    generic fast class (the `tokenizers` library parses it)."""
    import subprocess
    import sys
    from pathlib import Path

    probe = ("import sys; from tbajax.config import apply_overrides; from tbajax.main import load_experiment; "
             "from tbajax.system.launcher import preflight; "
             "c = apply_overrides(load_experiment('tiny_arithmetic'), ['train.objective=rloo', "
             "'train.objective_options={\"kl_in_reward\": true}']); preflight(c); "
             "print(sorted(m for m in ('jax', 'flax', 'ml_dtypes', 'torch', 'transformers') "
             "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
