"""Delta v2's C++ encoder and decoder under AddressSanitizer (see test_codec_v2_asan.py).

Usage: python asan_driver_v2.py PATH_TO_ASAN_MODULE N_CASES SEED. Honest cases of every width must give
the reference's bytes; mutated parts (bit flips, truncations, splices of random bytes) must decode to the
reference's answer or be refused, and ASan aborts on any bad access. Prints "ok" and counts per outcome.
"""
from __future__ import annotations

import collections
import sys

import numpy as np

from asan_driver import load_as_wsync_cpu


def main(path: str, n_cases: int, seed: int) -> None:
    mod = load_as_wsync_cpu(path)
    from codec_helpers import decodes_as_the_reference, delta_pair

    from wsync import dtypes
    from wsync.backends.cpu import CpuKernels
    from wsync.codecs import delta_ref, v2_ref

    k = CpuKernels()
    assert k._cpu is mod, "the ASan build was not the one loaded"
    rng = np.random.default_rng(seed)
    names = sorted(dtypes.DTYPES)
    counts = collections.Counter()
    for i in range(n_cases):
        name = names[i % len(names)]
        dt = dtypes.DTYPES[name]
        n = int(rng.integers(40, 140_000 if dt.itemsize <= 2 else 20_000))
        _, old, new = delta_pair(name, n, rng, density=float(rng.choice([0.001, 0.01, 0.1])))
        sec = delta_ref.encode(old, new, dt.order)
        if delta_ref.sparse_size(n, dt.itemsize, sec.n_changed, 0) >= n * dt.itemsize:
            continue
        parts = v2_ref.encode(old, sec, dt)
        assert {p: bytes(v) for p, v in k.v2_encode(old, sec, dt).items()} == parts, name
        bad = dict(parts)
        part = str(rng.choice(list(parts)))
        b = bytearray(bad[part])
        how = int(rng.integers(3))
        if how == 0 and b:
            b[int(rng.integers(len(b)))] ^= 1 << int(rng.integers(8))
        elif how == 1:
            del b[int(rng.integers(len(b) + 1)):]
        else:
            at = int(rng.integers(len(b) + 1))
            b[at:at] = rng.integers(0, 256, int(rng.integers(1, 9)), dtype=np.uint8).tobytes()
        bad[part] = bytes(b)
        counts[decodes_as_the_reference(k, old, bad, dt, (name, part, how))] += 1
    print("ok", dict(counts))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
