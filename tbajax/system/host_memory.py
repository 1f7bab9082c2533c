"""Keep freed host memory in the process, so a step's buffers are not page-faulted in anew.

XLA's CPU runtime allocates every large temporary and output of a program with the C allocator
and frees it when the program ends. glibc hands out allocations above its mmap threshold (32 MB
at most) as fresh mappings and unmaps them on free; smaller ones come from per-thread arenas
that shrink when freed. Either way the next step writes to pages the kernel must fault in and
zero again: a 50M-parameter train step on a 2-core CPU took ~250k page faults (1 GB) per call.
With one arena, no per-allocation mappings and no trimming, the freed pages stay in the heap and
the next step reuses them: its median step went from 5.5 to 4.8 s (torch's, given the same
setting, from 4.6 to 4.0 s; the benchmarks record the mode they ran with).

The price is resident memory: it stays at its peak, and fragmentation raises the peak (the
train-step benchmark's tbajax process: 1.8 -> 2.9 GB at 10M, 4.1 -> 5.0 GB at 50M). `python -m tbajax.main` applies it at startup, before any thread exists (every
role process of a run starts there); `tbajax.main.main()` called from other code (a test, a
notebook) leaves that process alone, and code that drives tbajax from its own entry point may
call `keep_freed_memory()` first thing. `TBAJAX_HOST_MALLOC=system` keeps glibc's defaults.
"""

from __future__ import annotations

import ctypes
import os
import platform

ENV = "TBAJAX_HOST_MALLOC"
MODES = ("reuse", "system")

# mallopt(3) parameters
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8


def requested_mode() -> str:
    """The mode $TBAJAX_HOST_MALLOC asks for ("reuse" when unset)."""
    mode = os.environ.get(ENV, "reuse").strip().lower() or "reuse"
    if mode not in MODES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: choose one of {', '.join(MODES)}")
    return mode


def keep_freed_memory() -> str:
    """Configure glibc malloc to keep freed memory (see the module docstring), unless
    $TBAJAX_HOST_MALLOC=system. Call it before threads start allocating. Returns the mode in
    effect: "reuse", "system", or "unsupported" (not glibc: nothing to change)."""
    mode = requested_mode()
    if mode == "system":
        return mode
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "unsupported"
    libc = ctypes.CDLL(None)
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1))  # -1: never trim
    failed = [param for param, value in settings if libc.mallopt(param, value) != 1]
    if failed:
        raise OSError(f"mallopt refused parameters {failed}; set {ENV}=system to run with glibc's defaults")
    return mode
