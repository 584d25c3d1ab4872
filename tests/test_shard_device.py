"""Sharded sync with both sides on GPUs, run on the CPU: trainer ranks' local shards and engine ranks' local
tensors are device tensors of the fake CUDA runtime (tests/cudasim/fakert.py), whose kernels run for real on
CPU fibers. Pieces are copied, hashed, encoded, staged, applied and committed on the device; the test counts
the bytes that cross to the host and compares every engine tensor byte for byte with the reference.

Stand-ins: the runtime (every rank shares one fake runtime, in this process, as threads; on a cluster each rank
is a process with its own GPU). The sync code, the coordinator and the tcp links are the real ones.
"""
from __future__ import annotations

import numpy as np
import pytest

from helpers import TOKEN
from shard_helpers import Reference, engine_expected, make_plan, qwen_params, sl

from wsync import backends
from wsync import errors as wsync_errors
from wsync.device import DeviceEngine
from wsync.shard.stage import DevicePieces
from wsync.shard.sync import ShardPublisher, ShardSubscriber

from cudasim.fakert import FakeTensor  # noqa: E402


def test_sharded_ranks_on_gpus_commit_bit_exact_with_only_digests_crossing(device_rt):
    m, n = 2, 3  # FSDP2 over two trainer ranks into torch TP over three engine ranks: uneven shards both ways
    plan = make_plan(m, n, "hf")
    ref = Reference(qwen_params())
    locals_ = [{h.name: FakeTensor(ref.at(0)[h.name][sl(h.box)].copy(), 0, logical="BF16")
                for h in plan.trainer.held if h.rank == t} for t in range(m)]
    lives = [{name: FakeTensor(np.zeros(p.shape, np.uint16), 0, logical="BF16")
              for (r, name), p in plan.engine.locals.items() if r == rank} for rank in range(n)]
    model_bytes = sum(int(np.prod(p.shape)) * 2 for p in plan.trainer.params.values())
    pubs, subs = [], []
    try:
        pubs.append(ShardPublisher(plan, 0, coordinator="tcp://127.0.0.1:0", host_coordinator=True, token=TOKEN,
                                   timeout=30.0, tier="sparse"))
        address = pubs[0].coordinator_address
        pubs += [ShardPublisher(plan, t, coordinator=address, token=TOKEN, tier="sparse") for t in range(1, m)]
        subs = [ShardSubscriber(plan, r, lives[r], coordinator=address, token=TOKEN) for r in range(n)]
        crossed = []
        for v in range(5):  # a keyframe, then deltas moving ~1% of the values
            bits = ref.at(v)
            for t in range(m):  # the trainer's step, in place on its device shards
                for h in plan.trainer.held:
                    if h.rank == t:
                        locals_[t][h.name].data[...] = bits[h.name][sl(h.box)]
            before = dict(device_rt.crossed)
            for t, pub in enumerate(pubs):
                pub.publish(locals_[t], v)
            res = pubs[0].wait(v, timeout=60)
            assert res["outcome"] == "committed" and res["digest"] == res["expected"], res
            for sub in subs:
                assert sub.wait_for(v, timeout=60) == v
            crossed.append({d: device_rt.crossed[d] - before[d] for d in before})
            for rank in range(n):
                for name, want in engine_expected(plan, rank, bits).items():
                    assert lives[rank][name].data.tobytes() == want.tobytes(), (v, rank, name)
        for sub in subs:
            for src in sub.stage.sources.values():
                assert isinstance(src.engine, DevicePieces) and isinstance(src._bound, DeviceEngine)
        assert all(pub._on_device for pub in pubs)  # the trainers' pieces were copied on the device
        for v in range(1, 5):  # deltas: the sparse sections and the checks' words, far from the model
            assert crossed[v]["d2h"] < model_bytes / 10 and crossed[v]["h2d"] < model_bytes / 10, (v, crossed[v])
    finally:
        for sub in subs:
            sub.close()
        for pub in reversed(pubs):
            pub.close()


def test_device_stream_digests_equal_the_host_ones(device_rt):
    """A pair's partial digest must not depend on where each end holds its pieces: a trainer on the host and
    an engine on a GPU (or the reverse) compare the same digests."""
    from wsync.shard import streams

    rng = np.random.default_rng(3)
    arrays = [rng.integers(0, 1 << 16, (37, 50), dtype=np.uint16), rng.integers(0, 1 << 32, (300_001,), np.uint32),
              rng.integers(0, 1 << 16, (9, 70_000), dtype=np.uint16)]
    logical = ["BF16", "F32", "F16"]
    boxes = [((3, 30), (5, 50)), ((0, 300_001),), ((1, 8), (0, 70_000))]
    host = streams.tables((a, b) for a, b in zip(arrays, boxes))
    want = streams.sums(backends.kernels(), host)
    dev = [FakeTensor(a, 0, logical=lg) for a, lg in zip(arrays, logical)]
    assert streams.device_sums(backends.device_kernels(), list(zip(dev, boxes))) == want
    assert len(want) == 2  # two dtypes' streams: <u2 (two tensors, in order) and <u4


@pytest.mark.gpu
def test_on_a_gpu_sharded_ranks_commit_bit_exact():
    """The same on a real GPU (cupy's runtime, torch's streams): trainer shards and engine tensors on cuda:0."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    try:
        backends.device_kernels()
    except wsync_errors.BackendUnavailable as e:
        pytest.skip(str(e))
    m, n = 2, 3
    plan = make_plan(m, n, "hf")
    ref = Reference(qwen_params())

    def cuda(bits):
        return torch.from_numpy(bits.copy()).view(torch.bfloat16).cuda()

    locals_ = [{h.name: cuda(ref.at(0)[h.name][sl(h.box)]) for h in plan.trainer.held if h.rank == t} for t in range(m)]
    lives = [{name: torch.zeros(p.shape, dtype=torch.bfloat16, device="cuda")
              for (r, name), p in plan.engine.locals.items() if r == rank} for rank in range(n)]
    pubs, subs = [], []
    try:
        pubs.append(ShardPublisher(plan, 0, coordinator="tcp://127.0.0.1:0", host_coordinator=True, token=TOKEN,
                                   timeout=30.0, tier="sparse"))
        pubs += [ShardPublisher(plan, t, coordinator=pubs[0].coordinator_address, token=TOKEN, tier="sparse")
                 for t in range(1, m)]
        subs = [ShardSubscriber(plan, r, lives[r], coordinator=pubs[0].coordinator_address, token=TOKEN)
                for r in range(n)]
        for v in range(4):
            bits = ref.at(v)
            for t in range(m):
                for h in plan.trainer.held:
                    if h.rank == t:
                        locals_[t][h.name].copy_(cuda(bits[h.name][sl(h.box)]))
            for t, pub in enumerate(pubs):
                pub.publish(locals_[t], v)
            res = pubs[0].wait(v, timeout=60)
            assert res["outcome"] == "committed" and res["digest"] == res["expected"], res
            for rank, sub in enumerate(subs):
                assert sub.wait_for(v, timeout=60) == v
                for name, want in engine_expected(plan, rank, bits).items():
                    got = lives[rank][name].view(torch.int16).cpu().numpy().view(np.uint16)
                    assert got.tobytes() == want.tobytes(), (v, rank, name)
        assert all(isinstance(src.engine, DevicePieces) for sub in subs for src in sub.stage.sources.values())
    finally:
        for sub in subs:
            sub.close()
        for pub in reversed(pubs):
            pub.close()
