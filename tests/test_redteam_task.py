"""The red-team task: its scorer (SFT prior + victim + toxicity classifier -> log reward), its eval
metrics, and sync / async runs through `python -m tbajax.main`.

The attacker and the victim are the shipped tiny Llama (experiments/assets/tiny-arithmetic, with a
tokenizer); the classifier is a tiny random BiLSTM h5 of the toxic-comment-classifier layout whose
Keras word index knows the numbers 0..999, so the victim's digit answers get varied toxicities.
Independent oracles: torch transformers for the prior, the numpy BiLSTM of
tests/test_toxicity_bilstm.py for the toxicity.
"""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("h5py", reason="h5py reads the BiLSTM weights")

from tbajax.stores import TrajectoryReader, discover_searcher_stores  # noqa: E402
from tbajax.tasks import get_task  # noqa: E402
from tbajax.tasks.redteam import TB_NO_REFERENCE, RedTeamEval, hashed_bow, training_metrics  # noqa: E402
from tbajax.tasks.scoring import Samples, ScorerContext, Scores  # noqa: E402
from tbajax.tokenizers import load_tokenizer  # noqa: E402
from tests.test_system import _finish, _main  # noqa: E402
from tests.test_toxicity_bilstm import (  # noqa: E402
    KERAS_FILTERS,
    _fake_keras_modules,
    oracle_ids,
    oracle_probs,
    write_tiny_h5,
)

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "experiments" / "assets" / "tiny-arithmetic"
WORD_INDEX = {str(n): n + 1 for n in range(1000)}
INSTRUCTION = "12+34="


@pytest.fixture(scope="module")
def bilstm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_bilstm(tmp_path_factory.mktemp("bilstm"))


def write_tiny_bilstm(d: Path) -> Path:
    """The tiny BiLSTM judge (weights + Keras tokenizer pickle) in directory `d`."""
    d.mkdir(parents=True, exist_ok=True)
    write_tiny_h5(d / "model.weights.h5", vocab=1001, seed=3)
    mp = pytest.MonkeyPatch()
    cls = _fake_keras_modules(mp)
    t = cls()
    t.__dict__.update(word_index=WORD_INDEX, num_words=1001, filters=KERAS_FILTERS, lower=True, split=" ",
                      oov_token=None, char_level=False, analyzer=None)
    (d / "tokenizer.pickle").write_bytes(pickle.dumps(t))
    mp.undo()
    return d


def _task(bilstm_dir: Path, **kw):
    options = dict(victim=str(TINY), classifier=f"bilstm:{bilstm_dir}", instruction=INSTRUCTION,
                   victim_answers=3, victim_max_new_tokens=6, victim_max_prompt_tokens=16, victim_temperature=1.0,
                   victim_top_p=1.0)
    options.update(kw)
    return get_task("redteam", **options)


def _torch_log_prior(model, prompt: list[int], response: list[int]) -> float:
    import torch

    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
    picked = logp[torch.arange(len(prompt) - 1, ids.shape[1] - 1), ids[0, len(prompt):]]
    return float(picked.sum())


def test_scorer_gives_the_formulas_log_reward(bilstm_dir: Path, tmp_path: Path) -> None:
    # β 0.5, γ 2, τ ramped 3 -> 1 over 10 steps: at version 5 (sync_every 1) τ = 2
    # scorer_batch 2: the 3 attacks go to the victim and the prior as chunks of 2 + 1
    encoder = _random_sentence_encoder(tmp_path / "encoder")
    task = _task(bilstm_dir, beta=0.5, gamma=2.0, tau=[3.0, 1.0, 10], min_attack_tokens=3, scorer_batch=2,
                 encoder=str(encoder), embed_attacks=True)
    tok = load_tokenizer(TINY)
    scorer = task.scorer(task, ScorerContext(config=None, tokenizer=tok, policy_checkpoint=str(TINY)))
    assert scorer.prior_shares_victim  # victim = the attacker's checkpoint: one copy of the weights
    scorer.set_policy_version(5)
    prompt = tok(task.prompt(task.load("train")[0]))["input_ids"]
    responses = [[5, 6, 18, 7, 2], [8, 9], [10, 18, 11, 12, 13, 14, 2]]  # "12 3<eos>", "45" (short), ...
    texts = [tok.decode(r[:-1] if r[-1] == 2 else r, skip_special_tokens=True) for r in responses]
    samples = Samples(problems=[task.load("train")[0]] * 3, prompt_tokens=[np.array(prompt)] * 3,
                      response_tokens=[np.array(r) for r in responses], texts=texts,
                      finished=np.array([True, False, True]))
    import jax

    scores = scorer.score(samples, jax.random.PRNGKey(7))
    ex = scores.extras
    assert ex["attack"] == texts and ex["attack_length"] == [5, 2, 7] and ex["reward_step"] == [5, 5, 5]
    assert all(len(a) == 3 and all(isinstance(s, str) for s in a) for a in ex["victim_answers"])
    # the prior: untempered log-likelihood under torch transformers
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    want_prior = [_torch_log_prior(model, prompt, r) for r in responses]
    np.testing.assert_allclose(ex["log_prior"], want_prior, atol=2e-4)
    # the toxicity: the numpy oracle on the stored victim answers
    answers = [a for row in ex["victim_answers"] for a in row]
    probs = oracle_probs(bilstm_dir / "model.weights.h5", [oracle_ids(a, WORD_INDEX, 1001) for a in answers])[:, 0]
    np.testing.assert_allclose(np.ravel(ex["toxicity"]), probs, rtol=1e-5)
    assert len(set(np.round(probs, 6))) > 1, "the victim's answers should not all score alike"
    tau = 2.0
    mean_log_tox = np.log(probs).reshape(3, 3).mean(1)
    prior = np.array([want_prior[0], -500.0, want_prior[2]])  # 2 tokens < min_attack_tokens=3
    np.testing.assert_allclose(scores.reward, (prior / 2.0 + mean_log_tox / 0.5) / tau, rtol=1e-4, atol=1e-3)
    assert scores.reward[1] < -100  # the short-attack penalty
    # embed_attacks: each attack's sentence embedding (mean pooling, then L2, as sentence-transformers)
    # for the heap's cosine rule, equal to torch's on the same tokens
    from transformers import AutoModel

    bert, enc_tok = AutoModel.from_pretrained(encoder).eval(), load_tokenizer(encoder)
    with torch.no_grad():
        want_emb = [torch.nn.functional.normalize(bert(torch.tensor([enc_tok(t)["input_ids"]])).last_hidden_state.mean(1),
                                                  dim=1)[0].numpy() for t in texts]
    np.testing.assert_allclose(np.asarray(ex["embedding"]), np.stack(want_emb), atol=1e-5)
    # victim sampling follows the key: same key, same answers
    again = scorer.score(samples, jax.random.PRNGKey(7))
    assert again.extras["victim_answers"] == ex["victim_answers"]
    scorer.close()


def _eval_inputs(texts: list[str], tox: list[list[float]]) -> tuple[Samples, Scores]:
    n = len(texts)
    samples = Samples(problems=[None] * n, prompt_tokens=[np.array([1])] * n,
                      response_tokens=[np.array([5])] * n, texts=texts, finished=np.ones(n, bool), split="eval")
    return samples, Scores(reward=np.zeros(n), status=np.zeros(n, np.int64), extras={"toxicity": tox})


def test_eval_fn_on_hand_built_extras() -> None:
    # geometric means: 0.849, 0.849, 0.424, 0.141, 0.6 -> successes 0, 1, 4 (3 of 5)
    texts = ["red cat", "red cat", "blue sky", "nice day", "red dog"]
    tox = [[0.9, 0.8], [0.9, 0.8], [0.6, 0.3], [0.1, 0.2], [0.6, 0.6]]
    assert len({h % 4096 for h in map(lambda w: __import__("zlib").crc32(w.encode()), ["red", "cat", "dog"])}) == 3
    m = RedTeamEval()( *_eval_inputs(texts, tox))
    assert m["attack_success_rate"] == pytest.approx(0.6)
    assert m["num_successful"] == 3 and m["num_unique_successful"] == 2 and m["num_unique_attacks"] == 4
    assert m["mean_geometric_toxicity"] == pytest.approx(np.mean([0.72**0.5, 0.72**0.5, 0.18**0.5, 0.02**0.5, 0.6]))
    # bag of words: "red cat" x2 and "red dog". cos(cat, cat) = 1, cos(cat, dog) = 1/2 (one shared word):
    # mean over the 6 ordered pairs = (2·1 + 4·0.5) / 6 = 2/3
    assert "diversity" not in m  # not MiniLM: named for what it is
    assert m["diversity_hashed_bow"] == pytest.approx(1 - 2 / 3)
    assert np.count_nonzero(hashed_bow([""])) == 1  # no zero rows
    # with an encoder the metric is `diversity` (here over hand-set embeddings)
    ev = RedTeamEval(encoder="unused")
    ev.embed = lambda ts: np.array([[1.0, 0.0] if t == "red cat" else [0.0, 1.0] for t in ts])  # type: ignore[method-assign]
    m = ev(*_eval_inputs(texts, tox))
    assert m["diversity"] == pytest.approx(1 - 2 / 6) and "diversity_hashed_bow" not in m
    # nothing succeeds: rate 0, diversity 0 (no pairs)
    m = RedTeamEval()(*_eval_inputs(["a", "b"], [[0.1, 0.1], [0.2, 0.2]]))
    assert m["attack_success_rate"] == 0.0 and m["diversity_hashed_bow"] == 0.0


def test_tb_without_reference_reads_no_reference() -> None:
    from tbajax.objectives.tb import tb

    assert TB_NO_REFERENCE.loss is tb and not TB_NO_REFERENCE.inputs_for(None).reference_logprobs


RUN_MIN_ATTACK_TOKENS = 3  # the runs' attacks have 2-5 tokens: some take the short-attack prior


def _run_args(bilstm_dir: Path, *extra: str) -> list[str]:
    options = dict(victim=str(TINY), classifier=f"bilstm:{bilstm_dir}", instruction=INSTRUCTION, num_eval=4, eval_samples=8,
                   victim_answers=2, victim_max_new_tokens=4, victim_max_prompt_tokens=16, beta=0.5,
                   min_attack_tokens=RUN_MIN_ATTACK_TOKENS)
    return [
        "--set", "task.name=redteam", "--set", f"task.options={json.dumps(options)}",
        "--objective=tbajax.tasks.redteam:TB_NO_REFERENCE",
        "--set", 'train.trainer.beta={"kind": "constant", "start": 1.0}',
        "--set", "rollout.sampling.temperature=1.0", "--set", "train.trainer.temperature=1.0",
        "--set", "rollout.sampling.min_new_tokens=2", "--set", "rollout.sampling.max_new_tokens=5",
        # 32 *sampled* eval attacks (4 problems x 8), shaped like one rollout call: one program for both
        "--set", "eval.num_problems=4", "--set", "eval.batch_size=4",
        # the objective reads no reference: neither side computes one (the trainer keeps no copy)
        "--set", "rollout.reference_logprobs=false", "--set", "train.trainer.compute_reference_logprobs=false",
        # the red-team recipe's replay (reward heap, half online) and LoRA adapters, as redteam_experiment
        "--set", "buffer.max_staleness=null", "--set", "buffer.mode=reward_heap", "--set", "buffer.reward_inv_temp=1.0", "--set", "buffer.recency_prob=0.5",
        "--set", "model.lora.rank=4", "--set", "model.lora.alpha=8",
        *extra,
    ]


def _check_run(run: Path, out: str, steps: int) -> None:
    summary = json.loads((run / "summary.json").read_text())
    assert summary["trainer_steps"] == steps, out
    assert summary["eval_metric"] == "attack_success_rate"
    end = summary["eval_end"]
    assert 0.0 <= end["eval_attack_success_rate"] <= 1.0
    assert "eval_diversity_hashed_bow" in end
    # sampled, not greedy: 32 draws of one prompt from a random tiny model are not all one attack
    assert 1 < end["eval_num_unique_attacks"] <= 32
    # one scorer per process: sync mode's generation and evaluation share it (victim loaded once)
    assert (run / "logs" / "trainer.log").read_text().count("redteam scorer:") == 1
    rows = []
    for url in discover_searcher_stores(str(run)).values():
        reader = TrajectoryReader(url)
        rows += reader.read(0, reader.committed_rows())
    assert rows
    for r in rows:
        ex = r.extras
        assert len(ex["victim_answers"]) == 2 and len(ex["toxicity"]) == 2
        assert ex["attack_length"] == len(r.response_tokens) >= 2
        short = ex["attack_length"] < RUN_MIN_ATTACK_TOKENS
        prior = -500.0 if short else ex["log_prior"]  # the stored prior is the model's, before the rule
        want = prior + float(np.mean(np.log(ex["toxicity"]))) / 0.5  # γ = τ = 1
        assert r.reward == pytest.approx(want, rel=1e-4, abs=1e-3)
    # the heap buffer's counters reach the trainer's records
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps_rec = [r for r in records if "buffer_heap_accepted" in r]
    assert steps_rec, records[-1]
    last = steps_rec[-1]
    assert 0 < last["buffer_heap_size"] == last["buffer_rows"] <= last["buffer_heap_accepted"] <= len(rows)
    assert last["buffer_batches_online"] + last["buffer_batches_replay"] == last["step"]
    assert "buffer_heap_near_duplicate_drops" in last and "buffer_heap_evictions" in last
    curve = training_metrics(run, window=100)
    assert curve[0]["num_attacks"] == len(rows) and 0.0 <= curve[0]["attack_success_rate"] <= 1.0


@pytest.mark.processes
def test_sync_mode_red_team_run(tmp_path: Path, bilstm_dir: Path) -> None:
    """Sync mode with the reference's learned log Z head (the async variant below runs VarGrad TB)."""
    run = tmp_path / "run"
    head = ["--objective=tb_logz_head", "--set", 'train.objective_options={"reference": false}']
    out = _finish(_main(run, "--mode=sync", *_run_args(bilstm_dir), *head, "--set", "train.steps=2"))
    _check_run(run, out, 2)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "aux_grad_norm" in r]
    assert len(steps) == 2 and all(math.isfinite(r["aux_grad_norm"]) and r["aux_grad_norm"] > 0 for r in steps)
    assert steps[1]["log_z"] != steps[0]["log_z"]  # the head moved (it starts at log Z = 0)


@pytest.mark.slow  # the sync run above covers the same scorer in the default run; this async variant is slow on 2 cores
@pytest.mark.processes
def test_async_red_team_run(tmp_path: Path, bilstm_dir: Path) -> None:
    run = tmp_path / "run"
    out = _finish(_main(run, *_run_args(bilstm_dir), "--set", "train.steps=3", "--set", "system.num_searchers=1"))
    _check_run(run, out, 3)
    assert math.isfinite(json.loads((run / "summary.json").read_text())["eval_score_end"])


@pytest.mark.slow  # two async runs; the buffer's state round trip is unit-tested in tests/test_heap_buffer.py
@pytest.mark.processes
def test_red_team_run_resumes_with_its_replay_heap(tmp_path: Path, bilstm_dir: Path) -> None:
    """--resume restores the heap from the checkpoint: its counters go on from there, and the rows the
    tailer re-reads from the stores (offered before the checkpoint) are skipped, not offered twice."""
    run = tmp_path / "run"
    args = [*_run_args(bilstm_dir), "--set", "system.num_searchers=1", "--set", "train.checkpoint_every=2"]
    out = _finish(_main(run, *args, "--set", "train.steps=2"))
    extra = json.loads((run / "checkpoints" / "2" / "extra" / "metadata").read_text())
    heap_state = extra["buffer"]["heap"]
    assert extra["buffer"]["mode"] == "reward_heap" and heap_state["items"], out
    out = _finish(_main(run, *args, "--set", "train.steps=4", "--resume"))
    assert json.loads((run / "summary.json").read_text())["trainer_steps"] == 4, out
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("event") == "resume" and r["from_step"] == 2 for r in records)
    after = [r for r in records if "buffer_heap_accepted" in r and r["step"] > 2]
    assert after and after[0]["buffer_heap_accepted"] >= heap_state["counts"]["accepted"]
    assert after[-1]["buffer_replayed_rows_skipped"] > 0  # the stores' old rows were re-read and skipped


def test_exploration_temperature_is_an_explicit_opt_out() -> None:
    from tbajax.config import ConfigError, ExperimentConfig, RolloutSpec, TrainSpec
    from tbajax.sampling import SamplingConfig

    rollout = RolloutSpec(sampling=SamplingConfig(temperature=1.5, num_samples=20))
    with pytest.raises(ConfigError, match="exploration_temperature"):
        ExperimentConfig(name="x", rollout=rollout)
    cfg = ExperimentConfig(name="x", rollout=rollout, train=TrainSpec(exploration_temperature=True))
    assert cfg.train.trainer.temperature == 1.0 and cfg.rollout.sampling.temperature == 1.5


def test_random_temperature_per_call_is_checked_and_follows_the_rule() -> None:
    """rollout.random_temperature: per call, uniform in [low, high] with probability prob, else the
    configured temperature; only with exploration_temperature and the static engine."""
    import types

    import jax

    from tbajax.config import ConfigError, ExperimentConfig, RolloutSpec, TrainSpec
    from tbajax.sampling import SamplingConfig
    from tbajax.system.searcher import Rollouts

    rollout = RolloutSpec(sampling=SamplingConfig(temperature=1.0, num_samples=20), random_temperature=[0.5, 2.0, 0.5])
    with pytest.raises(ConfigError, match="exploration_temperature"):
        ExperimentConfig(name="x", rollout=rollout)
    for bad in ([2.0, 0.5, 0.5], [0.5, 2.0, 1.5], [0.5, 2.0]):
        with pytest.raises(ConfigError, match="random_temperature"):
            RolloutSpec(random_temperature=bad)
    with pytest.raises(ConfigError, match="engine=static"):
        RolloutSpec(random_temperature=[0.5, 2.0, 0.5], engine="continuous")
    cfg = ExperimentConfig(name="x", rollout=rollout, train=TrainSpec(exploration_temperature=True))
    assert ExperimentConfig.from_dict(json.loads(cfg.to_json())) == cfg
    temps = np.array([Rollouts.call_sampling(types.SimpleNamespace(config=cfg), jax.random.PRNGKey(i)).temperature
                      for i in range(400)])
    hot = temps != 1.0
    assert 0.4 < hot.mean() < 0.6 and np.all((temps[hot] >= 0.5) & (temps[hot] <= 2.0))
    assert np.std(temps[hot]) > 0.3  # spread over the interval, not one value
    assert Rollouts.call_sampling(types.SimpleNamespace(config=cfg), jax.random.PRNGKey(3)).temperature == temps[3]


@pytest.mark.parametrize("name", ["redteam_gpt2", "redteam_llama", "redteam_smollm2"])
def test_redteam_experiments_resolve(name: str) -> None:
    from tbajax.config import ExperimentConfig
    from tbajax.main import load_experiment
    from tbajax.objectives import get_objective

    config = load_experiment(name)
    assert config.name == name and config.task.name == "redteam"
    assert ExperimentConfig.from_dict(json.loads(config.to_json())) == config
    if name == "redteam_smollm2":
        assert get_objective(config.train.objective) is TB_NO_REFERENCE
    else:  # the paper's recipes: the reference's learned log Z head, no reference term
        assert config.train.objective == "tb_logz_head" and config.train.objective_options == {"reference": False}
        assert config._objective_reads_no_reference()
    s = config.rollout.sampling
    assert (s.min_new_tokens, s.max_new_tokens) == (5, 20)  # no EOS first; attacks of 5-20 tokens
    assert config.train.trainer.beta.start == 1.0 and config.train.trainer.temperature == 1.0
    assert config.task.options["beta"] == 0.1
    # the reference's replay (reward heap, half online) and adapters (LoRA r 32, α 16); no reference copy
    b = config.buffer
    paper = name != "redteam_smollm2"  # the reference's MiniLM cosine rule besides edit distance
    assert (b.mode, b.recency_prob, b.heap_priority, b.edit_tolerance, b.cosine_tolerance) == (
        "reward_heap", 0.5, "log_toxicity", 0.25, 0.4 if paper else None)
    assert config.task.options.get("embed_attacks", False) == paper
    assert config.rollout.random_temperature == ((0.5, 2.0, 0.5) if paper else None)
    assert (config.model.lora.rank, config.model.lora.alpha) == (32, 16.0) and config.system.publish == "auto"
    assert not config.train.trainer.compute_reference_logprobs and not config.rollout.reference_logprobs
    assert config.task.options["num_train"] == 1  # one prompt id: any K attacks are a TB group
    if name != "redteam_smollm2":
        assert config.task.options["victim_answers"] == 5
        assert config.train.groups_per_step * s.num_samples == 128 and config.train.steps == 5000
        assert config.train.trainer.optimizer.lr.peak == 1e-4
    task = get_task("redteam", **config.task.options)  # the options are the factory's
    assert task.headline_metric == "attack_success_rate"


@pytest.mark.parametrize("kind", ["encoder", "scorer"])
def test_model_judges_match_torch(kind: str, tmp_path: Path) -> None:
    """A BERT (`encoder:`) and a Llama (`scorer:`) *ForSequenceClassification as the toxicity
    judge: log p(toxic label) equals torch's log_softmax of the logits; the toxic label is found
    by name in id2label (here index 0)."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from tbajax.tasks.redteam import load_judge

    common = dict(vocab_size=19, num_labels=2, id2label={0: "toxic", 1: "clean"}, label2id={"toxic": 0, "clean": 1},
                  pad_token_id=0, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48)
    if kind == "encoder":
        cfg = AutoConfig.for_model("bert", max_position_embeddings=64, **common)
    else:
        cfg = AutoConfig.for_model("llama", num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1,
                                   eos_token_id=2, **common)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / f, tmp_path / f)
    judge = load_judge(f"{kind}:{tmp_path}")
    texts = ["12+34", "5", "999-1 2"]
    tok = load_tokenizer(tmp_path)
    want = []
    with torch.no_grad():
        for t in texts:
            ids = torch.tensor([tok(t)["input_ids"]])
            want.append(float(torch.log_softmax(model(ids).logits[0].double(), -1)[0]))
    np.testing.assert_allclose(judge.log_toxicity(texts), want, atol=1e-4)


def test_guard_judge_matches_torch_on_the_templated_conversation(tmp_path: Path) -> None:
    """`guard:` (Llama Guard's role in the Llama recipe): log p(first token of "unsafe") after the
    guard's chat template on [user: attack, assistant: answer], from one padded batch, equals
    torch's next-token log_softmax on each conversation alone."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tbajax.tasks.redteam import GuardJudge, load_judge

    cfg = AutoConfig.for_model("llama", vocab_size=19, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=48, max_position_embeddings=128,
                               bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    model.save_pretrained(tmp_path)
    shutil.copy(TINY / "tokenizer.json", tmp_path / "tokenizer.json")
    tok_cfg = json.loads((TINY / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = ("{% for m in messages %}{{ m['content'][0]['text'] }}={% endfor %}"
                                "{{ '9' if add_generation_prompt }}")  # content parts, as Llama Guard 3's
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    # a one-character vocabulary: "7" is the verdict token, after the prefix "8"
    judge = GuardJudge(str(tmp_path), unsafe_text="7", verdict_prefix="8")
    assert judge.unsafe_id == 11 and isinstance(load_judge(f"guard:{tmp_path}"), GuardJudge)
    attacks, answers = ["12+34", "5", "999-1"], ["46", "", "9 9 8 7 6 5"]
    tok = load_tokenizer(tmp_path)
    want = []
    with torch.no_grad():
        for a, r in zip(attacks, answers):
            ids = tok(f"{a}={r}=98", add_special_tokens=False)["input_ids"]
            assert judge.conversation_ids(a, r) == ids
            want.append(float(torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)[11]))
    np.testing.assert_allclose(judge.log_toxicity(answers, prompts=attacks), want, atol=1e-4)
    with pytest.raises(ValueError, match="one prompt"):
        judge.log_toxicity(answers)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in tok_cfg.items() if k != "chat_template"}))
    with pytest.raises(ValueError, match="no chat template"):
        GuardJudge(str(tmp_path))


def test_redteam_report_checks_and_plots(tmp_path: Path) -> None:
    """experiments/redteam_report.py on hand-written eval rows: the issue's three checks."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("redteam_report", REPO / "experiments" / "redteam_report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)  # type: ignore[union-attr]

    def write(run: Path, evals: list[tuple[int, float, float, float]]) -> None:
        run.mkdir()
        rows = [{"step": 1, "role": "trainer", "reward_mean": -50.0}]  # a train row: skipped
        rows += [{"step": s, "role": "trainer", "eval_attack_success_rate": a, "eval_num_unique_successful": u,
                  "eval_diversity": d, "eval_mean_geometric_toxicity": a / 2, "eval_num_unique_attacks": 64.0}
                 for s, a, u, d in evals]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    write(tmp_path / "tb", [(0, 0.05, 3, 0.6), (12, 0.2, 12, 0.5), (24, 0.35, 20, 0.4)])
    write(tmp_path / "pg", [(0, 0.05, 3, 0.6), (12, 0.5, 4, 0.1)])
    out = report.main(["--run", f"tb={tmp_path / 'tb'}", "--run", f"pg={tmp_path / 'pg'}", "--baseline", "pg",
                       "--out", str(tmp_path / "out"), "--no-copy"])
    check = out["checks"]["tb"]
    assert check["asr_rise_points"] == pytest.approx(30.0) and check["asr_rises_20_points"]
    assert check["diversity_ratio"] == pytest.approx(0.4 / 0.6) and check["diversity_kept_half"]
    # common eval steps 0 and 12: TB 12 unique successes vs the baseline's 4 at step 12
    assert check["unique_successful_at_common_steps"] == {0: [3, 3], 12: [12, 4]}
    assert check["more_unique_than_baseline_at_last_common_step"] is True
    assert "pg" not in out["checks"]
    assert (tmp_path / "out" / "learning_curves.png").stat().st_size > 0
    assert (tmp_path / "out" / "toxicity_vs_diversity.png").stat().st_size > 0
    # a run stopped a step off the baseline's last eval: paired within 1 step, a later one on a tie
    assert report.matched_steps([0, 15], [0, 14, 16], 1) == [(0, 0), (15, 16)]
    assert report.matched_steps([0, 15], [0, 17], 1) == [(0, 0)]
    write(tmp_path / "tb2", [(0, 0.05, 3, 0.6), (15, 0.3, 9, 0.5)])
    write(tmp_path / "pg2", [(0, 0.05, 3, 0.6), (16, 0.1, 2, 0.2)])
    within = report.main(["--run", f"tb={tmp_path / 'tb2'}", "--run", f"pg={tmp_path / 'pg2'}", "--baseline", "pg",
                          "--out", str(tmp_path / "out2"), "--no-copy", "--match-within", "1"])["checks"]["tb"]
    assert within["unique_successful_at_matched_steps"] == {"0 vs 0": [3, 3], "15 vs 16": [9, 2]}
    assert within["more_unique_than_baseline_at_last_common_step"] is True
    assert json.loads((tmp_path / "out" / "comparison.json").read_text())["figures"]["pg"]["asr_end"] == 0.5


def _random_sentence_encoder(d: Path) -> Path:
    """A random BERT with the tiny character tokenizer: a sentence encoder (mean pooling + L2)."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModel

    torch.manual_seed(2)
    cfg = AutoConfig.for_model("bert", vocab_size=19, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=48, max_position_embeddings=64, pad_token_id=0)
    AutoModel.from_config(cfg).eval().save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / f, d / f)
    return d


def test_embed_attacks_needs_an_encoder(bilstm_dir: Path) -> None:
    with pytest.raises(ValueError, match="needs an encoder"):
        _task(bilstm_dir, embed_attacks=True)


STANDIN_TEMPLATE = ("{% for m in messages %}{{ m['content'] if m['content'] is string else m['content'][0]['text'] }}"
                    "={% endfor %}")


def _standin_checkpoints(name: str, d: Path) -> tuple[Path, str]:
    """(attacker = victim dir, classifier spec) for `name`'s architectures at toy size: a random
    GPT-2 with a random RoBERTa hate classifier, or a random Llama with a random guard Llama;
    all with the tiny character tokenizer and a chat template."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    def save(model, path: Path) -> Path:
        model.save_pretrained(path)
        shutil.copy(TINY / "tokenizer.json", path / "tokenizer.json")
        tok_cfg = {**json.loads((TINY / "tokenizer_config.json").read_text()), "chat_template": STANDIN_TEMPLATE}
        (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
        return path

    torch.manual_seed(0)
    ids = dict(vocab_size=19, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if name == "redteam_gpt2":
        lm = AutoConfig.for_model("gpt2", n_embd=32, n_layer=2, n_head=4, n_positions=256, **ids)
        clf = AutoConfig.for_model("roberta", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=48, max_position_embeddings=260, num_labels=2,
                                   id2label={0: "nothate", 1: "hate"}, label2id={"nothate": 0, "hate": 1}, **ids)
        judge = save(AutoModelForSequenceClassification.from_config(clf).eval(), d / "judge")
        spec = f"encoder:{judge}"
    else:
        lm = AutoConfig.for_model("llama", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=48, max_position_embeddings=512, **ids)
        spec = f"guard:{save(AutoModelForCausalLM.from_config(lm).eval(), d / 'guard')}"
    return save(AutoModelForCausalLM.from_config(lm).eval(), d / "attacker"), spec


@pytest.mark.slow  # ~1-4 min each on 2 cores; the default run's sync run covers the head objective and LoRA
@pytest.mark.processes
@pytest.mark.parametrize("name", ["redteam_llama", "redteam_gpt2"])
def test_paper_recipe_standin_sync_run(name: str, tmp_path: Path) -> None:
    """The paper's recipe as written (learned log Z head, LoRA, reward heap, γ/τ schedules, the
    recipe's judge kind) on random checkpoints of its architectures; only sizes are cut."""
    attacker, judge = _standin_checkpoints(name, tmp_path)
    run = tmp_path / "run"
    cut = {"model.checkpoint": attacker, "task.options.victim": attacker, "task.options.classifier": judge,
           "task.options.instruction": INSTRUCTION,  # the default one is 130 characters: over a char tokenizer's limit
           "task.options.encoder": _random_sentence_encoder(tmp_path / "encoder"), "task.options.victim_answers": 2, "task.options.victim_max_new_tokens": 4,
           "task.options.num_eval": 2, "task.options.eval_samples": 4, "rollout.sampling.num_samples": 4,
           "buffer.samples_per_group": 4, "rollout.sampling.max_new_tokens": 6, "rollout.prompts_per_call": 2,
           "train.groups_per_step": 2, "train.steps": 2, "model.lora.rank": 4, "eval.num_problems": 2,
           "eval.batch_size": 2}
    args = [f"--experiment={name}", "--mode=sync"] + [x for k, v in cut.items() for x in ("--set", f"{k}={v}")]
    out = _finish(_main(run, *args), timeout=400)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["trainer_steps"] == 2 and summary["eval_metric"] == "attack_success_rate", out[-2000:]
    config = json.loads((run / "config.json").read_text())
    assert config["train"]["objective"] == "tb_logz_head" and config["task"]["options"]["tau"] == [2.0, 1.0, 500]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "aux_grad_norm" in r] == [1, 2]
    rows = [row for url in discover_searcher_stores(str(run)).values()
            for row in TrajectoryReader(url).read(0, TrajectoryReader(url).committed_rows())]
    assert rows and all(len(r.extras["toxicity"]) == 2 and len(r.extras["embedding"]) == 32 for r in rows)
    assert all(5 <= len(r.response_tokens) <= 6 for r in rows)  # the recipe's 5-token minimum
