"""The CUDA kernels on CPU fibers under AddressSanitizer and UBSan.

The default harness run (test_cuda_sim.py) compares bytes and puts unmapped
pages after each argument, which catches a write past a buffer and a read
that runs onto the next page, but not a read of a few bytes past the end that
is then ignored. ASan checks every access to the byte, UBSan every shift,
overflow and misaligned load. The harness is rebuilt with both into its
cache, and the driver's medium battery (every width and order, sizes around a
chunk, misaligned views, hostile sections, checksums, the fused detector,
three schedules; 216 cases) runs in a subprocess with libasan preloaded (python is not
instrumented). A planted over-read that only ASan can see must be caught.
"""
from __future__ import annotations

import os
import subprocess

import pytest

cudasim = pytest.importorskip("cudasim")
from cudasim.mutants import ASAN_ONLY, apply  # noqa: E402

pytestmark = pytest.mark.build  # ASan/UBSan builds: the `build` tier, not the default run


def _asan_env() -> dict:
    cxx = cudasim.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler on PATH: the CUDA harness compiles with g++")
    r = subprocess.run([cxx, "-print-file-name=libasan.so"], capture_output=True, text=True)
    lib = r.stdout.strip()
    if r.returncode or not os.path.isabs(lib) or not os.path.exists(lib):
        pytest.skip(f"{cxx} has no libasan.so (install the compiler's libasan package)")
    return dict(os.environ, LD_PRELOAD=lib, ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=0",
                UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1", WSYNC_THREADS="2")


def test_every_kernel_clean_under_asan_and_ubsan():
    env = _asan_env()
    so = cudasim.build([cudasim.CSRC / "delta_cuda.cu"], sanitize=True)
    r = cudasim.run_driver(so, "--mode", "medium", env=env, timeout=1800)
    assert "Sanitizer" not in r.stderr and "runtime error" not in r.stderr, r.stderr[-6000:]
    assert r.returncode == 0 and r.stdout.startswith("ok") and "sanitized" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.parametrize("mutant", ASAN_ONLY, ids=lambda m: m.name)
def test_over_read_only_asan_sees_is_caught(mutant):
    env = _asan_env()
    so = cudasim.build([apply(mutant)], sanitize=True)
    quiet = cudasim.run_driver(cudasim.build([apply(mutant)]), "--mode", "quick")
    assert quiet.returncode == 0, "the plain harness now catches it: move it to MUTANTS\n" + quiet.stdout[-2000:]
    r = cudasim.run_driver(so, "--mode", "quick", env=env)
    assert r.returncode != 0 and "AddressSanitizer" in r.stderr, r.stdout[-2000:] + r.stderr[-3000:]
    assert "heap-buffer-overflow" in r.stderr and "load_vec" in r.stderr, r.stderr[-4000:]
