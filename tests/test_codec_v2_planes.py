"""Delta v2's C++ fast path (csrc/ws_v2_planes.h): the same bytes as the reference on the data that takes it,
on the data that does not, and with the fast path or its AVX2 forms turned off (in a subprocess).

Each case says which path its chunks must take, read from wsync._cpu.v2_paths(): a float tensor's classes
fit the window (planes), a few elements far outside it ride in the rest list (planes), one huge element per
chunk moves the top class but the window is chosen by counts (planes), uniform exponents do not fit
(portable), and short tails of every length.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from wsync import dtypes
from wsync.codecs import delta_ref

from codec_helpers import delta_pair, twin_matches_reference as _check

CHUNK = 65536


def _kernels():
    from wsync import backends
    from wsync.errors import BackendUnavailable

    try:
        k = backends.kernels("cpu")
    except BackendUnavailable as e:
        pytest.skip(str(e))
    if not hasattr(k._cpu, "v2_paths"):
        pytest.skip("the C++ backend has no v2 kernels")
    return k


def _bf16(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _steps(old: np.ndarray, idx: np.ndarray, rng) -> np.ndarray:
    """old with the elements at idx moved by small steps and a few escapes (bf16 keys)."""
    dt = dtypes.DTYPES["BF16"]
    new = old.copy()
    steps = rng.choice([1, -1, 1, -1, 2, -3, 9, -200], len(idx)).astype(np.int64)
    k = (delta_ref.monotone_key(old[idx], dt.order).astype(np.int64) + steps) & 0xFFFF
    new[idx] = delta_ref.unkey(k.astype(np.uint16), dt.order)
    return new


def _case(kind: str, rng):
    """(dtype, old, new, the path every chunk must take: "planes", "portable" or None for either)."""
    n = 3 * CHUNK + 4099
    if kind == "gaussian":
        old = _bf16(rng.standard_normal(n) * 0.02)
    elif kind == "rest":  # 0.3% of elements 2^-40 or so: far below the window, some of them changed
        x = rng.standard_normal(n) * 0.02
        far = rng.choice(n, n // 300, replace=False)
        x[far] = rng.standard_normal(len(far)) * 1e-12
        old = _bf16(x)
        idx = np.union1d(rng.choice(n, n // 100, replace=False), far[::3])
        return dtypes.DTYPES["BF16"], old, _steps(old, idx, rng), "planes"
    elif kind == "huge_top":  # one element per chunk 2^100: a window from the top class would hold nothing
        x = rng.standard_normal(n) * 0.02
        x[::CHUNK] = 1e30
        old = _bf16(x)
    elif kind == "wide":  # exponents uniform over all 256 classes
        old = rng.integers(0, 1 << 16, n, dtype=np.uint64).astype(np.uint16)
        old[(old & 0x7F80) == 0x7F80] ^= 0x0100  # no inf/nan
        idx = rng.choice(n, n // 100, replace=False)
        return dtypes.DTYPES["BF16"], old, _steps(old, idx, rng), "portable"
    else:
        raise ValueError(kind)
    idx = rng.choice(n, n // 100, replace=False)
    return dtypes.DTYPES["BF16"], old, _steps(old, idx, rng), "planes"


@pytest.mark.parametrize("kind", ["gaussian", "rest", "huge_top", "wide"])
def test_each_path_gives_the_reference_bytes(kind, rng):
    k = _kernels()
    dt, old, new, path = _case(kind, rng)
    before = k._cpu.v2_paths()
    _check(k, dt, old, new, kind)
    planes, portable = (a - b for a, b in zip(k._cpu.v2_paths(), before))
    chunks = 2 * -(-len(old) // CHUNK)  # encoded and decoded
    if path == "planes":
        # huge_top: the first chunk a thread meets may be built twice (the window from the top class fails,
        # its counts choose another), never the portable path
        assert (planes, portable) == (chunks, 0), kind
    else:
        assert (planes, portable) == (0, chunks), kind


@pytest.mark.parametrize("tail", [1, 2, 15, 16, 17, 63, 64, 65, 1000, 4099])
def test_short_last_chunks(tail, rng):
    """The last word's and group's elements past the chunk get code 15, and must not be counted."""
    k = _kernels()
    for name in ("BF16", "F32", "F16"):
        dt, old, new = delta_pair(name, 2 * CHUNK + tail, rng)
        new[-tail:] = old[-tail:] ^ dt.bits_dtype.type(1)
        _check(k, dt, old, new, (name, tail))


def test_every_dtype_in_process(rng):
    """Every dtype through the fast path (the float widths read their classes from the base, with AVX2
    where the CPU has it; the others from class bytes)."""
    k = _kernels()
    for name in sorted(dtypes.DTYPES):
        dt, old, new = delta_pair(name, 2 * CHUNK + 999, rng)
        _check(k, dt, old, new, name)


@pytest.mark.parametrize("env", ["WSYNC_V2_PORTABLE", "WSYNC_NO_AVX2"])
def test_every_dtype_and_case_with_a_path_turned_off(env):
    """In a subprocess: every dtype and every case above with the planes off (the portable code alone) or
    with AVX2 off (the planes made and counted with SSE2 and popcnt), still the reference's bytes."""
    _kernels()
    code = (
        "import numpy as np, sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from wsync import dtypes, backends\n"
        "from codec_helpers import delta_pair, twin_matches_reference as _check\n"
        "from test_codec_v2_planes import _case\n"
        "k = backends.kernels('cpu'); rng = np.random.default_rng(7)\n"
        "for name in sorted(dtypes.DTYPES):\n"
        "    dt, old, new = delta_pair(name, 2 * 65536 + 999, rng); _check(k, dt, old, new, name)\n"
        "for kind in ('gaussian', 'rest', 'huge_top', 'wide'):\n"
        "    dt, old, new, _ = _case(kind, rng); _check(k, dt, old, new, kind)\n"
        "print(*k._cpu.v2_paths())\n"
    )
    tests = str(Path(__file__).parent)
    r = subprocess.run([sys.executable, "-c", code, tests], env={**os.environ, env: "1"}, capture_output=True,
                       text=True, timeout=300, cwd=tests)
    assert r.returncode == 0, r.stderr[-3000:]
    planes, portable = map(int, r.stdout.split()[-2:])
    assert portable > 0
    assert (planes == 0) == (env == "WSYNC_V2_PORTABLE")
