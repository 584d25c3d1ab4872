"""Runs hostile and honest cases against an AddressSanitizer build of wsync._cpu (see test_cpu_asan.py).

Usage: python asan_driver.py PATH_TO_ASAN_MODULE N_CASES SEED. The module is
installed as wsync._cpu before the backend imports it, so the in-tree build is
never loaded. ASan aborts the process on the first bad access; a clean run
prints "ok" and counts per outcome.
"""
from __future__ import annotations

import collections
import importlib.util
import sys

import numpy as np


def load_as_wsync_cpu(path: str):
    spec = importlib.util.spec_from_file_location("wsync._cpu", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["wsync._cpu"] = mod
    spec.loader.exec_module(mod)
    return mod


def main(path: str, n_cases: int, seed: int) -> None:
    mod = load_as_wsync_cpu(path)
    from kernel_cases import assert_same_sections, check_case, make_case, make_pair

    from wsync.backends.cpu import CpuKernels
    from wsync.checksum import BLOCK, checksum
    from wsync.codecs import delta_ref

    k = CpuKernels()
    assert k._cpu is mod, "the ASan build was not the one loaded"
    rng = np.random.default_rng(seed)
    pick = lambda lo, hi: int(rng.integers(lo, hi, endpoint=True))  # noqa: E731
    counts = collections.Counter(check_case(k, *make_case(pick)) for _ in range(n_cases))
    for i in range(n_cases // 10):  # the encoder reads old and new at every changed index: cover it too
        width, order = (1, 2, 4, 8)[i % 4], ("float", "int", "uint")[i % 3]
        old, new = make_pair(i, width, order, pick(0, 3 * 65536 + 9), (0.0, 0.01, 0.5, 1.0)[i % 4])
        assert_same_sections(k.delta_encode(old, new, order), delta_ref.encode(old, new, order))
    for size in (0, 1, BLOCK - 1, BLOCK + 1, 3 * BLOCK + 7):
        data = rng.integers(0, 256, size=size, dtype=np.uint8)
        assert k.checksum(data) == checksum(data)
    counts["quantized"] = quantizers(k)
    print("ok", dict(counts))


def quantizers(k) -> int:
    """Every quantizer case of the kernel tests (shape classes, dtypes, edge values, a non-finite element) through
    the C++ kernels, against the reference: their reads and writes stay inside the weight and the outputs."""
    from quant_cases import SCHEMES, cases, empty_outputs, non_finite, same

    from wsync.quant import QuantizeError

    n = 0
    for scheme in SCHEMES.values():
        for name, bits, dtype in cases(scheme):
            outs = empty_outputs(scheme, bits, dtype)
            k.quantize(scheme, bits, dtype, outs, name)
            same(outs, scheme.reference(bits, dtype, name), name)
            n += 1
        bad = non_finite((3, 256), "BF16", [(2, 255)], ["nan"])
        try:
            k.quantize(scheme, bad, "BF16", empty_outputs(scheme, bad, "BF16"), "bad")
        except QuantizeError:
            n += 1
        else:
            raise AssertionError("a NaN weight was quantized")
    return n


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
