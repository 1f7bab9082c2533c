"""`python -m tbajax.export`: a run's published policy as a Hugging Face checkpoint that torch
transformers loads with the logits of the params the run published (full weights, or LoRA
adapters merged into the base), with the run's tokenizer; and clear errors."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tbajax.config import apply_overrides
from tbajax.export import ExportError, export_policy, main, read_stored_policy
from tbajax.main import load_experiment
from tbajax.models import load_model
from tbajax.models.lora import adapter_arrays, adapter_manifest, init_lora, merge_lora
from tbajax.stores import ParamPublisher
from tbajax.stores.params import ParamVersionError
from tbajax.stores.urls import param_store_url
from tbajax.training import Checkpointer, init_train_state
from tests.conftest import logits_of

IDS = np.array([[1, 5, 9, 3, 11, 4, 7, 2]])
LORA = ["model.lora.rank=4", "model.lora.alpha=8", 'model.lora.targets=["q_proj","v_proj","down_proj"]']


def make_run(run_dir, *overrides: str):
    """A run directory as `python -m tbajax.main` leaves one (config.json, run_id), of the default
    experiment, and its param publisher."""
    config = apply_overrides(load_experiment("tiny_arithmetic"), list(overrides))
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(config.to_json())
    (run_dir / "run_id").write_text("run-a\n")
    return config, ParamPublisher(param_store_url(str(run_dir)), "run-a", dtype="float32")


def perturbed(state, seed: int):
    """The params moved off the checkpoint's, as a trained policy's are."""
    leaves, treedef = jax.tree.flatten(nnx.to_pure_dict(state))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(treedef, [x + 0.05 * jax.random.normal(k, x.shape, x.dtype)
                                        for x, k in zip(leaves, keys)])


def torch_logits(directory) -> np.ndarray:
    """The checkpoint's logits for IDS, computed in fp32 (bf16 weights are widened exactly)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor(IDS)).logits.float().numpy()


def with_params(model, pure):
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(nnx.graphdef(model), state)


def test_export_loads_in_transformers_with_the_published_logits_and_the_runs_tokenizer(tmp_path, capsys):
    from transformers import AutoTokenizer, GenerationConfig

    run = tmp_path / "run"
    config, publisher = make_run(run)
    model = load_model(config.model.checkpoint)
    versions = [perturbed(nnx.state(model, nnx.Param), seed) for seed in (1, 2)]
    with publisher:
        for step, params in enumerate(versions, 1):
            publisher.publish(params, {"kind": "full"}, step=step * 10)

    done = export_policy(run)  # the newest version, in model.param_dtype, under RUN/hf
    assert (done.directory, done.source, done.step) == (run / "hf" / "version-2", "param version 2", 20)
    assert done.written == "full"
    want = logits_of(with_params(model, versions[1]), IDS)
    np.testing.assert_allclose(torch_logits(done.directory), want, atol=2e-5)
    record = json.loads((done.directory / "export.json").read_text())
    assert record["version"] == 2 and record["step"] == 20 and record["run_id"] == "run-a"
    assert record["base_checkpoint"] == config.model.checkpoint and record["dtype"] == "float32"
    generation = GenerationConfig.from_pretrained(done.directory)  # the searchers' sampling
    sampling = config.rollout.sampling
    assert generation.do_sample and generation.temperature == sampling.temperature == 0.7
    assert (generation.top_k, generation.top_p) == (0, 1.0)  # off, as in the run
    assert generation.max_new_tokens == sampling.max_new_tokens
    assert generation.eos_token_id == [2]  # the checkpoint's eos: the experiment names no stop ids
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)  # transformers' generate samples with the exported settings as they are
    drawn = AutoModelForCausalLM.from_pretrained(done.directory).generate(torch.tensor(IDS[:, :4]))
    assert 4 < drawn.shape[1] <= 4 + sampling.max_new_tokens
    tokenizer = AutoTokenizer.from_pretrained(done.directory)
    text = "12+345="
    from tbajax.system.assets import load_tokenizer_for

    assert tokenizer(text)["input_ids"] == load_tokenizer_for(config)(text)["input_ids"]

    # the command line: an older version, elsewhere, in bf16
    out = tmp_path / "v1-bf16"
    assert main([str(run), "--version", "1", "--out", str(out), "--dtype", "bfloat16"]) == 0
    printed = capsys.readouterr().out
    assert f"exported param version 1 (trainer step 10) of {run} in bfloat16 to {out}\n" in printed
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {"torch.bfloat16"}
    bf16 = logits_of(with_params(model, jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype),
                                                     versions[0])), IDS)
    np.testing.assert_allclose(torch_logits(out), bf16, atol=2e-5)


def test_a_lora_run_exports_its_adapters_merged_into_the_base(tmp_path):
    run = tmp_path / "run"
    config, publisher = make_run(run, *LORA)
    model = load_model(config.model.checkpoint)
    base = nnx.state(model, nnx.Param)
    adapters = init_lora(base, config.model.lora, jax.random.key(0))
    for i, (name, pair) in enumerate(sorted(adapters.items())):  # B = 0 at init: give it values
        b = pair["b"]
        values = 0.1 * jax.random.normal(jax.random.key(i), b.shape, b.dtype)
        pair["b"] = nnx.Param(values, **b.get_metadata())
    meta = {**adapter_manifest(base, config.model.lora), "base_checkpoint": config.model.checkpoint}
    with publisher:
        publisher.publish(adapter_arrays(adapters), meta, step=3)
    done = export_policy(run, tmp_path / "merged")
    assert done.written == "lora_merged" and done.step == 3
    want = logits_of(merge_lora(model, adapters, config.model.lora), IDS)
    assert np.abs(want - logits_of(model, IDS)).max() > 1e-3  # the adapters change the policy
    np.testing.assert_allclose(torch_logits(done.directory), want, atol=2e-5)

    # the adapters alone, for PEFT: over the torch base they give the same policy
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    peft_dir = export_policy(run, tmp_path / "peft", peft=True).directory
    assert sorted(p.name for p in peft_dir.iterdir() if p.name.startswith("adapter_")) == [
        "adapter_config.json", "adapter_model.safetensors"]
    base = AutoModelForCausalLM.from_pretrained(config.model.checkpoint, dtype=torch.float32)
    with torch.inference_mode():
        got = PeftModel.from_pretrained(base, peft_dir).eval()(torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_a_moved_run_exports_without_its_base_checkpoint(tmp_path):
    """The trainer copies the architecture and the tokenizer into RUN/model (`keep_model_files`),
    so a run whose base checkpoint is gone (a run directory moved to another machine) still
    exports, with the run's tokenizer; only merging LoRA adapters reads the base's weights."""
    from transformers import AutoTokenizer

    from tbajax.system.run_model import keep_model_files, with_run_tokenizer

    base = tmp_path / "base"
    shutil.copytree(load_experiment("tiny_arithmetic").model.checkpoint, base)
    at_base = f"model.checkpoint={json.dumps(str(base))}"
    full, lora = tmp_path / "full", tmp_path / "lora"
    config, publisher = make_run(full, at_base)
    assert keep_model_files(full, config) == full / "model"
    assert json.loads((full / "model" / "source.json").read_text())["checkpoint"] == str(base)
    (full / "model" / "source.json").write_text("first")
    keep_model_files(full, config)  # a resumed trainer keeps its first copy
    assert (full / "model" / "source.json").read_text() == "first"
    model = load_model(base)
    trained = perturbed(nnx.state(model, nnx.Param), 6)
    with publisher:
        publisher.publish(trained, {"kind": "full"}, step=4)
    lora_config, lora_publisher = make_run(lora, at_base, *LORA)
    keep_model_files(lora, lora_config)
    adapters = init_lora(nnx.state(model, nnx.Param), lora_config.model.lora, jax.random.key(0))
    with lora_publisher:
        lora_publisher.publish(adapter_arrays(adapters),
                               adapter_manifest(nnx.state(model, nnx.Param), lora_config.model.lora), step=2)
    text = "12+345="
    want_ids = AutoTokenizer.from_pretrained(base)(text)["input_ids"]
    shutil.rmtree(base)

    done = export_policy(full)
    np.testing.assert_allclose(torch_logits(done.directory), logits_of(with_params(model, trained), IDS),
                               atol=2e-5)
    assert AutoTokenizer.from_pretrained(done.directory)(text)["input_ids"] == want_ids
    assert with_run_tokenizer(full, config).model.tokenizer == str(full / "model")  # samples, evaluate
    with pytest.raises(ExportError, match="merging this LoRA run's adapters reads its base checkpoint's "
                                          "weights.*or export the adapters alone with --peft"):
        export_policy(lora)
    assert export_policy(lora, peft=True).written == "peft_adapters"


def test_what_cannot_be_exported_is_said(tmp_path, capsys):
    run = tmp_path / "run"
    config, publisher = make_run(run)
    with pytest.raises(ExportError, match="no params to export yet: no version published to .* and no"):
        export_policy(run)
    params = nnx.to_pure_dict(nnx.state(load_model(config.model.checkpoint), nnx.Param))
    with publisher:
        for step in range(1, 6):  # keeps the newest 3
            publisher.publish(params, {"kind": "full"}, step=step)
    with pytest.raises(ParamVersionError, match=r"version 1 is not available .* versions are \[3, 4, 5\]"):
        export_policy(run, version=1)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="exists and is not empty: pass another --out, or --overwrite"):
        export_policy(run, out)
    assert export_policy(run, out, overwrite=True).source == "param version 5"
    assert (out / "notes.txt").exists()  # --overwrite replaces the export's files, not the directory
    assert main([str(tmp_path / "nothing-here")]) == 2
    assert "holds no run" in capsys.readouterr().err
    assert main([str(run), "--version", "2"]) == 2
    assert "param version 2 is not available" in capsys.readouterr().err
    assert main([str(run), "--checkpoint", "4"]) == 2
    assert "no complete trainer checkpoint under" in capsys.readouterr().err
    assert main([str(run), "--peft"]) == 2
    assert "--peft writes a LoRA run's adapters, and this run trains every weight" in capsys.readouterr().err


def test_a_trainer_checkpoint_exports_its_params_and_the_newer_source_is_the_default(tmp_path):
    """A sync-mode run publishes nothing: its checkpoints hold the policy. Only the params are read
    from a checkpoint (not the optimizer's moments or the reference), and by default the export
    takes whichever of the newest checkpoint and the newest version is of the later step."""
    run = tmp_path / "run"
    config, publisher = make_run(run)
    model = load_model(config.model.checkpoint)
    trained = with_params(model, perturbed(nnx.state(model, nnx.Param), 3))
    trainer = config.train.trainer
    _, state = init_train_state(trained, trainer)
    state = dataclasses.replace(state, step=jnp.asarray(10, jnp.int32))
    with Checkpointer(run / "checkpoints") as checkpoints:
        checkpoints.save(state, {"buffer": {}})
    done = export_policy(run)
    assert (done.source, done.step, done.directory.name) == ("trainer checkpoint 10", 10, "checkpoint-10")
    np.testing.assert_allclose(torch_logits(done.directory), logits_of(trained, IDS), atol=2e-5)
    with publisher:
        publisher.publish(perturbed(nnx.state(model, nnx.Param), 4), {"kind": "full"}, step=10)
        assert export_policy(run, tmp_path / "tie").source == "trainer checkpoint 10"  # the trainer's own
        publisher.publish(perturbed(nnx.state(model, nnx.Param), 5), {"kind": "full"}, step=11)
    assert export_policy(run, tmp_path / "newer").source == "param version 2"
    assert export_policy(run, tmp_path / "asked", checkpoint=10).source == "trainer checkpoint 10"

    # `python -m tbajax.evaluate` scores a stored policy in place as it scores its export
    from tbajax.evaluate import evaluate

    small = apply_overrides(config, ["eval.num_problems=8", "eval.batch_size=8"])
    in_place = evaluate(small, policy=read_stored_policy(run, checkpoint=10).model())
    assert in_place == evaluate(small, str(done.directory))
    assert in_place["eval_problems"] == 8 and in_place["eval_metric"] == "accuracy"


def test_evaluate_names_what_is_wrong(capsys):
    """`python -m tbajax.evaluate` (scored against a run's own final evaluation in
    `test_system.py::test_async_run_with_two_searchers`): a missing checkpoint and a misspelt key."""
    from tbajax.evaluate import main as evaluate_main

    assert evaluate_main(["--model", "/nonexistent-checkpoint"]) == 2
    assert "'/nonexistent-checkpoint' is neither a local directory nor a hub id" in capsys.readouterr().err
    assert evaluate_main(["--set", "eval.num_problem=3"]) == 2
    assert "Did you mean 'eval.num_problems'?" in capsys.readouterr().err
