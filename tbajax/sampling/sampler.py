"""`Sampler`: the stateful edge around the pure core (compiled-function cache, params, mesh).

One call = prefill the unique prompts once, hold their cache rows once for their K samples (or
repeat them K times: `share_prompt_cache=False`), decode inside compiled `lax.while_loop`s,
optionally score the samples under a reference model, and hand back numpy arrays. Shapes are
bucketed (prompt batch to a power of two, prompt length to a power of two) so a long-running
searcher compiles a handful of programs, each logged once.

The policy is held only in its serving layout (`tbajax.models.serving.ServingParams`: per-layer
weights in the family's decode layout, the head vocab-major), built once per params version by
`update_params`, not inside every call; every program takes it as an argument, so publishing new
weights never recompiles.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tbajax.models import CausalLM, ModelConfig
from tbajax.models.serving import ServingParams, kv_cache_dtype, stacked_params
from tbajax.packing import PromptGroupRows, group_by_prompt, pack_prompt_groups, predicting_slots
from tbajax.sampling import core
from tbajax.sampling.config import SamplingConfig
from tbajax.shapes import next_pow2, pow2_bucket
from tbajax.sharding import (
    MeshConfig, fsdp_as_tensor, make_mesh, named_sharding, param_shardings, replicated_over,
)

log = logging.getLogger(__name__)

# Rows x tokens x vocab of fp32 logits one scoring chunk may materialise (~1 GiB).
_SCORE_LOGITS_BUDGET = 2**28


@dataclasses.dataclass(frozen=True)
class SampleOutput:
    """K samples per prompt, prompt-major (row = prompt * K + k), as host numpy arrays.

    logprobs are under the full tempered distribution softmax(logits / T) even when top-k/top-p
    truncated the sampling distribution; entries past `length` are 0 (tokens there are padding).
    """

    prompt_index: np.ndarray  # [N] int32: index into the prompts passed to `sample`
    tokens: np.ndarray  # [N, max_new_tokens] int32, pad_token_id after `length`
    length: np.ndarray  # [N] int32: response length, the stop token included
    finished: np.ndarray  # [N] bool: ended by a stop token (False: hit max_new_tokens)
    logprobs: np.ndarray  # [N, max_new_tokens] float32
    reference_logprobs: np.ndarray | None = None  # [N, max_new_tokens] float32, same layout

    @property
    def mask(self) -> np.ndarray:
        """[N, max_new_tokens] bool: which entries are response tokens."""
        return np.arange(self.tokens.shape[1])[None, :] < self.length[:, None]

    def __len__(self) -> int:
        return len(self.prompt_index)

    def response(self, i: int) -> np.ndarray:
        return self.tokens[i, : self.length[i]]


@dataclasses.dataclass(frozen=True)
class CompileEvent:
    kind: str  # "cache" (allocation) | "generate" (prefill + decode) | "score" (reference)
    shape: tuple[tuple[str, Any], ...]
    seconds: float


# ----------------------------------------------------------------------------- bucketing


def batch_bucket(num_prompts: int, num_samples: int, batch_shards: int) -> int:
    """Prompt rows to prefill: a power of two >= num_prompts, raised so that rows * K splits
    evenly over the mesh's batch shards."""
    step = batch_shards // math.gcd(batch_shards, num_samples)
    b = next_pow2(num_prompts)
    return -(-b // step) * step


def length_bucket(longest: int, limit: int, minimum: int) -> int:
    """Prompt slots: a power of two >= longest (at least `minimum`), capped at `limit`."""
    return pow2_bucket(longest, limit, minimum)


def packing_is_cheaper(cfg: ModelConfig, prompt: int, response: int, k: int) -> bool:
    """Whether scoring a prompt's K responses in one packed row (prompt once, then each response:
    `core.score_packed`) takes fewer FLOPs than K rows of prompt + response
    (`ModelConfig.layers_forward_flops`): rows skip the (query, key) pairs above the diagonal, a
    packed row computes them masked. A packed row is P + K*R tokens long, so it wins for short
    responses (the prompt is the bulk) and loses for long ones."""
    row, packed = prompt + response, prompt + k * response
    return cfg.layers_forward_flops(packed, packed**2) < k * cfg.layers_forward_flops(row, row**2 / 2)


# ----------------------------------------------------------------------------- the edge


class Sampler:
    """Samples from a `CausalLM` with compiled, bucketed, sharded programs.

    mesh: where params and the batch live (batch over data x fsdp, params by the logical rules;
      with fsdp > 1 see `fsdp_weights`); None = one device.
    max_cache_length: prompt + new tokens must fit (default: the model's max_position_embeddings).
    min_prompt_bucket: smallest prompt-length bucket.
    first_decode_phase: new tokens the decode loop writes into a cache of prompt + this many slots
      before it moves to a larger one (`core.phase_slots`; 0: one full-length cache from the start).
    share_prompt_cache: with K > 1 samples per prompt, cache each prompt's keys/values once and
      have its K samples' decode attention read them together (`serving.PromptCache`,
      `layers.attention_after_prompt`) instead of copying them into K rows (False: the copies).
    reference: an optional reference model for `sample(..., reference_logprobs=True)`.
    fsdp_weights: on a mesh with fsdp > 1, "whole" holds the serving weights whole along fsdp,
      gathered once per params version (`serving_shardings`); "tensor" samples on the same
      devices as a mesh whose fsdp devices are more tensor shards (`sharding.fsdp_as_tensor`:
      weights / (fsdp x tensor) a device, resharded once per version, batch over data only);
      "split" leaves them split as trained, all-gathered by every prompt pass and decode step.
    """

    def __init__(
        self,
        model: CausalLM,
        *,
        mesh: Mesh | None = None,
        max_cache_length: int | None = None,
        min_prompt_bucket: int = 16,
        reference: CausalLM | None = None,
        first_decode_phase: int = 64,
        share_prompt_cache: bool = True,
        fsdp_weights: Literal["whole", "tensor", "split"] = "whole",
    ):
        if fsdp_weights not in ("whole", "tensor", "split"):
            raise ValueError(f"fsdp_weights must be 'whole', 'tensor' or 'split', got {fsdp_weights!r}")
        for m in (model, reference):
            if m is not None and m.config.num_labels is not None:
                raise ValueError(
                    f"cannot sample from a sequence classifier ({m.config.model_type} with a "
                    f"num_labels={m.config.num_labels} score head); load a causal LM with load_model"
                )
        self.config: ModelConfig = model.config
        # model_mesh: where the caller's params live (`policy_model` returns them there); mesh: where
        # the sampler's programs run
        self.model_mesh = mesh if mesh is not None else make_mesh(MeshConfig(), devices=jax.devices()[:1])
        self.mesh = fsdp_as_tensor(self.model_mesh) if fsdp_weights == "tensor" else self.model_mesh
        self.max_cache_length = max_cache_length or self.config.max_position_embeddings
        if min_prompt_bucket < 1:
            raise ValueError(f"min_prompt_bucket must be >= 1, got {min_prompt_bucket}")
        self.min_prompt_bucket = min_prompt_bucket
        if first_decode_phase < 0:
            raise ValueError(f"first_decode_phase must be >= 0 (0: no phases), got {first_decode_phase}")
        self.first_decode_phase = first_decode_phase
        self.share_prompt_cache = share_prompt_cache
        self.batch_shards = self.mesh.shape.get("data", 1) * self.mesh.shape.get("fsdp", 1)
        # fp32 for a bf16 model on CPU devices, whatever JAX's default backend is
        self.cache_dtype = kv_cache_dtype(self.config, self.mesh.devices.flat[0].platform)
        self._policy = PreparedParams.from_model(model, self.mesh, whole_along_fsdp=fsdp_weights == "whole")
        self._reference = _Params.from_model(reference, self.mesh) if reference is not None else None
        fsdp, tensor = self.model_mesh.shape.get("fsdp", 1), self.model_mesh.shape.get("tensor", 1)
        if fsdp > 1:
            weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
            if fsdp_weights == "whole":
                log.info("sampler mesh has fsdp=%d: the sampler holds its weights whole along fsdp (~%.0f MB "
                         "a device, gathered once per params version), and each fsdp device decodes its "
                         "own rows", fsdp, weights / tensor / 2**20)
            elif fsdp_weights == "tensor":
                log.info("sampler mesh has fsdp=%d: the sampler runs on the same devices as tensor=%d "
                         "(~%.0f MB of weights a device, resharded once per params version), its batch "
                         "split over data=%d", fsdp, fsdp * tensor, weights / (fsdp * tensor) / 2**20,
                         self.mesh.shape["data"])
            else:
                log.warning(
                    "sampler mesh has fsdp=%d and fsdp_weights=split: every prompt pass and decode step "
                    "gathers the weights split over fsdp, ~%.0f MB onto each device per step; "
                    "fsdp_weights=whole or tensor (rollout.fsdp_weights) moves them once per params "
                    "version", fsdp, weights * (1 - 1 / fsdp) / tensor / 2**20)
        self._compiled: dict[tuple[Any, ...], Any] = {}
        self._cache: core.KVCache | None = None  # the last call's cache, reused when shapes match
        self.compile_events: list[CompileEvent] = []

    # -- state updates -------------------------------------------------------------------

    def prepare_params(self, model_or_state: CausalLM | nnx.State | dict) -> PreparedParams:
        """New policy weights (same architecture), checked, placed on the mesh and laid out for
        serving (a copy of every weight, `ServingParams`), without swapping them in: a loader
        thread can prepare a version while decoding goes on, and `update_params` then swaps it in
        at once. Waits until the layout is built."""
        prepared = self._policy.replace(model_or_state)
        jax.block_until_ready(prepared.params)
        return prepared

    def update_params(self, new: CausalLM | nnx.State | dict | PreparedParams) -> None:
        """Swap in new policy weights (same architecture; `prepare_params`' result, or weights to
        prepare now); compiled programs are kept, and every program reads the new serving layout
        from its next call."""
        if isinstance(new, PreparedParams):
            if new.layout is not self._policy.layout:
                raise ValueError("these params were prepared by another Sampler; prepare them with this one")
            self._policy = new
        else:
            self._policy = self.prepare_params(new)

    @property
    def serving_params(self) -> ServingParams:
        """The policy's current weights in their serving layout, placed on the mesh."""
        return self._policy.params

    def policy_model(self) -> CausalLM:
        """The policy with its current weights, rebuilt from the serving layout (a copy), on the
        mesh the sampler was given."""
        model = self._policy.model()
        if self.mesh is self.model_mesh:
            return model
        graphdef, state = nnx.split(model)
        return nnx.merge(graphdef, jax.device_put(state, param_shardings(state, self.model_mesh)))

    def set_reference(self, model: CausalLM | None) -> None:
        if model is not None and model.config.vocab_size != self.config.vocab_size:
            raise ValueError(
                f"reference vocab {model.config.vocab_size} != policy vocab {self.config.vocab_size}"
            )
        if model is None:
            self._reference = None
        elif self._reference is not None:
            self._reference = self._reference.replace(model)
        else:
            self._reference = _Params.from_model(model, self.mesh)

    # -- sampling --------------------------------------------------------------------------

    def sample(
        self,
        prompts: Sequence[Sequence[int] | np.ndarray],
        config: SamplingConfig,
        key: jax.Array,
        *,
        reference_logprobs: bool = False,
        max_new_per_row: Sequence[int] | np.ndarray | None = None,
    ) -> SampleOutput:
        """K = config.num_samples samples for each prompt (token id lists, unpadded).

        Sample row r (= prompt * K + k) draws its step s from fold_in(fold_in(key, r), s): its
        tokens depend only on that key (`tbajax.sampling.continuous` reproduces them).
        max_new_per_row: optional [prompts * K] cap on each row's new tokens (<= max_new_tokens),
        e.g. to give a benchmark a fixed length mix; a row at its cap is not `finished`.
        reference_logprobs: also score every sample under the reference model, each prompt once
        with its K responses packed behind it where that takes fewer FLOPs (`packing_is_cheaper`:
        short responses), else as K rows of prompt + response.

        Rows come back prompt-major (row = prompt * K + k). Bad input (empty or too long prompts,
        ids outside the vocabulary, a missing reference model) raises ValueError before any
        compile. The first call per shape bucket compiles (logged, and recorded in
        `compile_events`); later calls with the same buckets reuse the program.
        """
        cfg = self.config
        pad = config.pad_token_id if config.pad_token_id is not None else (cfg.pad_token_id or 0)
        stops = config.stop_token_ids if config.stop_token_ids is not None else cfg.eos_token_ids
        prompt_arrays = self._check_prompts(prompts, config, pad, stops)
        if reference_logprobs and self._reference is None:
            raise ValueError(
                "reference_logprobs=True needs a reference model: Sampler(..., reference=model) "
                "or sampler.set_reference(model)"
            )
        k = config.num_samples
        n_prompts = len(prompt_arrays)
        b = batch_bucket(n_prompts, k, self.batch_shards)
        longest = max(len(p) for p in prompt_arrays)
        p_len = length_bucket(longest, self.max_cache_length - config.max_new_tokens, self.min_prompt_bucket)
        # K > 1 samples of a prompt share its cached keys (`serving.PromptCache`) unless the
        # prompts do not split over the mesh's batch shards as their rows do
        shared = self.share_prompt_cache and k > 1 and b % self.batch_shards == 0
        prompt_slots = 0 if shared else p_len  # the per-sample buffers' prompt slots
        slots = prompt_slots + config.max_new_tokens
        tokens, mask = left_pad(prompt_arrays, b, p_len, pad)
        n = b * k
        active = np.arange(n) < n_prompts * k
        limit = np.full(n, config.max_new_tokens, np.int32)
        if max_new_per_row is not None:
            caps = np.asarray(max_new_per_row)
            if caps.shape != (n_prompts * k,) or caps.min() < 1 or caps.max() > config.max_new_tokens:
                raise ValueError(
                    f"max_new_per_row needs {n_prompts * k} entries (prompts x K) in [1, "
                    f"max_new_tokens={config.max_new_tokens}], got shape {caps.shape}"
                )
            limit[: n_prompts * k] = caps

        spec = core.DecodeSpec(
            max_new_tokens=config.max_new_tokens,
            top_k=config.top_k,
            use_top_p=config.top_p < 1.0,
            greedy=config.is_greedy,
            stop_token_ids=tuple(stops),
            pad_token_id=pad,
        )
        knobs = core.Knobs(
            temperature=self._put(np.float32(config.logprob_temperature), ()),
            top_p=self._put(np.float32(config.top_p), ()),
            min_new_tokens=self._put(np.int32(config.min_new_tokens), ()),
        )
        phases = core.phase_slots(prompt_slots, config.max_new_tokens, self.first_decode_phase)
        shape = (("batch", b), ("prompt_len", p_len), ("num_samples", k), ("spec", spec), ("phases", phases),
                 ("shared_prompt", shared))
        out, self._cache = self._run(
            ("generate", shape),
            lambda: _jit_generate(self.config, k, spec, phases),
            self._policy.params,
            self._take_cache(n, slots, (b, p_len) if shared else None),
            self._put(tokens, ("batch", "length")),
            self._put(mask, ("batch", "length")),
            self._put(active, ("batch",)),
            self._put_key(key),
            knobs,
            self._put(limit, ("batch",)),
        )
        real = n_prompts * k
        # the reference scores each prompt once, its K responses packed behind it, where that is cheaper
        packed = (reference_logprobs and k > 1 and b % self.batch_shards == 0
                  and packing_is_cheaper(cfg, p_len, config.max_new_tokens, k))
        ref = None
        if reference_logprobs and not packed:
            resp_mask = jnp.arange(config.max_new_tokens)[None, :] < out.lengths[:, None]
            ref = self._score_reference(
                np.repeat(tokens, k, axis=0), np.repeat(mask, k, axis=0), out.tokens, resp_mask,
                knobs.temperature,
            )
        host = jax.device_get(out)
        if ref is not None:
            ref = np.asarray(jax.device_get(ref))[:real]
        elif packed:
            new = config.max_new_tokens
            responses = [[host.tokens[i * k + j, : host.lengths[i * k + j]] for j in range(k)]
                         for i in range(n_prompts)]
            lp = self._score_reference_packed(prompt_arrays, responses, k, b, p_len, new, knobs.temperature)
            ref = lp[:n_prompts].reshape(real, new).astype(np.float32)  # 0 past each length
        return SampleOutput(
            prompt_index=(np.arange(real) // k).astype(np.int32),
            tokens=np.asarray(host.tokens[:real]),
            length=np.asarray(host.lengths[:real]),
            finished=np.asarray(host.finished[:real]),
            logprobs=np.asarray(host.logprobs[:real]),
            reference_logprobs=ref,
        )

    def reference_logprobs(
        self,
        prompts: Sequence[np.ndarray],
        responses: Sequence[np.ndarray],
        config: SamplingConfig,
    ) -> list[np.ndarray]:
        """Per-token log-probs of each (prompt, response) under the reference at the sampling
        temperature, as `sample(..., reference_logprobs=True)` computes them (the continuous engine
        scores its finished groups with this)."""
        if self._reference is None:
            raise ValueError(
                "reference log-probs need a reference model: Sampler(..., reference=model) "
                "or sampler.set_reference(model)"
            )
        if len(prompts) != len(responses) or not prompts:
            raise ValueError(f"need one response per prompt, got {len(prompts)} and {len(responses)}")
        pad = config.pad_token_id if config.pad_token_id is not None else (self.config.pad_token_id or 0)
        p_len = length_bucket(max(len(p) for p in prompts), self.max_cache_length - config.max_new_tokens,
                              self.min_prompt_bucket)
        new = config.max_new_tokens
        if max(map(len, responses)) > new:
            raise ValueError(f"a response is longer than max_new_tokens={new}")
        temperature = self._put(np.float32(config.logprob_temperature), ())
        groups = group_by_prompt(prompts)  # a prompt's K samples: scored packed behind it if cheaper
        k = max(config.num_samples, *map(len, groups))
        if k > 1 and len(groups) < len(prompts) and packing_is_cheaper(self.config, p_len, new, k):
            rows = batch_bucket(len(groups), 1, self.batch_shards)
            lp = self._score_reference_packed([np.asarray(prompts[g[0]]) for g in groups],
                                              [[np.asarray(responses[i]) for i in g] for g in groups],
                                              k, rows, p_len, new, temperature)
            out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(prompts)
            for gi, g in enumerate(groups):
                for j, i in enumerate(g):
                    out[i] = lp[gi, j * new : j * new + len(responses[i])].astype(np.float32)
            return out
        rows = batch_bucket(len(prompts), 1, self.batch_shards)
        tokens, mask = left_pad(prompts, rows, p_len, pad)
        resp = np.full((rows, config.max_new_tokens), pad, np.int32)
        resp_mask = np.zeros((rows, config.max_new_tokens), bool)
        for i, r in enumerate(responses):
            resp[i, : len(r)] = r
            resp_mask[i, : len(r)] = True
        ref = self._score_reference(tokens, mask, self._put(resp, ("batch", "length")),
                                    self._put(resp_mask, ("batch", "length")), temperature)
        host = np.asarray(jax.device_get(ref))
        return [host[i, : len(r)].astype(np.float32) for i, r in enumerate(responses)]

    def _score_reference(
        self, tokens: np.ndarray, mask: np.ndarray, response: jax.Array, resp_mask: jax.Array,
        temperature: Any,
    ) -> jax.Array:
        """Reference log-probs [N, R] of device `response` after the left-padded host prompts."""
        assert self._reference is not None
        n, p_len = tokens.shape
        r = response.shape[1]
        chunk = score_chunk(n, p_len + r, self.config.vocab_size, self.batch_shards)
        return self._run(
            ("score", (("rows", n), ("prompt_len", p_len), ("response_len", r), ("chunk", chunk))),
            lambda: _jit_score(self._reference, chunk),
            self._reference.leaves,
            self._put(tokens, ("batch", "length")),
            self._put(mask, ("batch", "length")),
            response,
            resp_mask,
            temperature,
        )

    def _score_reference_packed(
        self, prompts: list[np.ndarray], responses: list[list[np.ndarray]], k: int, groups: int,
        prompt_slots: int, new: int, temperature: Any,
    ) -> np.ndarray:
        """Reference log-probs [groups, k * new] of each prompt's (up to k) responses of up to
        `new` tokens, the prompt and its responses packed in one row (`pack_responses`);
        response j's token t at j * new + t, 0 past its length."""
        assert self._reference is not None
        rows, previous, targets, real = pack_responses(prompts, responses, k, new, groups,
                                                       prompt_slots + k * new)
        scored = k * new
        chunk = score_chunk(groups, scored, self.config.vocab_size, self.batch_shards)
        axes = ("batch", "length")
        lp = self._run(
            ("score_packed", (("groups", groups), ("width", rows.tokens.shape[1]), ("scored", scored),
                              ("chunk", chunk))),
            lambda: _jit_score_packed(self._reference, chunk),
            self._reference.leaves,
            *(self._put(x, axes) for x in (rows.tokens, rows.positions, rows.segments, previous, targets)),
            temperature,
        )
        return np.where(real, np.asarray(jax.device_get(lp)), 0.0)

    # -- helpers ---------------------------------------------------------------------------

    def _check_prompts(
        self, prompts: Sequence[Any], config: SamplingConfig, pad: int, stops: Sequence[int]
    ) -> list[np.ndarray]:
        vocab = self.config.vocab_size
        if not 0 <= pad < vocab:
            raise ValueError(f"pad_token_id={pad} is outside the vocabulary [0, {vocab})")
        bad = [s for s in stops if not 0 <= s < vocab]
        if bad:
            raise ValueError(f"stop token ids {bad} are outside the vocabulary [0, {vocab})")
        if config.top_k > vocab:
            raise ValueError(f"top_k={config.top_k} exceeds the vocabulary size {vocab}")
        if len(prompts) == 0:
            raise ValueError("sample() got no prompts")
        if config.max_new_tokens >= self.max_cache_length:
            raise ValueError(
                f"max_new_tokens={config.max_new_tokens} leaves no room for a prompt in the cache "
                f"of {self.max_cache_length} slots; lower it or raise Sampler(max_cache_length=...)"
            )
        arrays = [np.asarray(p, dtype=np.int64).reshape(-1) for p in prompts]
        limit = self.max_cache_length - config.max_new_tokens
        for i, a in enumerate(arrays):
            if a.size == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token (e.g. BOS)")
            if a.size > limit:
                raise ValueError(
                    f"prompt {i} has {a.size} tokens, but the cache holds {self.max_cache_length} "
                    f"and max_new_tokens={config.max_new_tokens} leaves room for {max(limit, 0)}; "
                    "truncate the prompt, lower max_new_tokens or raise Sampler(max_cache_length=...)"
                )
            if a.min() < 0 or a.max() >= vocab:
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab})")
        return [a.astype(np.int32) for a in arrays]

    def _put(self, x: Any, logical_axes: tuple[str, ...]) -> jax.Array:
        x = np.asarray(x)
        if not logical_axes:
            return jax.device_put(x, NamedSharding(self.mesh, P()))
        return jax.device_put(x, named_sharding(logical_axes, x.shape, self.mesh))

    def _take_cache(self, rows: int, slots: int, prompt: tuple[int, int] | None) -> core.KVCache:
        """The preallocated cache for this shape (the previous one if it fits; it is donated);
        prompt: (prompts, prompt slots) of its shared prompt part, or None for none."""
        cache, self._cache = self._cache, None
        held = None if cache is None or cache.prompt is None else (cache.prompt.rows, cache.prompt.slots)
        if cache is None or cache.rows != rows or cache.slots != slots or held != prompt:
            del cache  # free the old buffer before allocating the new one
            prompts, prompt_slots = prompt or (0, 0)
            cache = self._run(
                ("cache", (("rows", rows), ("slots", slots), ("prompt", prompt))),
                lambda: jax.jit(functools.partial(core.init_cache, self.config, rows, slots, prompts,
                                                  prompt_slots, dtype=self.cache_dtype)),
            )
        return cache

    def release_cache(self) -> None:
        """Drop the held KV cache (e.g. to free memory while the searcher idles)."""
        self._cache = None

    @property
    def cache_bytes(self) -> int:
        return 0 if self._cache is None else self._cache.nbytes()

    @property
    def cache_slots(self) -> int:
        """Slots per row of the last call's KV cache (its prompt bucket + max_new_tokens, the prompt
        part included when it is shared); 0 before any."""
        if self._cache is None:
            return 0
        return self._cache.slots + (0 if self._cache.prompt is None else self._cache.prompt.slots)

    def _put_key(self, key: jax.Array) -> jax.Array:
        if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32))
        return jax.device_put(key, NamedSharding(self.mesh, P()))

    def _run(self, key: tuple[Any, ...], build: Callable[[], Any], *args: Any) -> Any:
        """Call the program for `key`, compiling (ahead of time, logged) on first use."""
        compiled = self._compiled.get(key)
        if compiled is None:
            kind, shape = key
            t0 = time.perf_counter()
            with jax.set_mesh(self.mesh):
                compiled = build().lower(*args).compile()
            seconds = time.perf_counter() - t0
            self._compiled[key] = compiled
            self.compile_events.append(CompileEvent(kind, shape, seconds))
            log.info("sampler: compiled %s %s in %.2f s", kind, dict(shape), seconds)
        return compiled(*args)


def left_pad(
    prompts: Sequence[np.ndarray], rows: int, length: int, pad: int
) -> tuple[np.ndarray, np.ndarray]:
    """[rows, length] tokens and mask, prompts right-aligned; extra rows hold one pad token
    (masked real, so their attention is well defined; their samples are dropped)."""
    tokens = np.full((rows, length), pad, np.int32)
    mask = np.zeros((rows, length), bool)
    for i, p in enumerate(prompts):
        tokens[i, length - len(p) :] = p
        mask[i, length - len(p) :] = True
    mask[len(prompts) :, -1] = True
    return tokens, mask


def pack_responses(
    prompts: Sequence[np.ndarray], responses: Sequence[Sequence[np.ndarray]], k: int, new: int, groups: int,
    width: int,
) -> tuple[PromptGroupRows, np.ndarray, np.ndarray, np.ndarray]:
    """Prompt i and its responses (at most k, each at most `new` tokens) packed in row i of
    `groups` rows of `width` slots (`packing.pack_prompt_groups`), and per row, [groups, k * new]
    each with response j's token t at j * new + t: the slot of the hidden state that predicts it
    (`packing.predicting_slots`), the token, and whether that entry is a token (0 / False past a
    response's length)."""
    rows = pack_prompt_groups(prompts, responses, width, rows=groups)
    previous = np.zeros((groups, k, new), np.int32)
    targets = np.zeros((groups, k, new), np.int32)
    real = np.zeros((groups, k, new), bool)
    for i, starts in enumerate(rows.starts):
        for j, (start, answer) in enumerate(zip(starts, responses[i])):
            n = len(answer)
            previous[i, j, :n] = predicting_slots(len(prompts[i]), start, n)
            targets[i, j, :n] = answer
            real[i, j, :n] = True
    return rows, *(x.reshape(groups, k * new) for x in (previous, targets, real))


def score_chunk(rows: int, seq: int, vocab: int, batch_shards: int) -> int:
    """Largest row chunk that divides `rows`, is a multiple of `batch_shards` (when possible),
    and keeps a chunk's fp32 logits under budget."""
    best = None
    for c in range(rows, 0, -1):
        if rows % c or (c % batch_shards and c != rows):
            continue
        best = c
        if c * seq * vocab <= _SCORE_LOGITS_BUDGET:
            return c
    return best or rows


# ----------------------------------------------------------------------------- params + jit


@dataclasses.dataclass(frozen=True)
class _Params:
    """A model split once: static graphdef + treedef, each param's path, shape, dtype and
    sharding, and the param leaves placed on the mesh."""

    graphdef: Any
    treedef: Any
    paths: list[str]  # one per leaf, e.g. "['layers']['q_proj']"
    specs: list[jax.ShapeDtypeStruct]
    shardings: list[Any]
    leaves: list[jax.Array]

    @classmethod
    def from_model(cls, model: CausalLM, mesh: Mesh) -> _Params:
        graphdef, state = nnx.split(model)
        leaves, treedef = jax.tree.flatten(state)
        shardings = jax.tree.leaves(
            param_shardings(state, mesh), is_leaf=lambda s: isinstance(s, jax.sharding.Sharding)
        )
        paths = list(_flat_by_path(state))
        if len(paths) != len(leaves):
            raise ValueError("the model holds state besides its params; the sampler expects params only")
        specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
        return cls(graphdef, treedef, paths, specs, shardings, _place(leaves, shardings))

    def placed(self, model_or_state: Any) -> list[jax.Array]:
        """New weights for the same model, placed on the mesh: a CausalLM, an nnx.State of its
        params (e.g. restored from a checkpoint) or the matching pure dict. Matched by param path,
        shape and dtype."""
        state = model_or_state
        if isinstance(state, nnx.Module):
            state = nnx.state(state, nnx.Param)
        new = _flat_by_path(state)
        old = dict(zip(self.paths, self.specs))
        if set(new) != set(old) or any(
            new[k].shape != old[k].shape or new[k].dtype != old[k].dtype for k in old
        ):
            missing, extra = sorted(set(old) - set(new)), sorted(set(new) - set(old))
            raise ValueError(
                "new params do not match the sampler's model (different structure, shapes or "
                f"dtypes; missing {missing[:3]}, unexpected {extra[:3]}); build a new Sampler for "
                "a different architecture"
            )
        return _place([new[k] for k in self.paths], self.shardings)

    def replace(self, model_or_state: Any) -> _Params:
        return dataclasses.replace(self, leaves=self.placed(model_or_state))

    def model(self, leaves: list[jax.Array]) -> CausalLM:
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, leaves))


@dataclasses.dataclass(frozen=True)
class PreparedParams:
    """A params version as a sampler holds it (`Sampler.prepare_params`): its weights only in their
    serving layout, on the mesh (`params`), plus what checking, converting and rebuilding a version
    takes (`layout`: the model's own structure and param shardings, its leaves dropped; `convert`
    and `unconvert`, compiled once per sampler)."""

    config: ModelConfig
    mesh: Mesh
    layout: _Params
    convert: Any  # jitted: the model's param leaves -> ServingParams
    unconvert: Any  # jitted: ServingParams -> the model's params as a pure dict
    params: ServingParams

    @classmethod
    def from_model(cls, model: CausalLM, mesh: Mesh, whole_along_fsdp: bool = True) -> PreparedParams:
        layout = _Params.from_model(model, mesh)

        def to_serving(leaves: list[jax.Array]) -> ServingParams:
            return ServingParams.of(layout.model(leaves))

        convert = jax.jit(to_serving)
        if whole_along_fsdp and mesh.shape.get("fsdp", 1) > 1:
            # every decode step reads every weight: gathered over fsdp here, once per version, not
            # by every prompt pass and decode step (`serving_shardings`)
            with jax.set_mesh(mesh):
                as_trained = convert.lower(layout.leaves).compile().output_shardings
            convert = jax.jit(to_serving, out_shardings=serving_shardings(as_trained))
        with jax.set_mesh(mesh):
            params = convert(layout.leaves)
        unconvert = jax.jit(functools.partial(stacked_params, model.config))
        return cls(model.config, mesh, dataclasses.replace(layout, leaves=[]), convert, unconvert, params)

    def replace(self, model_or_state: Any) -> PreparedParams:
        leaves = self.layout.placed(model_or_state)
        with jax.set_mesh(self.mesh):
            return dataclasses.replace(self, params=self.convert(leaves))

    def model(self) -> CausalLM:
        with jax.set_mesh(self.mesh):
            stacked = self.unconvert(self.params)
        flat = _flat_by_path(stacked)
        return self.layout.model(_place([flat[k] for k in self.layout.paths], self.layout.shardings))


def serving_shardings(as_trained: Any) -> Any:
    """Where a sampler holds its serving weights, given where the model's layout would put them:
    replicated over the mesh's fsdp axis (still split over tensor). Sampling reads every weight
    at every token, so weights split over fsdp would be all-gathered by every prompt pass and
    decode step; held whole along fsdp, each fsdp device decodes its own batch rows with them,
    and the gather happens once per params version (`PreparedParams`)."""
    return jax.tree.map(lambda s: replicated_over(s, "fsdp"), as_trained,
                        is_leaf=lambda s: isinstance(s, NamedSharding))


def _flat_by_path(tree: Any) -> dict[str, Any]:
    """Leaves keyed by path, with nnx.Variable's own `.value` step dropped (so a State and its
    pure dict match)."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key = jax.tree_util.keystr(path)
        out[key.removesuffix(".value")] = leaf
    return out


def _place(leaves: list[Any], shardings: list[Any]) -> list[jax.Array]:
    return [jax.device_put(x, s) for x, s in zip(leaves, shardings)]


def _jit_generate(cfg: ModelConfig, num_samples: int, spec: core.DecodeSpec, phases: tuple[int, ...]) -> Any:
    """Prefill + decode as one program over the serving params; the full-length cache (the last
    of `phases`, `core.phase_slots`) is donated and comes back updated in place. Decoding starts
    over the smaller caches, made inside the program."""

    def fn(params, cache, tokens, mask, active, key, knobs, limit):  # type: ignore[no-untyped-def]
        if phases[-1] != cache.slots:
            raise ValueError(f"cache has {cache.slots} slots, the phases end at {phases[-1]}")
        caches = (*(core.init_cache(cfg, cache.rows, s, dtype=cache.dtype) for s in phases[:-1]), cache)
        start = dataclasses.replace(caches[0], prompt=cache.prompt)  # one prompt part for every phase
        first, first_logits, prompt_len = core.prefill(cfg, params, start, tokens, mask,
                                                       num_samples=num_samples)
        return core.decode(cfg, params, first, first_logits, prompt_len, active, key, knobs, spec, limit,
                           larger=caches[1:])

    return jax.jit(fn, donate_argnums=(1,))


def _jit_score_packed(params: _Params, chunk: int) -> Any:
    def fn(leaves, *packed):  # type: ignore[no-untyped-def]
        return core.score_packed(params.model(leaves), *packed, chunk=chunk)  # packed rows, temperature

    return jax.jit(fn)


def _jit_score(params: _Params, chunk: int) -> Any:
    def fn(leaves, prompt, prompt_mask, response, response_mask, temperature):  # type: ignore[no-untyped-def]
        return core.score(
            params.model(leaves), prompt, prompt_mask, response, response_mask, temperature, chunk=chunk
        )

    return jax.jit(fn)
