"""Named scopes that label the parts of a compiled program.

Every op XLA emits carries the `jax.named_scope` path it was traced under in its HLO `op_name`
(forward and backward alike: a VJP's ops keep the scopes of the code they differentiate). The
model, sampler and trainer run their parts under the names below, so a profile can tell where a
program's time goes (`experiments/benchmarks/op_profile.py`); the scopes cost nothing at run time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax

F = TypeVar("F", bound=Callable[..., Any])

# the parts of a layer
MATMUL = "matmul"  # products with weight matrices (projections, MLP)
ATTENTION = "attention"  # scores, softmax and the value product
KV_WRITE = "kv_write"  # writing a step's keys / values into the KV cache
NORM = "norm"
ROPE = "rope"
ACTIVATION = "activation"
# the parts of a model, a sampler and a train step
EMBED = "embed"
LM_HEAD = "lm_head"
SAMPLING = "sampling"  # drawing the next token from the logits
LOGPROBS = "logprobs"  # token log-probs from the logits (training)
OBJECTIVE = "objective"
OPTIMIZER = "optimizer"
# the two phases of a generate call
PREFILL = "prefill"
DECODE = "decode"

PARTS = (MATMUL, ATTENTION, KV_WRITE, NORM, ROPE, ACTIVATION, EMBED, LM_HEAD, SAMPLING, LOGPROBS, OBJECTIVE,
         OPTIMIZER)
PHASES = (PREFILL, DECODE)


def scoped(name: str) -> Callable[[F], F]:
    """Decorator: trace the function under `jax.named_scope(name)`."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with jax.named_scope(name):
                return fn(*args, **kwargs)

        return inner  # type: ignore[return-value]

    return wrap
