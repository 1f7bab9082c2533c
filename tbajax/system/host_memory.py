"""Keep freed host memory in the process, so a step's buffers are not page-faulted in anew.

XLA's CPU runtime allocates every large temporary and output of a program with the C allocator
and frees it when the program ends. glibc hands out allocations above its mmap threshold (32 MB
at most) as fresh mappings and unmaps them on free; smaller ones come from per-thread arenas
that shrink when freed. Either way the next step writes to pages the kernel must fault in and
zero again. With one arena, no per-allocation mappings and no trimming, the freed pages stay
in the heap and the next step reuses them: on a 2-core CPU the 50M train step went from 5.60 to
4.24 s, torch's given the same setting from 4.53 to 4.21 s
(`experiments/results/benchmarks/train_step_system_malloc.json` against `train_step.json`; the
benchmarks record the mode they ran with).

The price is resident memory: it stays at its peak, and fragmentation raises the peak (that
benchmark's tbajax process: 1.8 -> 2.0 GB at 10M, 4.1 -> 6.5 GB at 50M).

`python -m tbajax.main` applies it at startup, before any thread exists (every role process of a
run starts there); `tbajax.main.main()` called from other code (a test, a notebook) leaves that
process alone, and code that drives tbajax from its own entry point may call
`keep_freed_memory()` first thing. It applies where JAX runs on CPU (`TBAJAX_HOST_MALLOC=auto`,
the default); `reuse` forces it, `system` keeps glibc's defaults.
"""

from __future__ import annotations

import ctypes
import os
import platform

ENV = "TBAJAX_HOST_MALLOC"
MODES = ("auto", "reuse", "system")

# mallopt(3) parameters
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8


def requested_mode() -> str:
    """The mode $TBAJAX_HOST_MALLOC asks for ("auto" when unset)."""
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: choose one of {', '.join(MODES)}")
    return mode


def jax_runs_on_cpu() -> bool:
    """Whether this process's JAX will pick the CPU backend, decided without initialising JAX:
    $JAX_PLATFORMS if set (its first entry), else whether no accelerator plugin is installed (JAX
    finds GPU plugins through the `jax_plugins` entry points, TPUs through `libtpu`)."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip().lower() == "cpu"
    from importlib.metadata import entry_points
    from importlib.util import find_spec

    return not list(entry_points(group="jax_plugins")) and find_spec("libtpu") is None


def effective_mode() -> str:
    """What `keep_freed_memory()` does here: "reuse", "system" or "unsupported" (not glibc).
    "auto" reuses on hosts where JAX runs on CPU, the case measured; on accelerator hosts, whose
    large buffers live in device memory, one malloc arena shared by every host thread would be a
    cost with nothing measured against it, so they keep glibc's defaults unless asked."""
    mode = requested_mode()
    if mode == "auto":
        mode = "reuse" if jax_runs_on_cpu() else "system"
    if mode == "reuse" and (platform.system() != "Linux" or platform.libc_ver()[0] != "glibc"):
        return "unsupported"
    return mode


def keep_freed_memory() -> str:
    """Configure glibc malloc to keep freed memory (see the module docstring) where
    `effective_mode()` says "reuse"; returns that mode. Call it before threads start allocating."""
    mode = effective_mode()
    if mode != "reuse":
        return mode
    libc = ctypes.CDLL(None)
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1))  # -1: never trim
    failed = [param for param, value in settings if libc.mallopt(param, value) != 1]
    if failed:
        raise OSError(f"mallopt refused parameters {failed}; set {ENV}=system to run with glibc's defaults")
    return mode
