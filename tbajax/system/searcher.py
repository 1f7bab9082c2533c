"""The searcher: sample K completions per prompt with a (possibly stale) policy, score them,
append them to its own trajectory store. It never waits for the trainer: before each generation
call it loads the newest published params if there are newer ones, and otherwise carries on.

`Rollouts` is the in-memory core (prompts -> scored `Trajectory` rows), shared verbatim by the
asynchronous searcher process and the synchronous mode.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from tbajax.config import ExperimentConfig
from tbajax.models import CausalLM, load_model
from tbajax.sampling import PreparedParams, Sampler, SampleOutput, SamplingConfig
from tbajax.sampling.continuous import Completed, ContinuousEngine, request_keys
from tbajax.sharding import make_mesh
from tbajax.stores import ParamReader, ParamVersionError, TrajectoryWriter, param_store_url, trajectory_store_url
from tbajax.system import rundir
from tbajax.system.metrics import MetricsWriter
from tbajax.system.pipeline import PollBackoff
from tbajax.system.publishing import SearcherParams
from tbajax.system.wandb_logging import open_wandb
from tbajax.tasks.base import Problem, Task
from tbajax.tasks.reward_pool import RewardResult
from tbajax.tasks.scoring import Samples, Scorer, ScorerContext, Scores, build_scorer, grade_in_process
from tbajax.trajectory import RewardStatus, Trajectory

log = logging.getLogger(__name__)


_SCORER_STREAM = 0x5C0BE  # the scorer's randomness (e.g. a victim LM's samples) is its own stream
_TEMPERATURE_STREAM = 0x7E3B  # rollout.random_temperature's draw per call


class PromptTooLongError(ValueError):
    """A prompt does not fit rollout.max_prompt_tokens (the problem is skipped, not fatal)."""


def score_in_process(task: Task, completions: Sequence[str], answers: Sequence[Any]) -> list[RewardResult]:
    """Score with the task's reward function in this process, with exactly the pool's statuses
    (`call_reward`): a raise, a NaN/inf reward or a malformed return costs that sample an ERROR
    status (reward 0), never the searcher, and never puts a non-finite reward into a store.
    (What `tbajax.tasks.scoring.RewardFnScorer` does without a pool.)"""
    return grade_in_process(task, completions, answers)


class GradeWatch:
    """Remembers whether the last `window` grades failed (TIMEOUT/ERROR) and the first error text,
    so a searcher whose grader always fails stops with the reason instead of filling the store
    with rows nobody can train on (and leaving the trainer waiting forever)."""

    def __init__(self, window: int):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.recent: collections.deque[bool] = collections.deque(maxlen=window)
        self.first_error: str | None = None

    def add(self, scores: Scores | Sequence[RewardResult]) -> None:
        if not isinstance(scores, Scores):
            scores = Scores.from_results(scores)
        errors = scores.errors if scores.errors is not None else [None] * len(scores)
        for status, error in zip(scores.status, errors):
            failed = int(status) >= RewardStatus.TIMEOUT
            self.recent.append(failed)
            if failed and self.first_error is None:
                self.first_error = error or RewardStatus(int(status)).name
            if not failed:
                self.first_error = None  # only a streak of failures matters

    def all_failed(self) -> bool:
        return len(self.recent) == self.recent.maxlen and all(self.recent)


class Rollouts:
    """Prompts in, scored trajectories out, with one Sampler and one tokenizer."""

    def __init__(
        self,
        config: ExperimentConfig,
        model: CausalLM,
        tokenizer: Any,
        task: Task,
        *,
        searcher_id: int = 0,
        mesh: Any = None,
        reward_pool: Any = None,
        reference_logprobs: bool = False,
    ):
        self.config = config
        self.tokenizer = tokenizer
        self.task = task
        self.searcher_id = searcher_id
        self.reward_pool = reward_pool
        sampling = config.rollout.sampling
        self.param_state = nnx.state(model, nnx.Param)  # shapes/shardings for param restores
        # The reference is the initial policy: a searcher can score it for free while it would
        # otherwise wait, sparing the trainer a forward pass (rollout.reference_logprobs).
        self.reference_logprobs = reference_logprobs
        self.sampler = Sampler(
            model,
            mesh=mesh,
            max_cache_length=config.rollout.max_prompt_tokens + sampling.max_new_tokens,
            reference=_frozen_copy(model) if reference_logprobs else None,
            first_decode_phase=config.rollout.first_decode_phase,
            share_prompt_cache=config.rollout.share_prompt_cache,
            fsdp_weights=config.rollout.fsdp_weights,
        )
        self._prompt_cache: dict[tuple[str, int], np.ndarray] = {}
        self.skipped_prompts = 0
        self.grades = GradeWatch(config.rollout.fail_fast_grades)
        self.scorer = build_scorer(task, ScorerContext(config=config, tokenizer=tokenizer, mesh=mesh,
                                                       reward_pool=reward_pool,
                                                       policy_checkpoint=config.model.checkpoint))
        self.stop_ids = set(
            sampling.stop_token_ids if sampling.stop_token_ids is not None else model.config.eos_token_ids
        )
        self._engine: ContinuousEngine | None = None

    @property
    def engine(self) -> ContinuousEngine | None:
        """The continuous-batching engine (rollout.engine=continuous; built on first use, so an
        evaluation-only Rollouts allocates no decode slots), else None."""
        r = self.config.rollout
        if r.engine == "continuous" and self._engine is None:
            self._engine = ContinuousEngine(
                self.sampler, r.sampling, slots=r.decode_slots, chunk=r.decode_chunk,
                max_prompt_tokens=r.max_prompt_tokens, share_prompt_cache=r.share_prompt_cache,
                prompt_pool=r.prompt_pool if r.share_prompt_cache else None, ring_tiers=r.ring_tiers)
        return self._engine

    def encode(self, problem: Problem, split: str = "train") -> np.ndarray:
        key = (split, problem.id)
        if key not in self._prompt_cache:
            text = self.task.prompt(problem, self.tokenizer)
            ids = self.tokenizer(text, add_special_tokens=not self.task.chat)["input_ids"]
            if len(ids) > self.config.rollout.max_prompt_tokens:
                raise PromptTooLongError(
                    f"prompt of problem {problem.id} has {len(ids)} tokens, more than "
                    f"rollout.max_prompt_tokens={self.config.rollout.max_prompt_tokens}; raise it"
                )
            self._prompt_cache[key] = np.asarray(ids, np.int32)
        return self._prompt_cache[key]

    def fits(self, problem: Problem, split: str = "train") -> bool:
        """Whether the problem's prompt fits rollout.max_prompt_tokens (over-long ones are skipped)."""
        try:
            self.encode(problem, split)
            return True
        except PromptTooLongError:
            return False

    def take_fitting(self, stream: "PromptStream", n: int) -> list[Problem]:
        """The next `n` problems whose prompts fit, counting the skipped ones."""
        out: list[Problem] = []
        while len(out) < n:
            for p in stream.take(n - len(out)):
                if self.fits(p):
                    out.append(p)
                else:
                    self.skipped_prompts += 1
                    if self.skipped_prompts in (1, 10, 100, 1000):
                        log.warning("skipped %d problems whose prompts exceed rollout.max_prompt_tokens=%d",
                                    self.skipped_prompts, self.config.rollout.max_prompt_tokens)
        return out

    def decode(self, tokens: np.ndarray) -> str:
        """Completion text without its stop token."""
        if len(tokens) and int(tokens[-1]) in self.stop_ids:
            tokens = tokens[:-1]
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def score(self, samples: Samples, key: jax.Array | None = None) -> Scores:
        """The task's scorer on one call's samples (a per-sample grader by default); feeds the
        fail-fast watch."""
        scores = self.scorer.score(samples, key)
        if len(scores) != len(samples):
            raise ValueError(f"task {self.task.name!r}: its scorer returned {len(scores)} scores for "
                             f"{len(samples)} samples")
        self.grades.add(scores)
        return scores

    def sample_and_score(
        self,
        problems: Sequence[Problem],
        sampling: SamplingConfig,
        key: jax.Array,
        split: str = "train",
        reference: bool = False,
    ) -> tuple[SampleOutput, Samples, Scores]:
        """Sample `sampling.num_samples` completions per problem and score them all."""
        prompts = [self.encode(p, split) for p in problems]
        out = self.sampler.sample(prompts, sampling, key, reference_logprobs=reference)
        index = [int(i) for i in out.prompt_index]
        responses = [np.asarray(out.response(i), np.int32) for i in range(len(out))]
        samples = Samples(
            problems=[problems[i] for i in index],
            prompt_tokens=[prompts[i] for i in index],
            response_tokens=responses,
            texts=[self.decode(r) for r in responses],
            finished=np.asarray(out.finished, bool),
            split=split,
        )
        return out, samples, self.score(samples, jax.random.fold_in(key, _SCORER_STREAM))

    def call_sampling(self, key: jax.Array) -> SamplingConfig:
        """This call's sampling config: `rollout.sampling`, at a temperature drawn from `key` when
        `rollout.random_temperature` is set (the red-teaming reference's exploration)."""
        sampling, rule = self.config.rollout.sampling, self.config.rollout.random_temperature
        if rule is None:
            return sampling
        low, high, prob = rule
        coin, draw = jax.random.split(jax.random.fold_in(key, _TEMPERATURE_STREAM))
        if not bool(jax.random.bernoulli(coin, prob)):
            return sampling
        return dataclasses.replace(sampling, temperature=float(jax.random.uniform(draw, (), minval=low, maxval=high)))

    def generate(
        self, problems: Sequence[Problem], key: jax.Array, *, version: int, first_group_id: int
    ) -> list[Trajectory]:
        """K' scored samples for each problem; rows of one problem share one group id. With
        rollout.engine=continuous the problems go through the engine's slots (the same samples
        as the static sampler for the same key: per-sample keys fold_in(key, row))."""
        if self.engine is not None:
            k = self.config.rollout.sampling.num_samples
            self.engine.version = version
            for pi, p in enumerate(problems):
                self.engine.submit(self.encode(p), request_keys(key, pi * k, k), tag=pi)
            groups = sorted(self.engine.run(), key=lambda g: g.tag)
            return self.trajectories(groups, [problems[g.tag] for g in groups], key,
                                     first_group_id=first_group_id)
        self._set_scorer_version(version)
        out, samples, scores = self.sample_and_score(
            problems, self.call_sampling(key), key, reference=self.reference_logprobs
        )
        n = len(samples)
        return self._rows(
            samples, scores,
            logprobs=[out.logprobs[i, : len(samples.response_tokens[i])] for i in range(n)],
            versions=[np.full(len(samples.response_tokens[i]), version, np.int32) for i in range(n)],
            reference=None if out.reference_logprobs is None else
            [out.reference_logprobs[i, : len(samples.response_tokens[i])] for i in range(n)],
            group_ids=[first_group_id + int(out.prompt_index[i]) for i in range(n)],
        )

    def trajectories(
        self, groups: Sequence[Completed], problems: Sequence[Problem], key: jax.Array, *,
        first_group_id: int, split: str = "train",
    ) -> list[Trajectory]:
        """Score finished continuous-engine groups (one scorer call; reference log-probs when
        configured) into rows; group g gets id first_group_id + g. policy_version of a sample is
        the version of its first (oldest) token."""
        k = self.config.rollout.sampling.num_samples
        idx = [(g, j) for g in range(len(groups)) for j in range(k)]
        responses = [groups[g].tokens[j] for g, j in idx]
        samples = Samples(
            problems=[problems[g] for g, _ in idx],
            prompt_tokens=[groups[g].prompt for g, _ in idx],
            response_tokens=responses,
            texts=[self.decode(r) for r in responses],
            finished=np.array([groups[g].finished[j] for g, j in idx], bool),
            split=split,
        )
        versions = [groups[g].token_versions[j] for g, j in idx]
        self._set_scorer_version(int(min(int(v.min()) for v in versions)))
        scores = self.score(samples, jax.random.fold_in(key, _SCORER_STREAM))
        reference = None
        if self.reference_logprobs:
            reference = self.sampler.reference_logprobs(samples.prompt_tokens, responses,
                                                        self.config.rollout.sampling)
        return self._rows(samples, scores, logprobs=[groups[g].logprobs[j] for g, j in idx],
                          versions=versions, reference=reference,
                          group_ids=[first_group_id + g for g, _ in idx])

    def _set_scorer_version(self, version: int) -> None:
        set_version = getattr(self.scorer, "set_policy_version", None)
        if set_version is not None:  # scorers with schedules (red-teaming's γ/τ) follow the policy
            set_version(version)

    def _rows(
        self, samples: Samples, scores: Scores, *, logprobs: Sequence[np.ndarray],
        versions: Sequence[np.ndarray], reference: Sequence[np.ndarray] | None, group_ids: Sequence[int],
    ) -> list[Trajectory]:
        now = time.time()
        rows = []
        for i in range(len(samples)):
            resp = samples.response_tokens[i]
            v = np.asarray(versions[i], np.int32)
            rows.append(
                Trajectory(
                    prompt_id=samples.problems[i].id,
                    group_id=group_ids[i],
                    prompt_tokens=samples.prompt_tokens[i],
                    response_tokens=resp,
                    behavior_logprobs=np.asarray(logprobs[i], np.float32),
                    reward=float(scores.reward[i]),
                    reward_status=RewardStatus(int(scores.status[i])),
                    extras=scores.extras_of(i) or None,
                    finished=bool(samples.finished[i]),
                    policy_version=int(v.min()),  # the oldest version: its first token
                    token_versions=v,
                    searcher_id=self.searcher_id,
                    wall_time=now,
                    reference_logprobs=None if reference is None else np.asarray(reference[i], np.float32),
                )
            )
        return rows

    def set_params(self, params: nnx.State) -> None:
        self.sampler.update_params(params)
        set_policy = getattr(self.scorer, "set_policy", None)
        if set_policy is not None:  # scorers that compare the policy's distribution (preference KL)
            set_policy(self.sampler.policy_model())


class PromptStream:
    """This searcher's shard of the training problems, reshuffled every epoch (deterministic).

    With fewer problems than searchers (red-teaming trains on one instruction) there is nothing to
    shard: every searcher streams all of them, and their own PRNG keys make their samples differ."""

    def __init__(self, problems: Sequence[Problem], shard: int, num_shards: int, seed: int, start: int = 0):
        if not len(problems):
            raise ValueError("the task has no training problems")
        self.problems = problems
        shared = len(problems) < num_shards
        self.indices = np.arange(len(problems)) if shared else np.arange(shard, len(problems), num_shards)
        self.seed = seed
        self.position = start
        self._epoch, self._order = -1, self.indices

    def order(self, epoch: int) -> np.ndarray:
        """The shard's problem order in `epoch`, drawn once per epoch: drawing it per problem
        permuted the whole shard (1M problems in the default task) for every prompt."""
        if epoch != self._epoch:
            self._epoch, self._order = epoch, np.random.default_rng((self.seed, epoch)).permutation(self.indices)
        return self._order

    def take(self, n: int) -> list[Problem]:
        out = []
        for _ in range(n):
            epoch, i = divmod(self.position, len(self.indices))
            out.append(self.problems[int(self.order(epoch)[i])])
            self.position += 1
        return out


def make_reward_pool(config: ExperimentConfig) -> Any:
    """A killable worker pool when the config asks for one (untrusted / slow graders), else None."""
    if config.rollout.reward_workers <= 0:
        return None
    from tbajax.tasks.reward_pool import RewardPool

    return RewardPool(config.rollout.reward_workers, config.rollout.reward_timeout_s)


def build_rollouts(
    config: ExperimentConfig,
    searcher_id: int,
    mesh: Any = None,
    model: CausalLM | None = None,
    reward_pool: Any = None,
) -> Rollouts:
    """Model, tokenizer, task and reward scoring of one searcher, from the config."""
    from tbajax.system.assets import load_task, load_tokenizer_for

    if model is None:
        model = load_model(
            config.model.checkpoint, mesh=mesh, param_dtype=config.model.param_dtype,
            dtype=config.model.dtype, attention=config.model.attention,
        )
    return Rollouts(
        config, model, load_tokenizer_for(config), load_task(config),
        searcher_id=searcher_id, mesh=mesh, reward_pool=reward_pool,
        reference_logprobs=config.rollout.reference_logprobs,
    )


def _frozen_copy(model: CausalLM) -> CausalLM:
    """A copy with its own buffers: the original's may be donated by a train step (sync mode)."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(lambda x: x.copy(), state))


def run_searcher(run_dir: Path, searcher_id: int, store_url: str | None = None) -> None:
    """The searcher process: load newest params, generate, score, append; until told to stop."""
    config = rundir.load_config(run_dir)
    store = store_url or str(run_dir)
    stop = rundir.StopFlag(run_dir)
    mesh = make_mesh(config.system.searcher_mesh)
    log.info("searcher %d: mesh %s over %d %s device(s)", searcher_id, dict(mesh.shape), mesh.size,
             mesh.devices.flat[0].platform)
    rollouts = build_rollouts(config, searcher_id, mesh, reward_pool=make_reward_pool(config))
    writer = TrajectoryWriter(trajectory_store_url(store, searcher_id), searcher_id)
    params_reader = ParamReader(param_store_url(store), f"searcher-{searcher_id}")
    metrics = MetricsWriter(run_dir, f"searcher-{searcher_id}", tensorboard=False,
                            wandb=open_wandb(config, run_dir, f"searcher-{searcher_id}"))
    problems = rollouts.task.load("train")
    committed = writer.committed_rows()
    stream = PromptStream(problems, searcher_id, config.system.num_searchers, config.seed,
                          start=committed // config.rollout.sampling.num_samples)  # problems already done
    version = 0
    resident = SearcherParams(rollouts.param_state, mesh, config.model.lora)  # LoRA: the base it keeps
    key = jax.random.fold_in(jax.random.PRNGKey(config.seed + 1000), searcher_id)
    calls = tokens = samples = 0
    t_start = time.time()
    log.info("searcher %d: %d train problems in its shard, resuming after %d rows", searcher_id, len(stream.indices), committed)
    if rollouts.engine is not None:
        _continuous_loop(config, run_dir, searcher_id, rollouts, stream, writer, params_reader, resident,
                         metrics, stop, key, committed)
        return
    calls_this_version = 0
    lead_limit = config.rollout.max_calls_per_version
    poll = PollBackoff(max_s=0.02)  # paused for a new version: noticed within milliseconds
    retry_s = 0.0  # backoff of ParamVersionError retries
    while not stop():
        latest = params_reader.latest_version()
        if latest is not None and latest > version:
            t0 = time.time()
            try:
                params = resident.load(params_reader, latest)
            except ParamVersionError as e:  # collected between pointer read and lease: take the next
                retry_s = min(5.0, 2 * retry_s or 0.1)
                log.warning("searcher %d: %s; retrying with the newest version in %.1f s", searcher_id, e, retry_s)
                time.sleep(retry_s)
                continue
            retry_s = 0.0
            rollouts.set_params(params)
            log.info("searcher %d: loaded params version %d in %.2fs", searcher_id, latest, time.time() - t0)
            version, calls_this_version = latest, 0
        if lead_limit is not None and calls_this_version >= lead_limit:
            poll.sleep()  # far enough ahead of the trainer: leave the devices to it
            continue
        poll.reset()
        calls_this_version += 1
        t0 = time.time()
        batch = rollouts.take_fitting(stream, config.rollout.prompts_per_call)
        rows = rollouts.generate(
            batch,
            jax.random.fold_in(key, committed + calls),
            version=version,
            first_group_id=(searcher_id << 40) + writer.committed_rows(),
        )
        t_append = time.time()
        writer.append(rows)
        append_s = time.time() - t_append
        if rollouts.grades.all_failed():
            stop_failing_grader(rollouts, searcher_id)
        calls += 1
        samples += len(rows)
        new_tokens = int(sum(len(r.response_tokens) for r in rows))
        tokens += new_tokens
        elapsed = time.time() - t0
        rewards = np.array([r.reward for r in rows])
        status = {
            "version": version,
            "calls": calls,
            "samples": samples,
            "tokens_per_s": new_tokens / max(elapsed, 1e-9),
            "reward_mean": float(rewards.mean()),
            "busy_s": time.time() - t_start,
        }
        rundir.write_status(run_dir, f"searcher-{searcher_id}", status)
        metrics.write(writer.committed_rows(), {**status, "generate_s": elapsed, "append_s": append_s,
                                                "failed_grades": sum(r.reward_status >= RewardStatus.TIMEOUT for r in rows)})
    metrics.close()
    params_reader.close()
    if rollouts.reward_pool is not None:
        rollouts.reward_pool.close()
    log.info("searcher %d: stopping after %d calls, %d samples", searcher_id, calls, samples)


def _load_prepared(engine: ContinuousEngine, resident: SearcherParams, reader: ParamReader,
                   version: int) -> PreparedParams:
    """The loader thread's work: read a published version and lay it out for serving, so that the
    decode loop's swap is only a swap."""
    return engine.prepare_params(resident.load(reader, version))


def _continuous_loop(
    config: ExperimentConfig, run_dir: Path, searcher_id: int, rollouts: Rollouts, stream: PromptStream,
    writer: TrajectoryWriter, params_reader: ParamReader, resident: SearcherParams, metrics: MetricsWriter,
    stop: Any, key: jax.Array, committed: int,
) -> None:
    """rollout.engine=continuous: prompts stream into the engine's slots; between decode chunks
    finished groups are scored and committed, and newly published params (loaded in a background
    thread while decoding goes on) are swapped in without dropping samples in flight.

    Groups are committed in stream order (a group that ends before an earlier one waits for it),
    so the store always holds a prefix of the stream and a restart resumes at committed // K, as
    the static loop does. Problem n of the stream (counted over the whole run) samples with
    fold_in(key, n), so a resumed searcher redraws exactly what it would have drawn."""
    import concurrent.futures

    engine = rollouts.engine
    assert engine is not None
    k = config.rollout.sampling.num_samples
    lead_limit = config.rollout.max_calls_per_version
    ppc = config.rollout.prompts_per_call
    depth = max(1, engine.slots // k)  # queued prompts kept ready for the next refill
    seq = committed // k  # stream index of the next problem to submit
    next_commit = seq
    problems_of: dict[int, Problem] = {}
    ready: dict[int, list[Trajectory]] = {}
    version = 0
    loads = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"param-load-{searcher_id}")
    loading: tuple[int, concurrent.futures.Future[Any], float] | None = None
    retry_at = 0.0
    retry_s = 0.0
    submitted_this_version = 0
    groups_done = samples = 0
    t_start = time.time()
    t_flush = time.time()
    poll = PollBackoff(max_s=0.02)  # paused for a new version: noticed within milliseconds
    try:
        while not stop():
            now = time.time()
            if loading is None and now >= retry_at:
                latest = params_reader.latest_version()
                if latest is not None and latest > version:
                    future = loads.submit(_load_prepared, engine, resident, params_reader, latest)
                    loading = (latest, future, now)
            if loading is not None and loading[1].done():
                latest, future, t0 = loading
                loading = None
                try:
                    params = future.result()
                except ParamVersionError as e:  # collected between pointer read and lease: take the next
                    retry_s = min(5.0, 2 * retry_s or 0.1)
                    retry_at = time.time() + retry_s
                    log.warning("searcher %d: %s; retrying with the newest version in %.1f s",
                                searcher_id, e, retry_s)
                else:
                    retry_s = 0.0
                    swap_s = engine.update_params(params, latest)
                    log.info("searcher %d: params version %d loaded and laid out for serving in %.2fs "
                             "(decoding went on), swapped in %.3fs", searcher_id, latest,
                             time.time() - t0 - swap_s, swap_s)
                    version, submitted_this_version = latest, 0
            paused = lead_limit is not None and submitted_this_version >= lead_limit * ppc
            while not paused and engine.pending < depth:
                for p in rollouts.take_fitting(stream, 1):
                    problems_of[seq] = p
                    keys = request_keys(jax.random.fold_in(key, seq), 0, k)
                    engine.submit(rollouts.encode(p), keys, tag=seq)
                    seq += 1
                    submitted_this_version += 1
                paused = lead_limit is not None and submitted_this_version >= lead_limit * ppc
            if engine.idle:
                poll.sleep()  # paused (far enough ahead of the trainer) and nothing in flight
                continue
            poll.reset()
            finished = engine.step()
            if finished:
                rows = rollouts.trajectories(finished, [problems_of[g.tag] for g in finished],
                                             jax.random.fold_in(key, finished[0].tag), first_group_id=0)
                by_group: dict[int, list[Trajectory]] = {}
                for g, r in zip((g.tag for g in finished for _ in range(k)), rows):
                    by_group.setdefault(g, []).append(r)
                ready.update(by_group)
                if rollouts.grades.all_failed():
                    stop_failing_grader(rollouts, searcher_id)
            out: list[Trajectory] = []
            while next_commit in ready:  # the store keeps a prefix of the stream (resume)
                base = (searcher_id << 40) + writer.committed_rows() + len(out) // k
                out.extend(dataclasses.replace(r, group_id=base) for r in ready.pop(next_commit))
                del problems_of[next_commit]
                next_commit += 1
            if not out:
                continue
            writer.append(out)
            groups_done += len(out) // k
            samples += len(out)
            new_tokens = int(sum(len(r.response_tokens) for r in out))
            elapsed = time.time() - t_flush
            t_flush = time.time()
            status = {
                "version": version,
                "calls": groups_done // ppc,
                "samples": samples,
                "tokens_per_s": new_tokens / max(elapsed, 1e-9),
                "reward_mean": float(np.mean([r.reward for r in out])),
                "busy_s": time.time() - t_start,
            }
            rundir.write_status(run_dir, f"searcher-{searcher_id}", status)
            metrics.write(writer.committed_rows(), {
                **status, "generate_s": elapsed, "slot_occupancy": engine.stats.occupancy(engine.slots),
                "swap_s": engine.stats.last_swap_s, "in_flight": engine.in_flight,
                **({"ring_moves": engine.stats.moves, "ring_pauses": engine.stats.pauses}
                   if engine.ring_tiers else {}),
                "mixed_version_samples": sum(r.mixed_versions for r in out),
                "failed_grades": sum(r.reward_status >= RewardStatus.TIMEOUT for r in out)})
    finally:
        loads.shutdown(wait=True, cancel_futures=True)
        metrics.close()
        params_reader.close()
        if rollouts.reward_pool is not None:
            rollouts.reward_pool.close()
    log.info("searcher %d: stopping after %d groups, %d samples (%d in flight dropped: not committed)",
             searcher_id, groups_done, samples, engine.in_flight)


EXIT_GRADER_FAILING = 3


def stop_failing_grader(rollouts: Rollouts, searcher_id: int) -> None:
    """Exit non-zero with the grader's error as the last log line (the launcher shows the tail)."""
    n = rollouts.grades.recent.maxlen
    first = (rollouts.grades.first_error or "").strip().splitlines()
    log.error(
        "searcher %d: the last %d grades of task %r all failed (ERROR/TIMEOUT), so the reward function is "
        "broken, not the samples; first error: %s. Fix the task's reward function (or raise "
        "rollout.fail_fast_grades if failures this long are expected)",
        searcher_id, n, rollouts.task.name, first[0] if first else "(none)",
    )
    raise SystemExit(EXIT_GRADER_FAILING)
