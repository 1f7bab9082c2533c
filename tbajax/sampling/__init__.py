"""Fast jitted sampling: prefill once per prompt, decode inside one compiled loop, K samples each."""

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

__all__ = [
    "CompileEvent",
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
    "sample_logits",
    "score",
    "top_p_filter",
]
