"""Continuous batching with in-flight weight updates: a fixed set of decode slots that never drains.

The static sampler (`Sampler.sample`) decodes a whole bucket until its longest row ends, so with
mixed response lengths most rows idle most of the time. Here a fixed number of decode *slots*
runs a compiled chunk of C decode steps at a time; between chunks the host harvests the rows that
ended and refills their slots with the next (prompt, sample) at once, and may swap the params.

Cache layout (one shared write index, as `KVCache` has): the cache is a **ring** of
S = P_max + max_new_tokens slots whose write index advances mod S with every decode step. A
newcomer's prompt is prefilled on its own (positions 0..len-1, RoPE applied before caching) and
its keys/values are written into its row at the P_bucket slots that end at the current index,
`valid` set for its real prompt tokens only; its generated tokens then follow at the ring index.
A single-token step attends to every valid slot of its row (`serving.cached_pass`), and
attention is order-invariant given the mask, so a row's logits are those of a linear cache. A row
writes at most P_bucket + max_new - 1 slots before it ends, fewer than S, so the ring never
overwrites live history.

Shared prompts (`share_prompt_cache`, K > 1): a prompt's keys/values go once into an entry of a
*prompt pool* (`serving.PromptCache.pool`) instead of K times into its rows, and the ring holds
generated tokens only (S = max_new_tokens). A sample's slot need not sit next to its siblings, so
two small tables say who is where: the pool entry's K sample rows and each row's entry. A decode
step gathers each entry's K queries (a few KB), reads the entry's keys/values once, and gathers
the results back to the rows (`layers.attention_after_prompt`). The pool is read whole at every
step, so it is sized to the prompts in flight (`default_prompt_pool`), not to the slots: a
prompt is admitted when K slots and an entry are free, and its entry is freed with its last
sample. For long prompts this halves the cache and reads fewer bytes per step
(`experiments/benchmarks/continuous_shared_prompt.py`). On a mesh with D batch shards, each
shard holds 1/D of the entries and of the rows, and a prompt's entry and its K rows are on one
shard (the host admits a prompt into a shard with K free rows and a free entry, and a ring-tier
move stays within its shard), so a decode step moves no rows between devices.

Ring tiers (`ring_tiers`): a ring of S slots for every row makes every decode step read S slots
per row, however short the row's history; with long, spread-out response lengths most rows are
young and short. The rows can instead be split into tiers with rings of their own lengths
(`serving.TieredKVCache`; each tier has its own write index): a row's attention reads its tier's
ring. A sample is admitted into the shortest tier that holds it for a chunk; between chunks, one
that its ring would not hold for the next chunk moves to a free row of a longer tier (its history
is copied once, in order, ending at the new ring's index: `move_rows`), or, if none is free,
pauses (keeps its row, writes and generates nothing) until one frees. The longest tier holds any
history, so its samples always run to the end and free rows: nothing waits forever. Tokens and
log-probs do not depend on the tiers (attention over a row's valid slots is order-invariant).

Randomness: every sample has its own key and draws its step-s token from fold_in(key, s), exactly
as the static sampler's row keys do, so for the same per-sample keys both engines give the same
tokens and log-probs whatever slot or batch a sample lands in.

In-flight weight updates: params are program arguments (in their serving layout, built once per
version by `update_params`, not by every chunk), so `update_params` between chunks swaps them
without a recompile and without dropping the sequences in flight. Their cached keys/values
from the old version are kept (recomputing them would cost a prefill of every live row); each
token records the version whose forward produced its logits (`token_versions`), so a sample that
straddles a swap carries tokens of both versions, and its log-probs are those the model that
sampled each token assigned (with the old version's cache for the earlier history).

Programs: one prefill+admit program per (admitted prompts, prompt-length) bucket and ONE decode
chunk program, whose shapes depend only on (slots, S, C) (and the tiers): a new prompt-length
bucket never recompiles the decode chunk, and how full the slots are is a mask, not a shape. With
tiers, one small move program per (from, to, moved rows) bucket.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tbajax.models import ModelConfig, positions_from_mask, serving
from tbajax.models.layers import cache_values
from tbajax.models.serving import KVCache, PromptCache, ServingParams, TieredKVCache
from tbajax.sampling import core
from tbajax.sampling.config import SamplingConfig
from tbajax.sampling.sampler import PreparedParams, Sampler, left_pad, length_bucket
from tbajax.sampling.step import step_keys
from tbajax.shapes import next_pow2
from tbajax.sharding import batch_shards, constrain, shard_rows, within_batch_shards

log = logging.getLogger(__name__)

Array = jax.Array


class SlotState(NamedTuple):
    """Per-slot decode state on the device (slots that hold no sample have live=False)."""

    prev: Array  # [N] int32: the last sampled token, the next step's input
    position: Array  # [N] int32: position id of `prev`
    count: Array  # [N] int32: tokens generated so far (the next draw's step)
    live: Array  # [N] bool: still generating
    finished: Array  # [N] bool: ended by a stop token
    keys: Array  # [N] per-sample PRNG keys
    limit: Array  # [N] int32: cap on new tokens


class ChunkOut(NamedTuple):
    tokens: Array  # [N, C] int32, pad where not emitted
    logprobs: Array  # [N, C] f32, 0 where not emitted
    emitted: Array  # [N, C] bool


class AdmitOut(NamedTuple):
    tokens: Array  # [B*K] int32: each admitted sample's first token (step 0)
    logprobs: Array  # [B*K] f32


# ----------------------------------------------------------------------------- pure programs


def init_state(rows: int, key: Array) -> SlotState:
    """All slots empty (`key` only gives the key array its type)."""
    zeros = jnp.zeros((rows,), jnp.int32)
    return SlotState(
        prev=zeros, position=zeros, count=zeros,
        live=jnp.zeros((rows,), bool), finished=jnp.zeros((rows,), bool),
        keys=jnp.broadcast_to(key, (rows,)), limit=zeros,
    )


def ring_sources(index: Array, ring: int, prompt_slots: int) -> Array:
    """[ring] prompt column each ring slot takes so the prompt's P columns end at slot index - 1
    (mod ring); >= P for slots that get no prompt column."""
    return jnp.mod(jnp.arange(ring) - index + prompt_slots, ring)


def admit(
    cfg: ModelConfig,
    params: ServingParams,
    cache: KVCache | TieredKVCache,
    state: SlotState,
    tokens: Array,
    mask: Array,
    slots: Array,
    keys: Array,
    limit: Array,
    knobs: core.Knobs,
    spec: core.DecodeSpec,
    entries: Array,
    *,
    num_samples: int,
) -> tuple[KVCache | TieredKVCache, SlotState, AdmitOut]:
    """Prefill B left-padded prompts [B, P] for the cache rows `slots` [B*K] (prompt-major; an
    index >= the slot count drops that row); sample each sample's first token from its key
    (step 0). A cache with a prompt pool takes each prompt's keys/values once, at its pool entry
    `entries` [B] (>= the pool size: dropped), and its rows start empty; otherwise they are placed
    K times, into the rows, ending at the ring index."""
    mask = mask.astype(bool)
    last, keys_p, values_p = serving.prompt_pass(cfg, params, tokens, mask, positions_from_mask(mask))
    logits = jnp.repeat(serving.logits(cfg, params, last), num_samples, axis=0)
    if isinstance(cache, TieredKVCache):
        cache = _place_in_tiers(cache, keys_p, values_p, mask, slots, entries, num_samples)
    elif cache.prompt is None:
        cache = _place_in_rows(cache, keys_p, values_p, mask, slots, num_samples)
    else:
        cache = _place_in_pool(cache, keys_p, values_p, mask, slots, entries, num_samples)
    tok, lp = core.pick_tokens(logits, step_keys(keys, 0), jnp.zeros((), jnp.int32), knobs=knobs, spec=spec)
    stopped = core.is_stop(tok, spec)
    prompt_len = jnp.repeat(mask.sum(-1, dtype=jnp.int32), num_samples)

    def put(buf: Array, x: Array) -> Array:
        return constrain(buf.at[slots].set(x, mode="drop"), ("batch",))

    state = SlotState(
        prev=put(state.prev, tok),
        position=put(state.position, prompt_len),
        count=put(state.count, jnp.ones_like(tok)),
        live=put(state.live, ~stopped & (limit > 1)),
        finished=put(state.finished, stopped),
        keys=state.keys.at[slots].set(keys, mode="drop"),
        limit=put(state.limit, limit),
    )
    return cache, state, AdmitOut(tok, lp)


def _place_in_rows(cache: KVCache, keys_p: tuple[Array, ...], values_p: tuple[Array, ...], mask: Array,
                   slots: Array, num_samples: int) -> KVCache:
    """Each prompt's keys/values into its K rows, the P columns ending at the ring index."""
    p = mask.shape[1]
    src = ring_sources(cache.index, cache.slots, p)
    take = jnp.minimum(src, p - 1)
    placed = src < p

    def place(buf: Array, x: Array, slot_axis: int, axes: tuple[str, ...]) -> Array:
        # a layer's [B, ...P...] prompt buffer -> its B*K cache rows, the P columns in ring order
        rows = jnp.repeat(jnp.take(x, take, axis=slot_axis), num_samples, axis=0)
        return constrain(buf.at[slots].set(cache_values(rows, buf.dtype), mode="drop"), axes)

    valid = jnp.repeat(jnp.take(mask, take, axis=1) & placed[None, :], num_samples, axis=0)
    return KVCache(
        k=tuple(place(buf, x, 3, KVCache.K_AXES) for buf, x in zip(cache.k, keys_p)),
        v=tuple(place(buf, x, 2, KVCache.V_AXES) for buf, x in zip(cache.v, values_p)),
        valid=constrain(cache.valid.at[slots].set(valid, mode="drop"), ("batch", "length")),
        index=cache.index,
    )


def _place_in_pool(cache: KVCache, keys_p: tuple[Array, ...], values_p: tuple[Array, ...], mask: Array,
                   slots: Array, entries: Array, num_samples: int) -> KVCache:
    """Each prompt's keys/values once, at its pool entry (columns past its bucket invalid); the
    tables point its K samples at their rows, and no other entry at those rows any more."""
    assert cache.prompt is not None
    pool = _pool_with(cache.prompt, keys_p, values_p, mask, slots, entries, num_samples, cache.rows)
    return KVCache(k=cache.k, v=cache.v, index=cache.index, prompt=pool,
                   valid=constrain(cache.valid.at[slots].set(False, mode="drop"), ("batch", "length")))


def _pool_with(pool: PromptCache, keys_p: tuple[Array, ...], values_p: tuple[Array, ...], mask: Array,
               slots: Array, entries: Array, num_samples: int, rows: int) -> PromptCache:
    """The pool with B prompts placed at `entries` for the rows `slots` [B*K] (of `rows`)."""
    assert pool.samples is not None and pool.entry is not None
    b, p = mask.shape
    pad = pool.slots - p

    def place(buf: Array, x: Array, slot_axis: int, axes: tuple[str, ...]) -> Array:
        widths = [(0, 0)] * x.ndim
        widths[slot_axis] = (0, pad)
        return constrain(buf.at[entries].set(cache_values(jnp.pad(x, widths), buf.dtype), mode="drop"), axes)

    samples = jnp.where(jnp.isin(pool.samples, slots), rows, pool.samples)
    samples = samples.at[entries].set(slots.reshape(b, num_samples), mode="drop")
    positions = (entries[:, None] * num_samples + jnp.arange(num_samples, dtype=jnp.int32)).reshape(-1)
    return PromptCache(
        k=tuple(place(buf, x, 3, KVCache.K_AXES) for buf, x in zip(pool.k, keys_p)),
        v=tuple(place(buf, x, 2, KVCache.V_AXES) for buf, x in zip(pool.v, values_p)),
        valid=constrain(pool.valid.at[entries].set(jnp.pad(mask, ((0, 0), (0, pad))), mode="drop"),
                        ("batch", "length")),
        samples=samples,
        entry=pool.entry.at[slots].set(positions, mode="drop"),
    )


def tier_local(slots: Array, start: int, rows: int, total: int, shards: int) -> Array:
    """Global row indices (of `total` rows over `shards` batch shards) -> the own rows of the tier
    whose rows start at `start` (`layers.tier_rows`' layout); rows of other tiers and padding
    (>= total) -> `rows`: out of range, dropped."""
    per, lo, n = total // shards, start // shards, rows // shards
    j = jnp.mod(slots, per)
    inside = (slots >= 0) & (slots < total) & (j >= lo) & (j < lo + n)
    return jnp.where(inside, slots // per * n + j - lo, rows)


def _place_in_tiers(cache: TieredKVCache, keys_p: tuple[Array, ...], values_p: tuple[Array, ...],
                    mask: Array, slots: Array, entries: Array, num_samples: int) -> TieredKVCache:
    """`_place_in_rows` / `_place_in_pool` over a tiered cache: each tier takes its own rows."""
    tiers, start, shards = [], 0, batch_shards(cache.rows)
    for tier in cache.tiers:
        local = tier_local(slots, start, tier.rows, cache.rows, shards)
        if cache.prompt is None:
            tiers.append(_place_in_rows(tier, keys_p, values_p, mask, local, num_samples))
        else:
            tiers.append(dataclasses.replace(tier, valid=tier.valid.at[local].set(False, mode="drop")))
        start += tier.rows
    pool = cache.prompt
    if pool is not None:
        pool = _pool_with(pool, keys_p, values_p, mask, slots, entries, num_samples, cache.rows)
    return TieredKVCache(tiers=tuple(tiers), prompt=pool)


def move_rows(cache: TieredKVCache, state: SlotState, src: Array, dst: Array, lag: Array, span: Array,
              *, src_tier: int, dst_tier: int) -> tuple[TieredKVCache, SlotState]:
    """Move samples from rows of tier `src_tier` to free rows of the longer `dst_tier` (global row
    indices src, dst [m]; padding: both >= the rows, dropped). A sample's history is the `span`
    ring slots that end `lag` steps before its tier's write slot (0: it wrote at the last step; a
    paused sample stopped writing `lag` steps ago); it lands in its new row in the same order,
    ending just before the new tier's write slot, as if it had always been there. Its slot state
    and its pool table entries follow it, and it goes on generating (live) from there."""
    a, z = cache.tiers[src_tier], cache.tiers[dst_tier]
    starts = np.cumsum([0, *(t.rows for t in cache.tiers)])
    rows, shards = cache.rows, batch_shards(cache.rows)
    # padding reads row 0 of the source tier: its result is dropped
    ls = jnp.minimum(tier_local(src, int(starts[src_tier]), a.rows, rows, shards), a.rows - 1)
    ld = tier_local(dst, int(starts[dst_tier]), z.rows, rows, shards)
    end = jnp.mod(a.index - lag, a.slots)  # [m]: one past each history's newest slot
    age = jnp.mod(z.index - 1 - jnp.arange(z.slots), z.slots)  # [S_z]: 0 at the newest slot
    src_pos = jnp.mod(end[:, None] - 1 - age[None, :], a.slots)  # [m, S_z]
    keep = age[None, :] < span[:, None]

    def moved(buf: Array, into: Array, slot_axis: int, axes: tuple[str, ...]) -> Array:
        taken = jnp.take(buf, ls, axis=0)  # [m, ...S_a...]
        other = tuple(i for i in range(1, buf.ndim) if i != slot_axis)
        shape = list(taken.shape)
        shape[slot_axis] = z.slots
        index = jnp.broadcast_to(jnp.expand_dims(src_pos, other), shape)
        x = jnp.take_along_axis(taken, index, axis=slot_axis)
        x = jnp.where(jnp.expand_dims(keep, other), x, jnp.zeros((), x.dtype))
        return constrain(into.at[ld].set(x, mode="drop"), axes)

    valid = jnp.take_along_axis(jnp.take(a.valid, ls, axis=0), src_pos, axis=1) & keep
    z = KVCache(
        k=tuple(moved(x, y, 3, KVCache.K_AXES) for x, y in zip(a.k, z.k)),
        v=tuple(moved(x, y, 2, KVCache.V_AXES) for x, y in zip(a.v, z.v)),
        valid=constrain(z.valid.at[ld].set(valid, mode="drop"), ("batch", "length")),
        index=z.index,
    )
    tiers = tuple(z if b == dst_tier else t for b, t in enumerate(cache.tiers))
    pool = cache.prompt
    if pool is not None:
        assert pool.samples is not None and pool.entry is not None
        remap = jnp.arange(rows + 1, dtype=jnp.int32).at[src].set(dst, mode="drop")
        samples = jnp.where(jnp.isin(pool.samples, dst), rows, pool.samples)
        pool = dataclasses.replace(pool, samples=jnp.take(remap, samples, mode="clip"),
                                   entry=pool.entry.at[dst].set(jnp.take(pool.entry, src, mode="clip"),
                                                                mode="drop"))

    def follow(x: Array) -> Array:
        return x.at[dst].set(jnp.take(x, src, axis=0, mode="clip"), mode="drop")

    state = SlotState(*(follow(x) for x in state))
    state = state._replace(live=state.live.at[src].set(False, mode="drop").at[dst].set(True, mode="drop"))
    return TieredKVCache(tiers=tiers, prompt=pool), _constrain_state(state)


def decode_chunk(
    cfg: ModelConfig, params: ServingParams, cache: KVCache | TieredKVCache, state: SlotState,
    knobs: core.Knobs, spec: core.DecodeSpec, refill_at: Array, held: Array, busy: Array, *, chunk: int
) -> tuple[KVCache | TieredKVCache, SlotState, ChunkOut]:
    """Up to `chunk` decode steps over every slot; exits early once no slot is live, or after at
    least one step once a waiting prompt could enter: `refill_at` (a traced int: K while prompts
    wait, else more than the slots) slots are not live, and with a prompt pool an entry is free
    (`busy` [entries]: held at the chunk's start) or has just seen the last of its K samples end
    (`held` [slots]: samples that are not live but have not ended, paused ones). Without that
    second test every chunk would end after one step while stragglers hold every entry. Slots
    that are not live still run (their writes land in their own row, which the next admission
    resets) but emit nothing."""
    n = state.prev.shape[0]
    tiered = isinstance(cache, TieredKVCache)
    ones = jnp.ones((n, 1), bool)
    out = ChunkOut(
        tokens=constrain(jnp.full((n, chunk), spec.pad_token_id, jnp.int32), ("batch", "length")),
        logprobs=constrain(jnp.zeros((n, chunk), jnp.float32), ("batch", "length")),
        emitted=constrain(jnp.zeros((n, chunk), bool), ("batch", "length")),
    )

    pool = cache.prompt
    pooled = pool is not None and pool.samples is not None

    def cond(carry: tuple[Array, KVCache, SlotState, ChunkOut]) -> Array:
        c, _, st, _ = carry
        if pooled:  # a prompt enters a batch shard with K free rows and a free entry (`_admit`)
            free = ~(st.live | held)
            shards, k = batch_shards(n), pool.samples.shape[1]
            entry_free = ~busy | _entries_ended(pool.samples, free)
            rows_free = free.reshape(shards, -1).sum(-1, dtype=jnp.int32)
            fits = (rows_free >= k) & entry_free.reshape(shards, -1).any(-1)
            ready = (refill_at <= n) & jnp.any(fits)
        else:
            ready = jnp.sum(~st.live, dtype=jnp.int32) >= refill_at
        return (c < chunk) & jnp.any(st.live) & ((c == 0) | ~ready)

    def body(carry: tuple[Array, KVCache, SlotState, ChunkOut]) -> tuple[Array, KVCache, SlotState, ChunkOut]:
        c, cache, st, out = carry
        # a tiered cache's rows write only while live: a paused sample's history must stay
        write = st.live[:, None] if tiered else ones
        hidden, cache = serving.cached_pass(cfg, params, st.prev[:, None], st.position[:, None], write, cache)
        cache = _wrap_index(cache)
        logits = serving.logits(cfg, params, hidden[:, 0])
        tok, lp = core.pick_tokens(logits, step_keys(st.keys, st.count), st.count, knobs=knobs, spec=spec)
        live = st.live
        tok = jnp.where(live, tok, spec.pad_token_id)
        lp = jnp.where(live, lp, 0.0)
        stopped = live & core.is_stop(tok, spec)
        count = st.count + live.astype(jnp.int32)
        out = ChunkOut(
            tokens=jax.lax.dynamic_update_slice(out.tokens, tok[:, None], (0, c)),
            logprobs=jax.lax.dynamic_update_slice(out.logprobs, lp[:, None], (0, c)),
            emitted=jax.lax.dynamic_update_slice(out.emitted, live[:, None], (0, c)),
        )
        st = st._replace(
            prev=jnp.where(live, tok, st.prev),
            position=st.position + live.astype(jnp.int32),
            count=count,
            live=live & ~stopped & (count < st.limit),
            finished=st.finished | stopped,
        )
        return c + 1, cache, st, out

    _, cache, state, out = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), cache, state, out))
    return cache, state, out


def _entries_ended(samples: Array, ended: Array) -> Array:
    """[entries]: whether every sample of each pool entry has ended (ended [rows]), each batch
    shard over its own entries, whose samples are on its own rows."""
    def of_shard(shard: Array | int, samples: Array, ended: Array) -> tuple[Array]:
        rows = shard_rows(samples, shard, ended.shape[0])
        return (jnp.take(ended, rows, mode="fill", fill_value=True).all(-1),)

    return within_batch_shards(of_shard, [(samples, ("batch", None)), (ended, ("batch",))], [("batch",)])[0]


def _wrap_index(cache: KVCache | TieredKVCache) -> KVCache | TieredKVCache:
    """Each ring's write index taken mod its length."""
    if isinstance(cache, TieredKVCache):
        return dataclasses.replace(cache, tiers=tuple(_wrap_index(t) for t in cache.tiers))
    return dataclasses.replace(cache, index=jnp.mod(cache.index, cache.slots))


# ----------------------------------------------------------------------------- the host edge


@dataclasses.dataclass(frozen=True)
class Completed:
    """One prompt's K samples, all ended. token_versions[k][t]: the param version whose forward
    produced response token t of sample k."""

    tag: Hashable
    prompt: np.ndarray
    tokens: list[np.ndarray]
    logprobs: list[np.ndarray]
    token_versions: list[np.ndarray]
    finished: np.ndarray  # [K] bool: ended by a stop token


@dataclasses.dataclass
class _Live:
    """Host record of one sample in a slot."""

    request: int
    k: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Request:
    tag: Hashable
    prompt: np.ndarray
    keys: Any  # [K] typed PRNG keys
    limit: np.ndarray  # [K] int32
    entry: int | None = None  # its prompt pool entry, once admitted into a shared prompt cache
    done: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, bool]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class EngineStats:
    chunks: int = 0
    decode_steps: int = 0  # decode steps run (a chunk exits early when no slot is live or K are free)
    slot_steps_live: int = 0  # sum over steps of live slots
    admitted: int = 0
    swaps: int = 0
    last_swap_s: float = 0.0
    moves: int = 0  # samples moved to a longer ring tier (`ring_tiers`)
    pauses: int = 0  # samples that waited for a free row of a longer tier (no token while paused)

    def occupancy(self, slots: int) -> float:
        """Share of decode slot-steps that generated a token."""
        return self.slot_steps_live / max(1, self.decode_steps * slots)


def geometric_ring_tiers(slots: int, ring: int, tiers: int, shards: int = 1) -> tuple[tuple[int, int], ...]:
    """A default `ring_tiers` layout for response lengths with a long tail (most samples in flight
    are short, a few are long): ring lengths halving from `ring` down, the shortest ring with half
    of the slots and each longer one with half of what is left (the longest: the rest). 3 tiers of
    128 slots: 64 rows of ring / 4, 32 of ring / 2, 32 of ring. With `shards` batch shards, the
    layout of one shard's slots, each tier's rows times `shards`. A chosen layout, not a measured
    one: `experiments/benchmarks/continuous_batching.py` times it against one ring."""
    if tiers < 1 or slots < tiers * shards or slots % shards:
        raise ValueError(f"ring_tiers={tiers}: give 1 to {slots // shards} tiers (one row each at least "
                         f"on each of the {shards} batch shards)")
    if shards > 1:
        return tuple((n * shards, length) for n, length in geometric_ring_tiers(slots // shards, ring, tiers))
    rows, left = [], slots
    for _ in range(tiers - 1):
        rows.append(max(1, min(left - (tiers - len(rows) - 1), left // 2)))
        left -= rows[-1]
    rows.append(left)
    return tuple((n, max(1, -(-ring // 2 ** (tiers - 1 - i)))) for i, n in enumerate(rows))


def default_prompt_pool(slots: int, num_samples: int, prompt_slots: int, max_new_tokens: int) -> int:
    """The prompt pool's default size: 3 x slots / K entries, or 2 x where the prompt bucket is
    longer than the responses' cap. A prompt holds its entry until its longest sample ends, so with
    long-tailed response lengths a pool of 2 x fills with stragglers' prompts while slots idle
    (`experiments/benchmarks/continuous_schedule.py`: 3 x takes 15-18% fewer decode steps at
    K >= 8, 4 x none fewer than 3 x); but every decode step reads the whole pool, so where prompts are
    longer than the responses the extra entries cost more than the slots they fill
    (`continuous_shared_prompt.py`, `continuous_batching.py --compare-pool`)."""
    return (3 if prompt_slots <= max_new_tokens else 2) * (slots // num_samples)


def request_keys(call_key: jax.Array, first_row: int, num_samples: int) -> jax.Array:
    """The K per-sample keys the static sampler gives rows first_row .. first_row + K - 1 of a call
    with `call_key`: fold_in(call_key, row)."""
    if not jnp.issubdtype(call_key.dtype, jax.dtypes.prng_key):
        call_key = jax.random.wrap_key_data(jnp.asarray(call_key, jnp.uint32))
    rows = jnp.arange(first_row, first_row + num_samples, dtype=jnp.int32)
    return jax.vmap(lambda r: jax.random.fold_in(call_key, r))(rows)


class ContinuousEngine:
    """Continuous batching over a `Sampler`'s model, params, mesh and compiled-program cache.

    slots: decode slots (a multiple of the mesh's batch shards and >= K); chunk: decode steps per
    compiled chunk; max_prompt_tokens: the longest prompt to admit (sets the ring size). The
    sampler's `update_params` (or this engine's, which also sets the version) swaps the policy for
    the next chunk.

    share_prompt_cache (None: the sampler's setting; applies with K > 1): each prompt's keys/values
    are held once, in a pool of `prompt_pool` entries (default: `default_prompt_pool`), and its K
    samples' decode steps read them once (`layers.attention_after_prompt`); the rows' ring then holds
    generated tokens only. A prompt is admitted when K slots and a pool entry are free; its entry
    is freed when its last sample ends, so a pool too small for the stragglers in flight leaves
    slots idle (the occupancy shows it). Off: each prompt is copied into its K rows.

    ring_tiers ((rows, ring length) per tier, shortest first; rows add up to `slots`; or a number of
    tiers for `geometric_ring_tiers`' layout; None or 1: one ring for all rows): the rows are
    split into tiers whose rings have their own lengths, and a decode step's attention reads each
    row's tier ring, not the longest one (`serving.TieredKVCache`). A sample starts in the shortest
    tier that holds its history for a chunk and moves, between chunks, to a longer one before it
    outgrows its ring (`move_rows`: its history is copied once per move); if no longer tier has a
    free row it pauses (keeps its row, generates nothing) until one frees. The last tier's ring must
    hold the longest history (`ring`); its samples never move, so they always end and free rows.
    With responses of mixed lengths most rows read a short ring. On a mesh with D batch shards
    every tier's rows are a multiple of D, and each shard holds its share of every tier
    (`layers.tier_rows`), so a step's tiers split its rows within each device.
    """

    def __init__(
        self,
        sampler: Sampler,
        config: SamplingConfig,
        *,
        slots: int,
        chunk: int,
        max_prompt_tokens: int | None = None,
        version: int = 0,
        share_prompt_cache: bool | None = None,
        prompt_pool: int | None = None,
        ring_tiers: int | Sequence[tuple[int, int]] | None = None,
    ):
        cfg = sampler.config
        k = config.num_samples
        if chunk < 1:
            raise ValueError(f"decode chunk must be >= 1 step, got {chunk}")
        if slots < k or slots % sampler.batch_shards:
            raise ValueError(
                f"decode slots={slots} must be >= num_samples={k} and a multiple of the mesh's "
                f"{sampler.batch_shards} batch shards; raise rollout.decode_slots"
            )
        limit = sampler.max_cache_length - config.max_new_tokens
        if limit < 1:
            raise ValueError(
                f"max_new_tokens={config.max_new_tokens} leaves no room for a prompt in the sampler's "
                f"cache of {sampler.max_cache_length}; raise Sampler(max_cache_length=...)"
            )
        self.max_prompt = min(max_prompt_tokens or limit, limit)
        self.sampler = sampler
        self.config = config
        self.slots = slots
        self.chunk = chunk
        self.pad = config.pad_token_id if config.pad_token_id is not None else (cfg.pad_token_id or 0)
        stops = config.stop_token_ids if config.stop_token_ids is not None else cfg.eos_token_ids
        sampler._check_prompts([[0]], config, self.pad, stops)  # vocab checks of pad/stops/top_k
        self.spec = core.DecodeSpec(
            max_new_tokens=config.max_new_tokens, top_k=config.top_k, use_top_p=config.top_p < 1.0,
            greedy=config.is_greedy, stop_token_ids=tuple(stops), pad_token_id=self.pad,
        )
        self.knobs = core.Knobs(
            temperature=sampler._put(np.float32(config.logprob_temperature), ()),
            top_p=sampler._put(np.float32(config.top_p), ()),
            min_new_tokens=sampler._put(np.int32(config.min_new_tokens), ()),
        )
        p_max = length_bucket(self.max_prompt, limit, sampler.min_prompt_bucket)
        shards = sampler.batch_shards
        self.pool = 0
        if share_prompt_cache is None:
            share_prompt_cache = sampler.share_prompt_cache
        if share_prompt_cache and k > 1:
            wanted = prompt_pool
            if wanted is None:
                wanted = default_prompt_pool(slots, k, p_max, config.max_new_tokens)
            if wanted < 1:
                raise ValueError(f"prompt_pool={prompt_pool} must hold at least one prompt")
            self.pool = -(-wanted // shards) * shards  # whole entries per batch shard
            if k > slots // shards:
                raise ValueError(
                    f"a shared prompt cache on {shards} batch shards decodes a prompt's {k} samples on its "
                    f"pool entry's device, which has {slots // shards} of the {slots} decode slots; raise "
                    f"rollout.decode_slots to at least {k * shards} or set rollout.share_prompt_cache=false")
        elif prompt_pool is not None:
            raise ValueError("prompt_pool sizes a shared prompt cache, which needs share_prompt_cache "
                             "and K > 1 samples per prompt")
        # a row writes at most max_new - 1 generated tokens (after its prompt, unless the pool holds it)
        self.ring = config.max_new_tokens if self.pool else p_max + config.max_new_tokens
        self._free_entries = list(range(self.pool))
        if isinstance(ring_tiers, int):
            ring_tiers = (None if ring_tiers == 1
                          else geometric_ring_tiers(slots, self.ring, ring_tiers, shards))
        self.ring_tiers = self._check_tiers(ring_tiers) if ring_tiers is not None else None
        tiers = self.ring_tiers
        self._tier_of = np.zeros(slots, np.int32)
        if tiers:  # each batch shard's rows hold its share of every tier, shortest ring first
            per_shard = np.repeat(np.arange(len(tiers), dtype=np.int32), [n // shards for n, _ in tiers])
            self._tier_of = np.tile(per_shard, shards)
        self._span_base = [0] * slots  # ring slots a sample's prompt fills in its row (0 with a pool)
        self._paused: dict[int, int] = {}  # paused sample's slot -> loop steps run when it paused
        self._steps = 0  # decode loop steps run so far (every ring's index advanced by as many)
        self.version = version
        self.stats = EngineStats()
        self._queue: collections.deque[int] = collections.deque()
        self._requests: dict[int, _Request] = {}
        self._next_id = 0
        self._slot: list[_Live | None] = [None] * slots
        pool, ring = self.pool, self.ring

        def init() -> KVCache | TieredKVCache:
            full = core.init_cache(cfg, slots, 1 if tiers else ring, pool, p_max if pool else 0,
                                   pool_samples=k if pool else 0, dtype=sampler.cache_dtype)
            if not tiers:
                return full
            parts = tuple(core.init_cache(cfg, n, length, dtype=sampler.cache_dtype) for n, length in tiers)
            return TieredKVCache(tiers=parts, prompt=full.prompt)

        self._cache = sampler._run(
            ("cache", (("rows", slots), ("slots", ring), ("pool", pool), ("pool_slots", p_max),
                       ("num_samples", k), ("tiers", tiers))),
            lambda: jax.jit(init),
        )
        proto = request_keys(jax.random.PRNGKey(0), 0, 1)[0]
        self._state = sampler._run(
            ("slot_state", (("rows", slots),)),
            lambda: jax.jit(lambda key: _constrain_state(init_state(slots, key))),
            proto,
        )

    def _check_tiers(self, ring_tiers: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
        tiers = tuple((int(n), int(length)) for n, length in ring_tiers)
        if not tiers or any(n < 1 or length < 1 for n, length in tiers):
            raise ValueError(f"ring_tiers={ring_tiers!r}: give (rows >= 1, ring length >= 1) per tier")
        if sum(n for n, _ in tiers) != self.slots:
            raise ValueError(f"ring_tiers={ring_tiers!r} hold {sum(n for n, _ in tiers)} rows; "
                             f"they must add up to the {self.slots} decode slots")
        lengths = [length for _, length in tiers]
        if lengths != sorted(set(lengths)):
            raise ValueError(f"ring_tiers={ring_tiers!r}: ring lengths must increase from tier to tier")
        if lengths[-1] < self.ring:
            what = "max_new_tokens" if self.pool else "the prompt bucket + max_new_tokens"
            raise ValueError(f"ring_tiers={ring_tiers!r}: the last tier's ring must hold the longest "
                             f"history a sample can have, {self.ring} slots ({what})")
        shortest = min(self.chunk, self.config.max_new_tokens)
        if lengths[0] < shortest:
            raise ValueError(f"ring_tiers={ring_tiers!r}: a ring shorter than a decode chunk "
                             f"({shortest} steps) can hold no sample for a chunk; use fewer tiers "
                             "(rollout.ring_tiers) or a shorter chunk (rollout.decode_chunk)")
        shards = self.sampler.batch_shards
        if any(n % shards for n, _ in tiers):
            raise ValueError(f"ring_tiers={ring_tiers!r}: every tier's rows must be a multiple of the "
                             f"mesh's {shards} batch shards (each shard holds its share of every tier)")
        return tiers

    # -- inputs ------------------------------------------------------------------------------

    def submit(
        self, prompt: Sequence[int] | np.ndarray, keys: jax.Array, tag: Hashable = None,
        max_new_per_sample: Sequence[int] | np.ndarray | None = None,
    ) -> None:
        """Queue one prompt for K samples with per-sample keys [K] (`request_keys`); `tag` comes
        back with its `Completed` group. max_new_per_sample: optional [K] caps on new tokens."""
        k = self.config.num_samples
        (arr,) = self.sampler._check_prompts([prompt], self.config, self.pad, self.spec.stop_token_ids)
        if len(arr) > self.max_prompt:
            raise ValueError(f"prompt has {len(arr)} tokens, the engine admits at most {self.max_prompt}")
        if keys.shape[:1] != (k,):
            raise ValueError(f"need {k} per-sample keys (num_samples), got shape {keys.shape}")
        limit = np.full(k, self.config.max_new_tokens, np.int32)
        if max_new_per_sample is not None:
            caps = np.asarray(max_new_per_sample)
            if caps.shape != (k,) or caps.min() < 1 or caps.max() > self.config.max_new_tokens:
                raise ValueError(f"max_new_per_sample needs {k} entries in [1, {self.config.max_new_tokens}]")
            limit = caps.astype(np.int32)
        rid = self._next_id
        self._next_id += 1
        self._requests[rid] = _Request(tag, arr, keys, limit)
        self._queue.append(rid)

    def prepare_params(self, model_or_state: Any) -> PreparedParams:
        """`Sampler.prepare_params`: a version placed and laid out for serving, for a loader
        thread to build while decoding goes on."""
        return self.sampler.prepare_params(model_or_state)

    def update_params(self, model_or_state: Any, version: int) -> float:
        """Swap the policy for the next chunk (samples in flight keep their cache); returns the
        seconds the swap took: none to speak of for `prepare_params`' result, else placing the
        params on the mesh and building their serving layout first."""
        t0 = time.perf_counter()
        self.sampler.update_params(model_or_state)
        self.version = version
        seconds = time.perf_counter() - t0
        self.stats.swaps += 1
        self.stats.last_swap_s = seconds
        log.info("continuous engine: params version %d swapped in between chunks in %.3f s "
                 "(%d samples in flight keep their cache)", version, seconds, self.in_flight)
        return seconds

    # -- state -------------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Prompts queued, not yet admitted."""
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        """Samples in slots."""
        return sum(s is not None for s in self._slot)

    @property
    def free_slots(self) -> int:
        return self.slots - self.in_flight

    @property
    def idle(self) -> bool:
        return not self._queue and not self.in_flight

    # -- the loop ------------------------------------------------------------------------------

    def step(self) -> list[Completed]:
        """Admit queued prompts into free slots, run one decode chunk, harvest; return the groups
        whose K samples have all ended (in completion order)."""
        k = self.config.num_samples
        self._move_or_pause()
        admitted = self._admit()
        if not self.in_flight:
            return self._harvest_admitted(admitted)
        version = self.version
        # paused samples are not live on the device, and their rows are not free
        refill_at = k + len(self._paused) if self._queue else self.slots + 1
        held = np.zeros(self.slots, bool)
        held[list(self._paused)] = True
        busy = np.ones(self.pool, bool)
        busy[self._free_entries] = False
        cache, state, out = self.sampler._run(
            ("decode_chunk", (("slots", self.slots), ("ring", self.ring), ("chunk", self.chunk),
                              ("pool", self.pool), ("spec", self.spec), ("tiers", self.ring_tiers))),
            lambda: _jit_chunk(self.sampler.config, self.spec, self.chunk),
            self.sampler.serving_params, self._cache, self._state, self.knobs,
            self.sampler._put(np.int32(refill_at), ()), self.sampler._put(held, ()),
            self.sampler._put(busy, ()),
        )
        self._cache, self._state = cache, state
        host_out, live, finished = jax.device_get((out, state.live, state.finished))
        done = self._harvest_admitted(admitted)
        steps = int(host_out.emitted.any(0).sum())  # the loop runs while any is live
        self._steps += steps
        self.stats.chunks += 1
        self.stats.decode_steps += steps
        self.stats.slot_steps_live += int(host_out.emitted.sum())
        for s, rec in enumerate(self._slot):
            if rec is None:
                continue
            row = host_out.emitted[s]
            if row.any():
                rec.tokens.extend(host_out.tokens[s][row].tolist())
                rec.logprobs.extend(host_out.logprobs[s][row].tolist())
                rec.versions.extend([version] * int(row.sum()))
            if not live[s] and s not in self._paused:
                done.extend(self._end(s, bool(finished[s])))
        return done

    def run(self) -> list[Completed]:
        """Step until every submitted prompt is done (for tests and benchmarks)."""
        out: list[Completed] = []
        while not self.idle:
            out.extend(self.step())
        return out

    # -- helpers -------------------------------------------------------------------------------

    def _admit(self) -> list[tuple[list[int], Any, int]]:
        """Admit as many queued prompts as free slots allow; returns (slots, AdmitOut) per batch
        for the first tokens (fetched with the next chunk's outputs)."""
        k = self.config.num_samples
        take = min(len(self._queue), self.free_slots // k)
        if self.pool:
            take = min(take, len(self._free_entries))
        if take == 0:
            return []
        limit_len = self.sampler.max_cache_length - self.config.max_new_tokens

        def bucket(n: int) -> int:
            longest = max(len(self._requests[r].prompt) for r in list(self._queue)[:n])
            return length_bucket(longest, limit_len, self.sampler.min_prompt_bucket)

        if self.pool:
            placed = self._place_in_shards(take)
            take = len(placed)
            p_len = bucket(take) if take else 0
            free = [row for rows, _ in placed for row in rows]
        else:
            p_len = bucket(take)
            free = self._free_rows(p_len)
            take = min(take, len(free) // k)
        if take == 0:
            return []
        rids = [self._queue.popleft() for _ in range(take)]
        b = min(next_pow2(take), max(1, self.slots // k))
        b = max(b, take)
        prompts = [self._requests[r].prompt for r in rids]
        tokens, mask = left_pad(prompts, b, p_len, self.pad)
        slots = np.full(b * k, self.slots, np.int32)  # out of range: dropped
        slots[: take * k] = free[: take * k]
        keys = jnp.concatenate([self._requests[r].keys for r in rids]
                               + [self._requests[rids[0]].keys] * (b - take))
        limit = np.concatenate([self._requests[r].limit for r in rids]
                               + [np.ones(k, np.int32)] * (b - take))
        entries = np.full(b, self.pool, np.int32)  # out of range: dropped
        if self.pool:
            for i, r in enumerate(rids):
                entries[i] = self._requests[r].entry = placed[i][1]
        shape = (("batch", b), ("prompt_len", p_len), ("num_samples", k), ("ring", self.ring),
                 ("slots", self.slots), ("pool", self.pool), ("spec", self.spec), ("tiers", self.ring_tiers))
        put = self.sampler._put
        self._cache, self._state, first = self.sampler._run(
            ("admit", shape),
            lambda: _jit_admit(self.sampler.config, self.spec, k),
            self.sampler.serving_params, self._cache, self._state,
            put(tokens, ()), put(mask, ()), put(slots, ()),
            jax.device_put(keys, NamedSharding(self.sampler.mesh, P())),
            put(limit, ()), self.knobs, put(entries, ()),
        )
        for i, r in enumerate(rids):
            for j in range(k):
                self._slot[int(slots[i * k + j])] = _Live(r, j)
                self._span_base[int(slots[i * k + j])] = 0 if self.pool else p_len
        self.stats.admitted += take
        return [(list(slots[: take * k]), first, self.version)]

    def _place_in_shards(self, prompts: int) -> list[tuple[list[int], int]]:
        """(K rows, pool entry) for up to `prompts` queued prompts, each on one batch shard (its
        rows and entry on one device, see the module docstring): the shard with the most free
        rows first; within a shard, rows in `_free_rows` order. Takes the entries it returns."""
        k, shards = self.config.num_samples, self.sampler.batch_shards
        rows_per, entries_per = self.slots // shards, self.pool // shards
        rows: list[list[int]] = [[] for _ in range(shards)]
        for s in self._free_rows(0):
            rows[s // rows_per].append(s)
        entries: list[list[int]] = [[] for _ in range(shards)]
        for e in self._free_entries:
            entries[e // entries_per].append(e)
        placed = []
        for _ in range(prompts):
            open_ = [d for d in range(shards) if len(rows[d]) >= k and entries[d]]
            if not open_:
                break
            d = max(open_, key=lambda d: len(rows[d]))
            entry = entries[d].pop()
            self._free_entries.remove(entry)
            placed.append((rows[d][:k], entry))
            del rows[d][:k]
        return placed

    def _free_rows(self, prompt_slots: int) -> list[int]:
        """Free rows for new samples whose prompts fill `prompt_slots` of their row: all of them,
        or with ring tiers those of tiers whose ring holds such a sample for a chunk, shortest
        ring first (the longer tiers are left for samples that outgrow theirs)."""
        free = [s for s, rec in enumerate(self._slot) if rec is None]
        if not self.ring_tiers:
            return free
        need = prompt_slots + min(self.chunk, self.config.max_new_tokens)
        rings = [length for _, length in self.ring_tiers]
        fitting = (s for s in free if rings[self._tier_of[s]] >= need)
        return sorted(fitting, key=lambda s: (self._tier_of[s], s))

    def _move_or_pause(self) -> None:
        """Ring tiers: every sample that its tier's ring cannot hold for one more chunk moves to a
        free row of the shortest longer tier that can, or pauses there until one frees (samples
        in the last tier always fit). Paused samples go first: they have waited longest."""
        if not self.ring_tiers:
            return
        rings = [length for _, length in self.ring_tiers]
        last = len(rings) - 1
        rows_per = self.slots // self.sampler.batch_shards  # a pool's samples stay on their shard
        free = [s for s, rec in enumerate(self._slot) if rec is None]
        free.sort(key=lambda d: (self._tier_of[d], d))  # shortest ring first
        moves: dict[tuple[int, int], list[tuple[int, int, int, int]]] = collections.defaultdict(list)
        pause: list[int] = []
        for s in [*self._paused, *(s for s in range(self.slots) if s not in self._paused)]:
            rec, tier = self._slot[s], int(self._tier_of[s])
            if rec is None or tier == last:
                continue
            span = self._span_base[s] + len(rec.tokens) - 1  # ring slots written so far
            remaining = int(self._requests[rec.request].limit[rec.k]) - len(rec.tokens)
            need = span + min(self.chunk, remaining)
            if need <= rings[tier]:
                continue
            dst = next((d for d in free if self._tier_of[d] > tier and rings[self._tier_of[d]] >= need
                        and (not self.pool or d // rows_per == s // rows_per)), None)
            if dst is None:
                if s not in self._paused:
                    pause.append(s)
                    self._paused[s] = self._steps
                continue
            free.remove(dst)
            lag = self._steps - self._paused.pop(s, self._steps)
            moves[(tier, int(self._tier_of[dst]))].append((s, dst, lag, span))
        put = self.sampler._put
        for (src_tier, dst_tier), group in moves.items():
            m = next_pow2(len(group))
            src, dst, lag, span = (np.full(m, fill, np.int32) for fill in (self.slots, self.slots, 0, 0))
            for i, row in enumerate(group):
                src[i], dst[i], lag[i], span[i] = row
            self._cache, self._state = self.sampler._run(
                ("move_rows", (("from", src_tier), ("to", dst_tier), ("rows", m), ("slots", self.slots),
                               ("pool", self.pool), ("tiers", self.ring_tiers))),
                lambda: jax.jit(functools.partial(move_rows, src_tier=src_tier, dst_tier=dst_tier),
                                donate_argnums=(0, 1)),
                self._cache, self._state, put(src, ()), put(dst, ()), put(lag, ()), put(span, ()),
            )
            for s, d, _, _ in group:
                self._slot[d], self._slot[s] = self._slot[s], None
                self._span_base[d] = self._span_base[s]
            self.stats.moves += len(group)
        if pause:
            rows = np.full(next_pow2(len(pause)), self.slots, np.int32)
            rows[: len(pause)] = pause
            self._state = self.sampler._run(
                ("pause_rows", (("rows", len(rows)), ("slots", self.slots))),
                lambda: jax.jit(_paused, donate_argnums=(0,)), self._state, put(rows, ()),
            )
            self.stats.pauses += len(pause)

    def _harvest_admitted(self, admitted: list[tuple[list[int], Any, int]]) -> list[Completed]:
        """Record each admitted sample's first token; samples that ended at it (a stop token or a
        cap of 1) are freed here."""
        done: list[Completed] = []
        for slots, first, version in admitted:
            tok, lp = jax.device_get((first.tokens, first.logprobs))
            for i, s in enumerate(slots):
                rec = self._slot[s]
                assert rec is not None
                rec.tokens.append(int(tok[i]))
                rec.logprobs.append(float(lp[i]))
                rec.versions.append(version)
                stopped = int(tok[i]) in self.spec.stop_token_ids
                if stopped or self._requests[rec.request].limit[rec.k] <= 1:
                    done.extend(self._end(s, stopped))
        return done

    def _end(self, slot: int, finished: bool) -> list[Completed]:
        rec = self._slot[slot]
        assert rec is not None
        self._slot[slot] = None
        req = self._requests[rec.request]
        req.done[rec.k] = (np.asarray(rec.tokens, np.int32), np.asarray(rec.logprobs, np.float32),
                           np.asarray(rec.versions, np.int32), finished)
        if len(req.done) < self.config.num_samples:
            return []
        del self._requests[rec.request]
        if req.entry is not None:
            self._free_entries.append(req.entry)
        ks = range(self.config.num_samples)
        return [Completed(
            tag=req.tag, prompt=req.prompt,
            tokens=[req.done[j][0] for j in ks], logprobs=[req.done[j][1] for j in ks],
            token_versions=[req.done[j][2] for j in ks],
            finished=np.array([req.done[j][3] for j in ks], bool),
        )]


def _paused(state: SlotState, rows: Array) -> SlotState:
    """The state with `rows` not live (padding rows >= the slots: dropped)."""
    return _constrain_state(state._replace(live=state.live.at[rows].set(False, mode="drop")))


def _constrain_state(state: SlotState) -> SlotState:
    return SlotState(*(x if i == 5 else constrain(x, ("batch",)) for i, x in enumerate(state)))


def _jit_admit(cfg: ModelConfig, spec: core.DecodeSpec, num_samples: int) -> Any:
    def fn(params, cache, state, tokens, mask, slots, keys, limit, knobs,  # type: ignore[no-untyped-def]
           entries):
        return admit(cfg, params, cache, state, tokens, mask, slots, keys, limit, knobs, spec, entries,
                     num_samples=num_samples)

    return jax.jit(fn, donate_argnums=(1, 2))


def _jit_chunk(cfg: ModelConfig, spec: core.DecodeSpec, chunk: int) -> Any:
    def fn(params, cache, state, knobs, refill_at, held, busy):  # type: ignore[no-untyped-def]
        return decode_chunk(cfg, params, cache, state, knobs, spec, refill_at, held, busy, chunk=chunk)

    return jax.jit(fn, donate_argnums=(1, 2))
