"""Delta v2's C++ kernels under AddressSanitizer: mutated payloads never read or write out of bounds.

The extension is rebuilt with -fsanitize=address (test_cpu_asan's build) and tests/asan_driver_v2.py runs
honest and mutated cases against it in a subprocess, beside the reference.
"""
from __future__ import annotations

import pytest

from test_cpu_asan import asan_build, run_driver

pytestmark = pytest.mark.slow
CASES = 120  # about 25 s with the build, on 2 cores


def test_v2_cases_under_asan(tmp_path):
    run_driver("asan_driver_v2.py", *asan_build(tmp_path), CASES, 3)
