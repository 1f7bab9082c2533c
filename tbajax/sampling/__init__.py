"""Fast jitted sampling: prefill once per prompt, decode inside one compiled loop, K samples each;
or continuous batching over fixed decode slots (`ContinuousEngine`)."""

from tbajax.sampling.config import SamplingConfig
from tbajax.sampling.core import DecodeOut, DecodeSpec, Knobs, decode, prefill, score
from tbajax.sampling.sampler import (
    CompileEvent,
    SampleOutput,
    Sampler,
    batch_bucket,
    length_bucket,
)
from tbajax.sampling.step import sample_logits, top_p_filter
from tbajax.sampling.continuous import Completed, ContinuousEngine, request_keys

__all__ = [
    "CompileEvent",
    "Completed",
    "ContinuousEngine",
    "DecodeOut",
    "DecodeSpec",
    "Knobs",
    "SampleOutput",
    "Sampler",
    "SamplingConfig",
    "batch_bucket",
    "decode",
    "length_bucket",
    "prefill",
    "request_keys",
    "sample_logits",
    "score",
    "top_p_filter",
]
