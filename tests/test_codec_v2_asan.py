"""Delta v2's C++ kernels under AddressSanitizer: mutated payloads never read or write out of bounds.

The extension is rebuilt with -fsanitize=address (test_cpu_asan's build) and tests/asan_driver_v2.py runs
honest and mutated cases against it in a subprocess, beside the reference.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from test_cpu_asan import ROOT, _build, _libasan

pytestmark = pytest.mark.slow
CASES = 120  # about 25 s with the build, on 2 cores


def test_v2_cases_under_asan(tmp_path):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found: cannot build the AddressSanitizer variant of wsync._cpu")
    libasan = _libasan(gxx)
    if libasan is None:
        pytest.skip(f"{gxx} has no libasan.so (install the compiler's libasan package)")
    so = _build(gxx, tmp_path)
    env = dict(os.environ, LD_PRELOAD=libasan, ASAN_OPTIONS="detect_leaks=0:halt_on_error=1", WSYNC_THREADS="2",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "asan_driver_v2.py"), str(so), str(CASES), "3"],
                       capture_output=True, text=True, env=env, cwd=ROOT / "tests", timeout=600)
    assert "AddressSanitizer" not in r.stderr, r.stderr[-5000:]
    assert r.returncode == 0, r.stderr[-5000:]
    assert r.stdout.startswith("ok"), r.stdout
