"""Fast jitted sampling: prefill once per prompt, decode inside one compiled loop, K samples each;
or continuous batching over fixed decode slots (`ContinuousEngine`)."""

from tbajax._lazy import lazy_exports

_EXPORTS = {  # public name -> the submodule that defines it
    "SamplingConfig": "config",
    "Completed": "continuous",
    "ContinuousEngine": "continuous",
    "request_keys": "continuous",
    "DecodeOut": "core",
    "DecodeSpec": "core",
    "Knobs": "core",
    "decode": "core",
    "prefill": "core",
    "score": "core",
    "CompileEvent": "sampler",
    "PreparedParams": "sampler",
    "SampleOutput": "sampler",
    "Sampler": "sampler",
    "batch_bucket": "sampler",
    "length_bucket": "sampler",
    "sample_logits": "step",
    "top_p_filter": "step",
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
