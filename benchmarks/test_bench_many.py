"""pytest-benchmark suite: many small tensors beside one tensor of the same size, in one run.

    python -m pytest benchmarks/test_bench_many.py --benchmark-only --benchmark-group-by=group

Each group (encode, apply in place) holds the one-tensor and the many-tensor
run side by side: read their ratio, not their absolute times. Both states are
bound once (wsync.bind), as a trainer and an engine do. WSYNC_BENCH_TENSORS
sets the count (default 20,000 x 1,024 bf16 elements, 1% changed).
"""
from __future__ import annotations

import os

import pytest
import torch

import wsync
from wsync_bench.many import make_states
from wsync.layout import layout_of

TENSORS = int(os.environ.get("WSYNC_BENCH_TENSORS", "20000"))


@pytest.fixture(scope="module")
def states():
    return make_states(TENSORS, 1024, 0.01)


def _raw(state) -> bytes:
    return b"".join(t.view(torch.uint16).numpy().tobytes() for t in state.values())


@pytest.mark.parametrize("shape", ["one", "many"])
def test_encode(benchmark, states, shape):
    base, new = (wsync.bind(s) for s in states[shape])
    members = layout_of(new)
    benchmark.group = f"encode packed, {TENSORS} x 1024 bf16 vs one tensor"
    p = benchmark(lambda: wsync.encode(base, new, tier="packed", members=members, inline=False))
    benchmark.extra_info.update(tensors=len(new), payload_bytes=p.nbytes, manifest_bytes=len(p.manifest.to_json()))
    target = {k: v.clone() for k, v in states[shape][0].items()}
    wsync.apply(target, p, inplace=True, layouts={members.hash: members})
    assert _raw(target) == _raw(states[shape][1])


@pytest.mark.parametrize("shape", ["one", "many"])
def test_apply_inplace(benchmark, states, shape):
    base, new = states[shape]
    p = wsync.encode(wsync.bind(base), wsync.bind(new), tier="packed")
    src = {k: v.clone() for k, v in base.items()}
    target = wsync.bind(src)

    dst, orig = list(src.values()), [base[k] for k in src]

    def reset():  # one multi-tensor copy for either shape, so neither timed apply follows different work
        torch._foreach_copy_(dst, orig)
        return (), {}
    benchmark.group = f"apply in place, {TENSORS} x 1024 bf16 vs one tensor"
    benchmark.pedantic(lambda: wsync.apply(target, p, inplace=True), setup=reset, rounds=5)
    assert _raw(src) == _raw(new)
