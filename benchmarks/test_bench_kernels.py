"""pytest-benchmark suite for the codec backends: end to end and kernel by kernel, beside a numpy copy.

    python -m pytest benchmarks/test_bench_kernels.py --benchmark-only --benchmark-group-by=group
    WSYNC_BENCH_KERNEL_MB=256 python -m pytest benchmarks/test_bench_kernels.py --benchmark-only

The data is wsync_bench.kernels.make_pair: bf16, 1% of elements changed,
mostly by ±1 representable value. Every benchmark checks its result against
the reference and records GB/s of model bytes (best round) in extra_info;
compare those only as ratios against the copy baseline of the same run. The
same numbers in one run and one table: `wsync bench kernels`.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import wsync
from wsync import backends
from wsync.errors import BackendUnavailable
from wsync_bench.kernels import make_pair

MB = int(os.environ.get("WSYNC_BENCH_KERNEL_MB", "64"))
BACKENDS = ["ref", "cpu"]


@pytest.fixture(scope="module")
def pair():
    return make_pair(MB << 20, 0.01, tensors=8)


@pytest.fixture(scope="module")
def payload(pair):
    return wsync.encode(*pair, tier="sparse", backend="ref")


def _kernels(name):
    try:
        return backends.kernels(name)
    except BackendUnavailable as e:
        pytest.skip(str(e))


def _gbps(benchmark, pair):
    if benchmark.stats is None:  # --benchmark-disable: the functions ran once, as tests
        return
    model = sum(tb.nbytes for tb in pair[1].values())
    benchmark.extra_info.update(model_bytes=model, gbps_best=model / benchmark.stats.stats.min / 1e9)


def test_copy_baseline(benchmark, pair):
    """numpy copy of the model bytes: the yardstick for every GB/s here."""
    base = pair[0]
    dst = {n: np.empty_like(tb.bits) for n, tb in base.items()}
    benchmark.group = "baseline"
    benchmark(lambda: [np.copyto(dst[n], tb.bits) for n, tb in base.items()])
    _gbps(benchmark, pair)


@pytest.mark.parametrize("name", BACKENDS)
def test_encode_end_to_end(benchmark, pair, payload, name):
    _kernels(name)
    benchmark.group = "encode (wsync.encode, sparse)"
    out = benchmark(lambda: wsync.encode(*pair, tier="sparse", backend=name))
    assert out.to_bytes() == payload.to_bytes()
    _gbps(benchmark, pair)


@pytest.mark.parametrize("name", BACKENDS)
def test_apply_end_to_end(benchmark, pair, payload, name):
    """Out of place: fresh result arrays (their pages are faulted in, as numpy's copy_fresh baseline's are)."""
    _kernels(name)
    base, new = pair
    benchmark.group = "apply (wsync.apply_state)"
    out = benchmark(lambda: wsync.apply_state(base, payload, backend=name))
    assert all(out[n].bits.tobytes() == new[n].bits.tobytes() for n in new)
    _gbps(benchmark, pair)


@pytest.mark.parametrize("name", BACKENDS)
def test_apply_inplace_end_to_end(benchmark, pair, payload, name):
    """In place into resident arrays, reset (untimed) before every round: an engine updating its weights."""
    import torch

    _kernels(name)
    base, new = pair
    bits = {n: tb.bits.copy() for n, tb in base.items()}
    target = {n: torch.from_numpy(b).view(torch.bfloat16) for n, b in bits.items()}  # what an engine holds

    def reset():
        for n, tb in base.items():
            np.copyto(bits[n], tb.bits)
        return (), {}

    benchmark.group = "apply in place (wsync.apply, inplace=True)"
    benchmark.pedantic(lambda: wsync.apply(target, payload, inplace=True, backend=name), setup=reset, rounds=5,
                       warmup_rounds=1)
    assert all(bits[n].tobytes() == new[n].bits.tobytes() for n in new)
    _gbps(benchmark, pair)


def test_copy_fresh_baseline(benchmark, pair):
    """numpy copy into fresh arrays: what any out-of-place result pays for its new pages."""
    base = pair[0]
    benchmark.group = "baseline"
    benchmark(lambda: [tb.bits.copy() for tb in base.values()])
    _gbps(benchmark, pair)


@pytest.mark.parametrize("name", BACKENDS)
def test_kernel_delta_encode(benchmark, pair, name):
    k, ref = _kernels(name), backends.kernels("ref")
    base, new = pair
    benchmark.group = "kernel: delta_encode"
    secs = benchmark(lambda: [k.delta_encode(base[n].bits, new[n].bits, "float") for n in new])
    want = [ref.delta_encode(base[n].bits, new[n].bits, "float") for n in new]
    assert all(np.array_equal(a.gaps, b.gaps) and np.array_equal(a.steps, b.steps) for a, b in zip(secs, want))
    _gbps(benchmark, pair)


@pytest.mark.parametrize("name", BACKENDS)
def test_kernel_delta_decode(benchmark, pair, name):
    k, ref = _kernels(name), backends.kernels("ref")
    base, new = pair
    secs = {n: ref.delta_encode(base[n].bits, new[n].bits, "float") for n in new}
    benchmark.group = "kernel: delta_decode"
    out = benchmark(lambda: {n: k.delta_decode(base[n].bits, secs[n], "float") for n in new})
    assert all(np.array_equal(out[n][1], new[n].bits[out[n][0]]) for n in new)
    _gbps(benchmark, pair)


@pytest.mark.parametrize("name", BACKENDS)
def test_kernel_checksum(benchmark, pair, name):
    k, ref = _kernels(name), backends.kernels("ref")
    new = pair[1]
    benchmark.group = "kernel: checksum"
    out = benchmark(lambda: [k.checksum(tb.bits) for tb in new.values()])
    assert out == [ref.checksum(tb.bits) for tb in new.values()]
    _gbps(benchmark, pair)


@pytest.mark.parametrize("name", BACKENDS)
def test_kernel_fused_encode(benchmark, pair, name):
    """delta_encode + checksums of both tensors, as wsync.encode calls it."""
    k, ref = _kernels(name), backends.kernels("ref")
    base, new = pair
    benchmark.group = "kernel: fused encode"
    out = benchmark(lambda: [k.delta_encode_checksummed(base[n].bits, new[n].bits, "float") for n in new])
    want = [ref.delta_encode_checksummed(base[n].bits, new[n].bits, "float") for n in new]
    assert all(np.array_equal(a.gaps, b.gaps) and np.array_equal(a.steps, b.steps) and a_sums == b_sums
               for (a, *a_sums), (b, *b_sums) in zip(out, want))
    _gbps(benchmark, pair)


@pytest.mark.parametrize("name", BACKENDS)
def test_kernel_fused_apply(benchmark, pair, name):
    """copy + scatter + checksums of base and result, as an out-of-place wsync.apply calls it."""
    k, ref = _kernels(name), backends.kernels("ref")
    base, new = pair
    secs = {n: ref.delta_encode(base[n].bits, new[n].bits, "float") for n in new}
    benchmark.group = "kernel: fused apply"
    out = benchmark(lambda: {n: k.delta_apply(base[n].bits, secs[n], "float") for n in new})
    assert all(out[n][0].tobytes() == new[n].bits.tobytes() for n in new)
    _gbps(benchmark, pair)


@pytest.mark.parametrize("name", BACKENDS)
def test_kernel_fused_apply_inplace(benchmark, pair, name):
    """checksum of base + scatter with undo record + checksum of result, into resident arrays."""
    k, ref = _kernels(name), backends.kernels("ref")
    base, new = pair
    secs = {n: ref.delta_encode(base[n].bits, new[n].bits, "float") for n in new}
    target = {n: tb.bits.copy() for n, tb in base.items()}

    def reset():
        for n, tb in base.items():
            np.copyto(target[n], tb.bits)
        return (), {}

    benchmark.group = "kernel: fused apply in place"
    benchmark.pedantic(lambda: [k.delta_apply_inplace(target[n], secs[n], "float") for n in new], setup=reset,
                       rounds=5, warmup_rounds=1)
    assert all(target[n].tobytes() == new[n].bits.tobytes() for n in new)
    _gbps(benchmark, pair)
