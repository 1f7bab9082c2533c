"""The pure sampling core: prefill and the decode loop as functions of (config, the policy's
`ServingParams`, arrays), and scoring as a function of (model, arrays).

Nothing here holds state or does I/O; `tbajax.sampling.sampler.Sampler` jits these once per shape
bucket with the config (or the model's graphdef) static and the weights passed as arguments.

Layout: prompts are LEFT-padded to P slots, so every row's next token is written at the same
cache slot (`KVCache.index`); a row's position ids skip its padding (cumsum(mask) - 1). Response
token j of a row sits at position `prompt_len + j` and cache slot `P + j`, or slot j when the
prompts' keys are held once per prompt in the cache's prompt part (K > 1 samples each).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from tbajax import op_scopes as S
from tbajax.batch import tempered_logprobs
from tbajax.models import CausalLM, ModelConfig, positions_from_mask, serving
from tbajax.models.decoder import packed_mask
from tbajax.models.layers import cache_values
from tbajax.models.serving import KVCache, ServingParams
from tbajax.op_scopes import scoped
from tbajax.sampling.step import sample_keys, sample_logits, step_keys
from tbajax.sharding import along_rows, constrain

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """The static (compile-time) part of a sampling config; the rest is traced."""

    max_new_tokens: int
    top_k: int
    use_top_p: bool
    greedy: bool
    stop_token_ids: tuple[int, ...]
    pad_token_id: int


class DecodeOut(NamedTuple):
    tokens: Array  # [N, max_new] int32, pad after the stop token
    logprobs: Array  # [N, max_new] f32 under softmax(logits / T); 0 after the stop token
    lengths: Array  # [N] int32 response lengths (stop token included)
    finished: Array  # [N] bool: ended by a stop token (not by max_new_tokens)


class Knobs(NamedTuple):
    """Traced sampling controls: changing them does not recompile."""

    temperature: Array  # f32 scalar > 0
    top_p: Array  # f32 scalar in (0, 1]
    min_new_tokens: Array  # int32 scalar


@scoped(S.PREFILL)
def prefill(
    cfg: ModelConfig, params: ServingParams, cache: KVCache, tokens: Array, mask: Array, *, num_samples: int
) -> tuple[KVCache, Array, Array]:
    """Run the prompts [B, P] once (`serving.prompt_pass`) and write their keys/values into the
    preallocated `cache` ([B*K] rows, pass it donated: the writes then happen in place): into its
    prompt part once per prompt when it has one (`serving.PromptCache`, P slots; the per-sample
    buffers then start empty), else repeated K times per prompt into the first P slots. Every
    later slot is marked invalid and its values zeroed: a masked slot's weight is exactly 0, but
    0 x NaN is not, so a non-finite value an earlier call left there must not stay (its keys may:
    masking selects their scores away).

    Returns the cache, the next-token logits [B*K, V] and the real prompt lengths [B*K]; rows are
    prompt-major (row = prompt * K + k).
    """
    b, p = tokens.shape
    if cache.rows != b * num_samples:
        raise ValueError(f"cache has {cache.rows} rows, need {b} prompts x {num_samples} samples")
    shared = cache.prompt
    if shared is not None and (shared.rows, shared.slots) != (b, p):
        raise ValueError(f"the cache's prompt part holds {shared.rows} x {shared.slots}, "
                         f"the prompts are {b} x {p}")
    mask = mask.astype(bool)
    last, keys, values = serving.prompt_pass(cfg, params, tokens, mask, positions_from_mask(mask))
    logits = serving.logits(cfg, params, last)  # left padding: the last column is every row's last token

    def rep(x: Array) -> Array:
        return jnp.repeat(x, num_samples, axis=0) if num_samples > 1 else x

    def put(buf: Array, x: Array, axes: tuple[str, ...]) -> Array:
        return constrain(jax.lax.dynamic_update_slice(buf, cache_values(x, buf.dtype), (0,) * x.ndim), axes)

    if shared is not None:
        prompt = serving.PromptCache(
            k=tuple(put(buf, x, KVCache.K_AXES) for buf, x in zip(shared.k, keys)),
            v=tuple(put(buf, x, KVCache.V_AXES) for buf, x in zip(shared.v, values)),
            valid=put(shared.valid, mask, ("batch", "length")),
        )
        cache = KVCache(
            k=cache.k,
            v=tuple(constrain(jnp.zeros_like(buf), KVCache.V_AXES) for buf in cache.v),
            valid=constrain(jnp.zeros_like(cache.valid), ("batch", "length")),
            index=jnp.asarray(0, jnp.int32),
            prompt=prompt,
        )
    else:
        valid = jnp.zeros((b, cache.slots), bool).at[:, :p].set(mask)
        cache = KVCache(
            k=tuple(put(buf, rep(x), KVCache.K_AXES) for buf, x in zip(cache.k, keys)),
            v=tuple(put(_zero_from(buf, p), rep(x), KVCache.V_AXES) for buf, x in zip(cache.v, values)),
            valid=put(cache.valid, rep(valid), ("batch", "length")),
            index=jnp.asarray(p, jnp.int32),
        )
    return cache, constrain(rep(logits), ("batch", "act_vocab")), rep(mask.sum(-1, dtype=jnp.int32))


def _zero_from(values: Array, slot: int) -> Array:
    """A value buffer [rows, kv, slots, d] with slots >= `slot` zeroed."""
    rows, kv, slots, d = values.shape
    tail = jnp.zeros((rows, kv, slots - slot, d), values.dtype)
    return jax.lax.dynamic_update_slice(values, tail, (0, 0, slot, 0))


MAX_DECODE_PHASES = 4


def phase_slots(prompt_slots: int, max_new_tokens: int, first: int) -> tuple[int, ...]:
    """Slot counts of the caches one decode call moves through (`decode`'s `larger`).

    Attention reads every slot of its cache at every step, filled or not, so a loop over the
    full-length cache spends its early steps on empty slots. Starting over prompt + `first` slots
    and doubling the new-token room halves that waste per phase, for one cache copy and one more
    compiled loop body each. A phase is added only if it runs at least half as many steps as all
    phases before it, so a short tail does not cost a copy; at most MAX_DECODE_PHASES (the
    smallest go first), so a long generation compiles a bounded number of loop bodies.
    first <= 0: one full-length cache."""
    full = prompt_slots + max_new_tokens
    if first <= 0:
        return (full,)
    sizes, room = [], first
    while room + room // 2 <= max_new_tokens:
        sizes.append(prompt_slots + room)
        room *= 2
    return (*sizes[max(0, len(sizes) + 1 - MAX_DECODE_PHASES):], full)


def grow_cache(small: KVCache, big: KVCache) -> KVCache:
    """`small`'s slots copied into the first slots of `big` (pass it donated: written in place);
    its later slots are marked invalid and their values zeroed (see `prefill`)."""
    s = small.slots
    if big.rows != small.rows or big.slots <= s:
        raise ValueError(f"cannot grow a cache of {small.rows} x {s} slots into {big.rows} x {big.slots}")

    def put(buf: Array, x: Array, axes: tuple[str, ...]) -> Array:
        return constrain(jax.lax.dynamic_update_slice(buf, x, (0,) * x.ndim), axes)

    return KVCache(
        k=tuple(put(b, x, KVCache.K_AXES) for b, x in zip(big.k, small.k)),
        v=tuple(put(_zero_from(b, s), x, KVCache.V_AXES) for b, x in zip(big.v, small.v)),
        valid=put(jnp.zeros_like(big.valid), small.valid, ("batch", "length")),
        index=small.index,
        prompt=small.prompt,  # held once; the bigger cache's own prompt part, if any, is not read
    )


def init_cache(cfg: ModelConfig, rows: int, slots: int, prompts: int = 0, prompt_slots: int = 0,
               pool_samples: int = 0, dtype: Any = None) -> KVCache:
    """An empty cache laid out over the mesh like the one `prefill` returns; with prompts > 0, a
    prompt part of `prompts` x `prompt_slots` for rows that are K = rows / prompts samples each,
    or with pool_samples = K > 0 a pool of that many prompts that any row may continue
    (`serving.PromptCache.pool`, continuous batching). dtype: the buffers' (None:
    `serving.kv_cache_dtype` on JAX's default backend)."""
    cache = KVCache.init(cfg, rows, slots, dtype)
    prompt = None
    if prompts:
        if pool_samples:
            part = serving.PromptCache.pool(cfg, prompts, prompt_slots, pool_samples, rows, dtype)
        elif rows % prompts:
            raise ValueError(f"{rows} rows are not K samples of each of {prompts} prompts")
        else:
            part = serving.PromptCache.init(cfg, prompts, prompt_slots, dtype)
        prompt = dataclasses.replace(
            part,
            k=tuple(constrain(x, KVCache.K_AXES) for x in part.k),
            v=tuple(constrain(x, KVCache.V_AXES) for x in part.v),
            valid=constrain(part.valid, ("batch", "length")),
        )
    return KVCache(
        k=tuple(constrain(x, KVCache.K_AXES) for x in cache.k),
        v=tuple(constrain(x, KVCache.V_AXES) for x in cache.v),
        valid=constrain(cache.valid, ("batch", "length")),
        index=cache.index,
        prompt=prompt,
    )


@scoped(S.DECODE)
def decode(
    cfg: ModelConfig,
    params: ServingParams,
    cache: KVCache,
    first_logits: Array,
    prompt_len: Array,
    active: Array,
    key: Array,
    knobs: Knobs,
    spec: DecodeSpec,
    limit: Array | None = None,
    larger: tuple[KVCache, ...] = (),
) -> tuple[DecodeOut, KVCache]:
    """Sample up to max_new_tokens per row inside `lax.while_loop`s that exit as soon as every
    row is done. Inactive rows (batch padding) start done and emit only padding.

    The loop runs over `cache` until it is full, then over each of the `larger` caches in turn
    (`grow_cache`; see `phase_slots` for why). The last cache comes back (pass them donated: the
    loop then updates it in place and the caller can reuse it); it needs room for every token.

    Row r's step-s draw uses fold_in(fold_in(key, r), s) (`step.step_keys`), so a sample's tokens
    depend only on its key, not on the batch it is in. limit: optional [N] int32 per-row cap on new
    tokens (<= max_new_tokens; a row at its cap is done, not finished)."""
    n, vocab = first_logits.shape
    rows = jnp.arange(n, dtype=jnp.int32)
    keys = sample_keys(key, rows)
    if limit is None:
        limit = jnp.full((n,), spec.max_new_tokens, jnp.int32)
    pick = functools.partial(pick_tokens, knobs=knobs, spec=spec)

    def emit(out: DecodeOut, tok: Array, lp: Array, step: Array) -> tuple[DecodeOut, Array]:
        """Write step's token (pad for done rows); return the new outputs and the written token."""
        done = out.finished | ~active | (out.lengths >= limit)
        tok = jnp.where(done, spec.pad_token_id, tok)
        lp = jnp.where(done, 0.0, lp)
        stopped = ~done & is_stop(tok, spec)
        out = DecodeOut(
            tokens=jax.lax.dynamic_update_slice(out.tokens, tok[:, None], (0, step)),
            logprobs=jax.lax.dynamic_update_slice(out.logprobs, lp[:, None], (0, step)),
            lengths=out.lengths + (~done).astype(jnp.int32),
            finished=out.finished | stopped,
        )
        return out, tok

    def all_done(out: DecodeOut) -> Array:
        return jnp.all(out.finished | ~active | (out.lengths >= limit))

    empty = DecodeOut(
        tokens=constrain(
            jnp.full((n, spec.max_new_tokens), spec.pad_token_id, jnp.int32), ("batch", "length")
        ),
        logprobs=constrain(jnp.zeros((n, spec.max_new_tokens), jnp.float32), ("batch", "length")),
        lengths=jnp.zeros((n,), jnp.int32),
        finished=jnp.zeros((n,), bool),
    )
    step0 = jnp.zeros((), jnp.int32)
    out, tok = emit(empty, *pick(first_logits, step_keys(keys, step0), step0), step0)
    ones = jnp.ones((n, 1), bool)

    def cond(carry: tuple[Array, KVCache, Array, DecodeOut]) -> Array:
        step, cache, _, out = carry
        return (step < spec.max_new_tokens) & (cache.index < cache.slots) & ~all_done(out)

    def body(carry: tuple[Array, KVCache, Array, DecodeOut]) -> tuple[Array, KVCache, Array, DecodeOut]:
        step, cache, prev, out = carry
        positions = (prompt_len + step - 1)[:, None]
        hidden, cache = serving.cached_pass(cfg, params, prev[:, None], positions, ones, cache)
        logits = serving.logits(cfg, params, hidden[:, 0])
        out, tok = emit(out, *pick(logits, step_keys(keys, step), step), step)
        return step + 1, cache, tok, out

    step, cache, tok, out = jax.lax.while_loop(cond, body, (step0 + 1, cache, tok, out))
    for bigger in larger:
        step, cache, tok, out = jax.lax.while_loop(cond, body, (step, grow_cache(cache, bigger), tok, out))
    return out._replace(finished=out.finished & active), cache


def is_stop(tokens: Array, spec: DecodeSpec) -> Array:
    """[N] bool: which tokens are stop ids."""
    stop_ids = jnp.asarray(spec.stop_token_ids, jnp.int32).reshape(-1)
    return (tokens[:, None] == stop_ids[None, :]).any(-1)


@scoped(S.SAMPLING)
def pick_tokens(
    logits: Array, keys: Array, steps: Array, *, knobs: Knobs, spec: DecodeSpec
) -> tuple[Array, Array]:
    """One token per row from its step key (`step.step_keys`); stop ids are banned while a row's
    step (tokens generated before this one; [N] or a scalar) is below min_new_tokens."""
    vocab = logits.shape[-1]
    stop_ids = jnp.asarray(spec.stop_token_ids, jnp.int32).reshape(-1)
    stop_vocab = jnp.zeros((vocab,), bool).at[stop_ids].set(True)
    early = jnp.asarray(steps < knobs.min_new_tokens)
    banned = stop_vocab & (early[:, None] if early.ndim else early)
    return sample_logits(
        None,
        logits,
        temperature=knobs.temperature,
        top_k=spec.top_k,
        top_p=knobs.top_p if spec.use_top_p else None,
        greedy=spec.greedy,
        banned=banned,
        keys=keys,
    )


def score(
    model: CausalLM,
    prompt: Array,
    prompt_mask: Array,
    response: Array,
    response_mask: Array,
    temperature: Array,
    *,
    chunk: int,
) -> Array:
    """Log-probs [N, R] of `response` after the left-padded `prompt` under softmax(logits / T),
    0 off `response_mask`. One batched forward over `prompt + response`, in row chunks of `chunk`
    (strided, so each chunk spans every data shard) to bound the [rows, R, vocab] logits."""
    p, r = prompt.shape[1], response.shape[1]
    tokens = jnp.concatenate([prompt, response], axis=1)
    mask = jnp.concatenate([prompt_mask, response_mask], axis=1).astype(bool)

    def one(args: tuple[Array, Array]) -> Array:
        t, m = args
        hidden, _ = model.hidden_states(t, attention_mask=m)
        # logits at slot p-1+j predict response token j
        logits = model.logits(hidden[:, p - 1 : p + r - 1])
        return tempered_logprobs(logits, t[:, p:], jnp.asarray(temperature, jnp.float32))

    return jnp.where(response_mask, _in_row_chunks(one, (tokens, mask), chunk), 0.0)


def _in_row_chunks(one: Any, xs: tuple[Array, ...], chunk: int) -> Array:
    """one(xs) [n, ...] computed `chunk` rows at a time (a loop over n / chunk strided chunks:
    row i*m + j goes to step j, so each chunk spans every data shard)."""
    n = xs[0].shape[0]
    if chunk >= n:
        return one(xs)
    m = n // chunk
    out = jax.lax.map(one, tuple(x.reshape(chunk, m, *x.shape[1:]).swapaxes(0, 1) for x in xs))
    return out.swapaxes(0, 1).reshape(n, *out.shape[2:])


def score_packed(
    model: CausalLM,
    tokens: Array,
    positions: Array,
    segments: Array,
    previous: Array,
    targets: Array,
    temperature: Array,
    *,
    chunk: int,
) -> Array:
    """Log-probs [G, S] of `targets` under softmax(logits / T), each predicted by the hidden state
    at its `previous` slot, for rows that pack a prompt and its K responses (`tbajax.packing`:
    tokens, positions, segments [G, W]; every response attends to the prompt and itself only).
    The prompt runs once per group instead of once per sample. Row chunks of `chunk` as `score`."""

    def one(args: tuple[Array, ...]) -> Array:
        t, pos, seg, prev, tgt = args
        hidden, _ = model.hidden_states(t, pos, packed_mask(seg))
        picked = along_rows(hidden, prev)  # [rows, S, D]
        return tempered_logprobs(model.logits(picked), tgt, jnp.asarray(temperature, jnp.float32))

    return _in_row_chunks(one, (tokens, positions, segments, previous, targets), chunk)
