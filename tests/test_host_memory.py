"""The host allocator setting that `python -m tbajax.main` applies: freed memory is reused, not
page-faulted in anew, by default where JAX runs on CPU; a bad $TBAJAX_HOST_MALLOC is refused
with the choices named."""

import os
import platform
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# allocate, fill and free 64 MB ten times after one warm-up cycle; print the page faults it took
_CYCLES = r"""
import ctypes, resource, sys
from tbajax.system.host_memory import keep_freed_memory
mode = keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
n = 64 << 20
def cycle():
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    libc.free(p)
cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    cycle()
print(mode, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> tuple[str, int]:
    env = {**os.environ, "TBAJAX_HOST_MALLOC": mode, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", _CYCLES], env=env, capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()
    return applied, int(faults)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is for glibc malloc")
def test_freed_memory_is_reused_instead_of_faulted_in_again():
    assert _faults("reuse") == ("reuse", pytest.approx(0, abs=200))
    applied, faults = _faults("system")  # glibc's default maps and unmaps a 64 MB block each time
    assert applied == "system" and faults > 10 * (64 << 20) // 4096 // 2


def test_auto_reuses_where_jax_runs_on_cpu_only(monkeypatch):
    from tbajax.system import host_memory

    monkeypatch.delenv("TBAJAX_HOST_MALLOC", raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert host_memory.requested_mode() == "auto" and host_memory.jax_runs_on_cpu()
    if platform.libc_ver()[0] == "glibc":
        assert host_memory.effective_mode() == "reuse"
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")  # an accelerator host keeps glibc's defaults
    assert not host_memory.jax_runs_on_cpu() and host_memory.effective_mode() == "system"
    monkeypatch.setenv("TBAJAX_HOST_MALLOC", "reuse")  # unless asked
    assert host_memory.effective_mode() in ("reuse", "unsupported")


def test_a_bad_mode_is_refused_with_the_choices():
    env = {**os.environ, "TBAJAX_HOST_MALLOC": "jemalloc", "PYTHONPATH": ROOT}
    command = [sys.executable, "-m", "tbajax.main", "--print-config"]
    out = subprocess.run(command, env=env, capture_output=True, text=True)
    assert out.returncode == 2
    assert "TBAJAX_HOST_MALLOC='jemalloc'" in out.stderr and "auto, reuse, system" in out.stderr
