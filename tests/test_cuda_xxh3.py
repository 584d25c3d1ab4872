"""wsync's own XXH3-64 (csrc/xxh3.h), shared by the C++ and the CUDA kernels: python-xxhash's digests, always.

The header is built three ways (AVX2, SSE2, plain C++; tests/cudasim/xxh3_probe.py)
and each is held to xxhash.xxh3_64_intdigest for every length from 0 to 4,096
bytes (every short-input class, every stripe and 1 KiB block edge) at aligned
and odd addresses, and for large random buffers. The CUDA kernel that hashes
1 MiB blocks with a warp each runs the same lengths on the CPU harness, and
wsync._cpu's block tree (which streams pieces through the same functions)
matches wsync.checksum. No third-party XXH3 is left in csrc/.
"""
from __future__ import annotations

import numpy as np
import pytest
import xxhash

from wsync.checksum import BLOCK, checksum

cudasim = pytest.importorskip("cudasim")
from cudasim import xxh3_probe  # noqa: E402


@pytest.fixture(scope="module")
def impls():
    if cudasim.compiler() is None:
        pytest.skip("no C++ compiler on PATH")
    return xxh3_probe.load()


def test_every_variant_this_cpu_runs_is_built(impls):
    assert "scalar" in impls and set(impls) == set(xxh3_probe.available())


@pytest.mark.parametrize("variant", ["avx2", "sse2", "scalar"])
def test_every_length_to_4096_matches_xxhash(impls, variant):
    if variant not in impls:
        pytest.skip(f"this CPU does not run the {variant} build")
    fn = impls[variant]
    raw = np.random.default_rng(1).integers(0, 256, 4096 + 64, dtype=np.uint8)
    for start in (0, 3):
        for n in range(4097):
            view = raw[start : start + n]
            assert fn(view) == xxhash.xxh3_64_intdigest(view.tobytes()), f"{variant}: {n} bytes at +{start}"


@pytest.mark.parametrize("variant", ["avx2", "sse2", "scalar"])
def test_large_random_buffers_match_xxhash(impls, variant):
    if variant not in impls:
        pytest.skip(f"this CPU does not run the {variant} build")
    rng = np.random.default_rng(2)
    for n in (BLOCK - 1, BLOCK, BLOCK + 1, 16 * BLOCK + 17, 3 * 10**7 + 5):
        a = rng.integers(0, 256, n, dtype=np.uint8)
        assert impls[variant](a) == xxhash.xxh3_64_intdigest(a), f"{variant}: {n} bytes"


def test_the_cuda_kernel_every_length_to_4096(impls):
    """The warp-per-block kernel (csrc/ws_xxh3.cuh over xxh3.h), one buffer per length, in one launch."""
    from wsync.backends import cuda

    k = cuda._KernelsOver(cudasim.SimRuntime(cudasim.load(), "random", seed=3))
    rng = np.random.default_rng(3)
    bufs = [rng.integers(0, 256, n, dtype=np.uint8) for n in range(4097)]
    got = k.launcher.block_digests(bufs)
    for b, d in zip(bufs, got):
        assert d.tolist() == ([xxhash.xxh3_64_intdigest(b)] if b.nbytes else []), f"{b.nbytes} bytes"


def test_the_cpu_extension_block_tree_matches_the_reference():
    cpu = pytest.importorskip("wsync.backends.cpu")._import_extension()
    rng = np.random.default_rng(4)
    for n in (0, 1, 240, 241, 4096, BLOCK + 1, 5 * BLOCK + 1234):
        a = rng.integers(0, 256, n, dtype=np.uint8)
        assert f"{cpu.checksum(a):016x}" == checksum(a), n


def test_no_vendored_xxhash_is_left():
    assert not (cudasim.CSRC / "third_party").exists()
    for p in cudasim.CSRC.iterdir():
        text = p.read_text(errors="replace") if p.is_file() else ""
        assert "xxhash.h" not in text and "XXH_INLINE_ALL" not in text, p.name
