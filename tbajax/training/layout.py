"""Which layout a trainer step scores its batch in (`TrainerConfig.pack_groups="auto"`).

The same groups can be scored as K rows of prompt + response each ("rows"), one packed row per
group with the prompt once and the responses back to back ("packed", `PackedGroups`), or one
row per group at fixed strides ("strided", `layers.StridedGroups`). They give the same loss and
gradients; what differs is the work. Packing saves K - 1 prompts per group but attends over the
whole (P + K·R)-slot row; the strided layout saves the prompts too and attends per response, at
the price of padding every response to the longest. Which is cheapest depends on the lengths of
the batch at hand (`experiments/benchmarks/packed_groups.py` times the three: strided fastest for
responses of hundreds of tokens, packed for answers of a dozen), so "auto" collates all three and
keeps the one whose estimated cost (`step_cost`) is lowest.

Pure functions of a collated `Batch`'s shapes and the model config; the trainer's `prepare`
picks, and the jitted step compiles one program per layout it meets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

from tbajax.batch import Batch
from tbajax.models import decoder
from tbajax.models.config import ModelConfig
from tbajax.models.layers import causal_blocks
from tbajax.training.config import TrainerConfig

Layout = Literal["rows", "packed", "strided"]
LAYOUTS: tuple[Layout, ...] = ("rows", "packed", "strided")


def batch_layout(batch: Batch) -> Layout:
    """The layout a collated batch is in."""
    if batch.packed is None:
        return "rows"
    return "packed" if batch.packed.prompt_real is None else "strided"


def configured_layouts(config: TrainerConfig, prompt_features: bool = False) -> tuple[Layout, ...]:
    """The layouts a trainer with `config` takes; `prompt_features`: its objective reads them,
    which the packed layouts do not provide (rows only; an explicit packing is refused when the
    step is traced)."""
    if config.pack_groups == "auto":
        return ("rows",) if prompt_features else LAYOUTS
    if not config.pack_groups:
        return ("rows",)
    return ("strided",) if config.pack_strided else ("packed",)


@dataclasses.dataclass(frozen=True)
class LayoutWork:
    """What scoring a batch once costs, in units that do not depend on the model.

    slots: positions the layers run (padding included); pairs: (query, key) products attention
    computes per head, after the causal blocks it skips (`layers.causal_blocks`); scored: slots
    the vocabulary projection runs on."""

    slots: int
    pairs: int
    scored: int


def causal_pairs(queries: int, keys_before: int = 0) -> int:
    """(query, key) products of causal attention over `queries` positions that also see
    `keys_before` keys in front (a strided response's prompt), computed as `layers` does: in
    `causal_blocks(queries)` query blocks, block i over the first keys_before + (i + 1) / blocks
    of the queries' own keys; one block computes the whole (masked) rectangle."""
    if queries <= 0:
        return 0
    blocks = causal_blocks(queries)
    per = queries // blocks
    return sum(per * (keys_before + (i + 1) * per) for i in range(blocks))


def layout_work(batch: Batch) -> LayoutWork:
    """`LayoutWork` of a collated batch, from its shapes."""
    layout = batch_layout(batch)
    if layout == "rows":
        n, t = batch.tokens.shape
        scored = n * (batch.scored.shape[1] if batch.scored is not None else t)
        return LayoutWork(slots=n * t, pairs=n * causal_pairs(t), scored=scored)
    pk = batch.packed
    assert pk is not None
    g, width = pk.tokens.shape
    scored = g * pk.scored.shape[1]
    if layout == "packed":
        per_row = causal_pairs(width) if width >= decoder.PACKED_CAUSAL_BLOCKS_MIN else width * width
        return LayoutWork(slots=g * width, pairs=g * per_row, scored=scored)
    assert pk.prompt_real is not None and pk.response_real is not None
    p = pk.prompt_real.shape[1]
    k, r = pk.response_real.shape[1:]
    per_row = causal_pairs(p) + k * causal_pairs(r, keys_before=p)
    return LayoutWork(slots=g * width, pairs=g * per_row, scored=scored)


def step_cost(work: LayoutWork, cfg: ModelConfig, attention_weight: float) -> float:
    """Estimated FLOPs of one forward over `work`, attention's weighted by `attention_weight`:
    the layers' weight products per slot, 4 x heads x head_dim per (query, key) pair per layer,
    the vocabulary projection per scored slot. The weight stands for attention's lower rate: its
    many small products run far below the weight products' (`TrainerConfig.layout_attention_weight`).
    The backward and the reference forward scale every term about alike, so the forward decides."""
    head = 2 * cfg.hidden_size * cfg.vocab_size
    return cfg.layers_forward_flops(work.slots, work.pairs, attention_weight) + work.scored * head


def cheapest(batches: Sequence[Batch], cfg: ModelConfig, attention_weight: float) -> Batch:
    """The batch of least `step_cost` (the first of equals: pass the simplest layout first)."""
    if not batches:
        raise ValueError("cheapest needs at least one batch")
    costs = [step_cost(layout_work(b), cfg, attention_weight) for b in batches]
    return batches[costs.index(min(costs))]
