#!/usr/bin/env bash
# The prepared GPU check: one command for a session that is lent a GPU machine for a few minutes
# (issue 17's GPU figures and a first look at what breaks there). From the repository root:
#
#     bash experiments/benchmarks/gpu_check.sh [OUT_DIR]     # default: $OUT, else /tmp/gpu_check
#
# Under ~9.5 minutes in all (each step has its own time limit and the script goes on when one fails):
#   1. versions and devices (jax, flax, the GPU);
#   2. the model and sampler tests that need no 8-device mesh, on the GPU (JAX_PLATFORMS=cuda):
#      the families against torch transformers, the sampler against the training forward, and
#      `model.attention=cudnn` against tbajax's own attention (tests/test_gpu_attention.py, the
#      only place that path runs). Their tolerances were set on CPU; fp32 matmuls on a GPU may
#      run in TF32, so a failure here says where the GPU differs, not necessarily a bug;
#   3. the default experiment for 40 steps (`python -m tbajax.main`: trainer and searcher processes
#      sharing the GPU), its summary kept;
#   4. `attention_implementations.py`: the trainer's attention in bf16 with the CPU's loop steps,
#      the accelerator's, jax.nn's materialised XLA attention and cuDNN's;
#   5. `sampler.py` in bf16 for SmolLM2-135M and a 0.5B Qwen2.5-shaped model (random weights, no
#      torch side) at batch 64 and 256: decode tok/s and the share of the memory bandwidth
#      measured in the same run;
#   6. `continuous_shared_prompt.py --quick`: the prompt pool against copied prompts.
# Figures land in OUT_DIR as JSON (attention_implementations_gpu.json, sampler_gpu_bf16.json,
# continuous_shared_prompt_gpu.json, default_run_gpu_summary.json), every step's output in
# gpu_check.log; copy them to experiments/results/benchmarks/ and cite them to use them.
set -uo pipefail
out=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONPATH=.
py=${PYTHON:-python3}
step() {  # step NAME SECONDS COMMAND...: run with a time limit, append its output to OUT_DIR/gpu_check.log, go on
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit} s): $*"
  local t0=$SECONDS log=/tmp/gpu_check_$name.log
  timeout "$limit" "$@" >"$log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  { echo "== $name: exit $rc after $((SECONDS - t0)) s: $*"; cat "$log"; } >>"$out/gpu_check.log"
  tail -n 25 "$log"
}
: >"$out/gpu_check.log"  # one log for all steps: the device tool brings back at most 8 files
step versions 30 "$py" -c "import sys, jax, flax; print(sys.version); print('jax', jax.__version__, 'flax', \
flax.__version__); print(jax.devices()); import jax.numpy as jnp; print(float(jnp.ones(4).sum()))"
step gpu_tests 150 env JAX_PLATFORMS=cuda XLA_FLAGS= "$py" -m pytest -q --maxfail=5 -p no:cacheprovider \
  tests/test_gpu_attention.py tests/test_model_families.py tests/test_sampler.py \
  -k "not sharded and not mesh and not devices"
step default_run_gpu 100 "$py" -m tbajax.main --run-dir /tmp/gpu_default_run --set train.steps=40
cp /tmp/gpu_default_run/summary.json "$out/default_run_gpu_summary.json" 2>/dev/null
step attention_gpu 80 "$py" experiments/benchmarks/attention_implementations.py \
  --json "$out/attention_implementations_gpu.json"
step sampler_gpu 170 "$py" experiments/benchmarks/sampler.py --models smollm2-135M 0.5B --batch 64 256 \
  --dtype bfloat16 --no-torch --json "$out/sampler_gpu_bf16.json"
step continuous_shared_prompt_gpu 60 "$py" experiments/benchmarks/continuous_shared_prompt.py --quick \
  --json "$out/continuous_shared_prompt_gpu.json"
ls -la "$out"
