"""pytest-benchmark suite: wsync's delta tiers beside the peers and a copy baseline.

Each benchmark checks the result is bit-exact and records size figures in
extra_info, so a saved run (--benchmark-json) carries ratio and bits/changed
next to the timings. Compare timings only as ratios within one run.
"""
from __future__ import annotations

import numpy as np
import pytest

import wsync
from wsync_bench.peers import PEERS

SCHEMES = ["wsync-sparse", "wsync-packed"] + [n for n in PEERS if n != "raw"]


def _bits(state):
    return {n: t.bits for n, t in state.items()}


def _changed(base, new):
    return sum(int(np.count_nonzero(base[n].bits != new[n].bits)) for n in new)


def _record(benchmark, base, new, nbytes):
    model = sum(t.nbytes for t in new.values())
    benchmark.extra_info.update(model_bytes=model, payload_bytes=nbytes, ratio_vs_raw=model / nbytes,
                                bits_per_changed=8 * nbytes / max(_changed(base, new), 1))


def test_copy_baseline(benchmark, snapshot_pair):
    """numpy copy of the same model bytes: the yardstick for every GB/s here."""
    _, new = snapshot_pair
    benchmark.group = "encode"
    out = benchmark(lambda: {n: t.bits.copy() for n, t in new.items()})
    assert all(np.array_equal(out[n], new[n].bits) for n in new)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_encode(benchmark, snapshot_pair, scheme):
    base, new = snapshot_pair
    benchmark.group = "encode"
    if scheme.startswith("wsync-"):
        tier = scheme.split("-")[1]
        payload = benchmark(lambda: wsync.encode(base, new, tier=tier))
        out = wsync.apply_state(base, payload)
        assert all(out[n].bits.tobytes() == new[n].bits.tobytes() for n in new)
        _record(benchmark, base, new, payload.nbytes)
        return
    peer = PEERS[scheme]
    if not peer.available():
        pytest.skip(peer.why_unavailable)
    blob = benchmark(lambda: peer.encode(_bits(base), _bits(new)))
    out = peer.decode(_bits(base), blob)
    assert all(out[n].tobytes() == new[n].bits.tobytes() for n in new)
    _record(benchmark, base, new, len(blob))


@pytest.mark.parametrize("tier", ["sparse", "packed"])
def test_apply(benchmark, snapshot_pair, tier):
    base, new = snapshot_pair
    benchmark.group = "apply"
    payload = wsync.encode(base, new, tier=tier)
    out = benchmark(lambda: wsync.apply_state(base, payload))
    assert all(out[n].bits.tobytes() == new[n].bits.tobytes() for n in new)
    _record(benchmark, base, new, payload.nbytes)


def test_apply_copy_baseline(benchmark, snapshot_pair):
    base, _ = snapshot_pair
    benchmark.group = "apply"
    benchmark(lambda: {n: t.bits.copy() for n, t in base.items()})
