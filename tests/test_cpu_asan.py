"""The C++ kernels under AddressSanitizer: hostile sections never read or write out of bounds, nor do the quantizers.

Comparing outputs (test_backends.py) cannot see an out-of-bounds read that
happens to return the right answer; ASan can. The extension is rebuilt with
-fsanitize=address into a temp dir and the fuzz cases run against it in a
subprocess, with libasan preloaded because python itself is not instrumented.
"""
from __future__ import annotations

import pytest

from asan_helpers import run_driver

pytestmark = pytest.mark.build  # ASan/UBSan builds: the `build` tier, not the default run

CASES = 1500  # enough fuzz cases to reach every section's error paths, few enough for the build tier


def test_fuzz_cases_under_asan(asan_extension):
    run_driver("asan_driver.py", *asan_extension, CASES, 7)
