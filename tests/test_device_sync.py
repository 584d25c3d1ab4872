"""Publisher -> Subscriber with both states on a GPU, run on the CPU: the device path end to end.

The trainer's and the engine's tensors are device tensors of the fake CUDA
runtime (tests/cudasim/fakert.py): the kernels of csrc/*.cu run for real on
CPU fibers, and every copy between device and host goes through the runtime,
which counts its bytes. The sync code (Publisher, Subscriber, wsync.device,
backends.device, CudaKernels) is the one a GPU runs; only the runtime under it
is a stand-in. Tensors are compared byte for byte, and the bytes that cross
to the host per version are held to what the payload carries.
"""
from __future__ import annotations

import secrets

import numpy as np
import pytest

import wsync
from wsync import backends
from wsync.device import DeviceEngine
from wsync.errors import ChecksumError, VersionError
from wsync.payload import Payload

cudasim = pytest.importorskip("cudasim")
from cudasim.fakert import FakeTensor  # noqa: E402
from helpers import TOKEN  # noqa: E402

ADDR = "tcp://127.0.0.1:0"
# uneven sizes: several tensors per segment, a segment alone in its bucket, one tensor across two chunks
SHAPES = {f"layers.{i}.w": (48, 64 + 8 * i) for i in range(12)} | {"embed": (70_001,), "norm": (64,)}


def bf16_state(rng, device: int) -> dict:
    out = {}
    for name, shape in SHAPES.items():
        x = (rng.standard_normal(shape).astype(np.float32) * 0.02).view(np.uint32)
        out[name] = FakeTensor(((x + 0x8000) >> 16).astype(np.uint16), device, logical="BF16")
    return out


def rl_step(state: dict, rng, density: float = 0.01) -> None:
    """In place, as an optimizer step: about `density` of the values move by one or two bf16 steps."""
    for t in state.values():
        flat = t.data.reshape(-1)
        idx = np.flatnonzero(rng.random(flat.size) < density)
        flat[idx] = (flat[idx].astype(np.int64) + rng.choice([-2, -1, 1, 2], len(idx))).astype(np.uint16)


class DeviceModel:
    """An engine whose tensors are device tensors (what HF(model.cuda()) hands the Subscriber)."""

    def __init__(self, state: dict):
        self.state, self.version, self.loads = state, None, 0

    def tensors(self) -> dict:
        return self.state

    def load(self, named) -> None:  # the device path writes in place: a load means a host round trip
        self.loads += 1
        raise AssertionError("a device engine was handed host tensors to load")


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].data.tobytes() == b[k].data.tobytes() for k in a)


@pytest.mark.parametrize("tier", ["sparse", "packed"])
def test_device_states_follow_bit_exact_with_only_the_sections_crossing(device_rt, tier):
    rng = np.random.default_rng(5)
    trainer = bf16_state(rng, device=0)
    engine = DeviceModel(bf16_state(np.random.default_rng(9), device=1))
    model_bytes = sum(t.nbytes for t in trainer.values())
    commits, crossed, allocated = [], [], []
    empty = device_rt.empty_tensor
    device_rt.empty_tensor = lambda n, dt, device: (allocated.append(n * dt.itemsize) if device == 0 else None,
                                             empty(n, dt, device))[1]
    with wsync.Publisher(ADDR, token=TOKEN, tier=tier, keyframe_every=0, bucket_bytes=24 << 10) as pub, \
            wsync.Subscriber(pub.address, engine=engine, token=TOKEN,
                             on_commit=lambda i: commits.append(i["keyframe"])) as sub:
        for v in range(6):
            if v:
                rl_step(trainer, rng)
            before = dict(device_rt.crossed)
            pub.publish(dict(trainer), version=v)  # a fresh dict of the same tensors, as state_dict() gives
            assert sub.wait_for(v, timeout=60) == v
            pub.flush(timeout=30)
            crossed.append({d: device_rt.crossed[d] - before[d] for d in before})
            assert same(trainer, engine.state), f"version {v}"
        sizes = pub.stats.bytes
    assert isinstance(sub._bound, DeviceEngine) and engine.loads == 0
    assert commits == [True] + [False] * 5  # one keyframe, then deltas
    assert sum(allocated) == 2 * model_bytes  # the trainer's snapshots: two, recycled from then on
    # a keyframe's raw bytes cross whole (a host link needs them), once: the engine checks the whole version
    # before it writes, so it keeps no undo copy
    assert model_bytes <= crossed[0]["d2h"] < 1.1 * model_bytes
    for v in range(1, 6):
        assert 0 < crossed[v]["d2h"] < model_bytes / 10, crossed[v]
        if tier == "sparse":  # the payload is the sections themselves
            assert crossed[v]["d2h"] <= sizes[v], (v, crossed[v], sizes[v])
        assert crossed[v]["h2d"] <= 2 * sizes[v] + model_bytes / 20  # sections up, unpacked


def test_the_trainer_blocks_only_to_queue_the_copies(device_rt):
    """publish() of a device state queues the gathers on the caller's stream and returns: nothing it does
    waits for the device (no host read, no event synchronized) before it returns."""
    rng = np.random.default_rng(1)
    trainer = bf16_state(rng, device=0)
    with wsync.Publisher(ADDR, token=TOKEN, keyframe_every=0, bucket_bytes=24 << 10) as pub:
        pub.publish(dict(trainer), version=0)
        pub.flush(timeout=30)
        rl_step(trainer, rng)
        s = device_rt.new_stream(0)
        mark = len(device_rt.log)
        with device_rt.torch_stream(s):  # the optimizer's stream
            pub._raise_pending()
            src = pub._bind(dict(trainer), pub.config.bucket_bytes)
            snap = src.snapshot()
        during = device_rt.log[mark:]
        assert during and all(e[0] in ("copy", "event") for e in during), during
        assert {e[2] for e in during if e[0] == "copy"} == {s}  # after the optimizer's work, on its stream
        snap.wait()


def test_a_device_engine_refuses_bad_versions_and_keeps_every_byte(device_rt):
    rng = np.random.default_rng(2)
    base = {n: t.data.copy() for n, t in bf16_state(rng, 0).items()}
    new = {n: a.copy() for n, a in base.items()}
    for a in new.values():
        a.reshape(-1)[:: 97] += 1
    torch = pytest.importorskip("torch")

    def bf16(d):
        return {n: torch.from_numpy(a).view(torch.bfloat16) for n, a in d.items()}

    members = wsync.layout.layout_of(wsync.snapshot.as_state(bf16(base)))
    p = wsync.encode(bf16(base), bf16(new), tier="packed", members=members)
    engine_state = {n: FakeTensor(a.copy(), 1, logical="BF16") for n, a in base.items()}
    dev = DeviceEngine(engine_state, backends.device_kernels(), backends.transfers())
    before = {n: t.data.tobytes() for n, t in engine_state.items()}

    # a corrupt last segment: everything before it was written, and is put back
    body = bytearray(p.body)
    body[-3] ^= 0xFF
    bad = Payload(p.manifest, memoryview(bytes(body)))
    with pytest.raises(ChecksumError):
        dev.apply([bad], p.manifest.checksum, [members])
    assert {n: t.data.tobytes() for n, t in engine_state.items()} == before

    # a wrong base: refused before anything is written
    engine_state["norm"].data[0] ^= 1
    with pytest.raises(VersionError):
        dev.apply([p], p.manifest.checksum, [members])
    engine_state["norm"].data[0] ^= 1

    # a digest that disagrees after every segment passed: all put back
    with pytest.raises(ChecksumError, match="digest"):
        dev.apply([p], "0" * 16, [members])
    assert {n: t.data.tobytes() for n, t in engine_state.items()} == before

    dev.apply([p], p.manifest.checksum, [members])
    assert all(engine_state[n].data.tobytes() == new[n].tobytes() for n in new)

    # a raw version (a keyframe) refused at its digest: every segment, rewritten whole, is put back
    now = {n: t.data.tobytes() for n, t in engine_state.items()}
    raw = wsync.encode(None, bf16(base), codec="raw", members=members)
    with pytest.raises(ChecksumError, match="digest"):
        dev.apply([raw], "0" * 16, [members])
    assert {n: t.data.tobytes() for n, t in engine_state.items()} == now
    dev.apply([raw], raw.manifest.checksum, [members])
    assert all(engine_state[n].data.tobytes() == base[n].tobytes() for n in base)

    # the same raw version with its body in device memory (as local:// hands it over): checked whole before
    # any write, so a corrupt frame or a wrong digest leaves every byte as it was
    def on_device(body: bytes) -> Payload:
        return Payload(raw.manifest, FakeTensor(np.frombuffer(body, np.uint8).copy(), 1, logical="U8"))

    now = {n: t.data.tobytes() for n, t in engine_state.items()}
    good = on_device(bytes(raw.body))
    assert good.on_device
    corrupt = bytearray(raw.body)
    corrupt[len(corrupt) // 2] ^= 0x10
    with pytest.raises(ChecksumError, match="stored bytes"):
        dev.apply([on_device(bytes(corrupt))], raw.manifest.checksum, [members])
    with pytest.raises(ChecksumError, match="digest"):
        dev.apply([good], "0" * 16, [members])
    assert {n: t.data.tobytes() for n, t in engine_state.items()} == now
    dev.apply([p], p.manifest.checksum, [members])  # a delta on top of the raw version's base
    dev.apply([good], raw.manifest.checksum, [members])
    assert all(engine_state[n].data.tobytes() == base[n].tobytes() for n in base)


@pytest.fixture
def ipc(monkeypatch):
    """Stand-ins for CUDA IPC (the runtime's tensors cannot be shared between processes): share() files the
    writer's tensor, open_shared() gives the reader a new handle on the same memory, as an opened IPC handle
    is, and watch() says when the reader has dropped every handle."""
    import weakref

    from wsync.transports import local_cuda

    shared = {}

    def share(t):
        shared[str(len(shared))] = t
        return {"standin": str(len(shared) - 1)}

    def open_shared(d):
        t = shared[d["standin"]]
        return FakeTensor(t.data, t.device.index, logical=t.logical)

    class Watch:
        def __init__(self, t):
            self.ref = weakref.ref(t)

        def expired(self) -> bool:
            return self.ref() is None

    monkeypatch.setattr(local_cuda, "share", share)
    monkeypatch.setattr(local_cuda, "open_shared", open_shared)
    monkeypatch.setattr(local_cuda, "watch", Watch)
    return shared


@pytest.mark.parametrize("codec", ["raw", "delta"])
def test_over_local_a_version_stays_on_the_device(device_rt, ipc, codec):
    """local:// hands the engine the trainer's device buffers (CUDA IPC): after the first keyframe, nothing
    of a version crosses to the host but the checks' few words (digests, chunk tables, error flags)."""
    rng = np.random.default_rng(4)
    trainer = bf16_state(rng, device=0)
    engine = DeviceModel(bf16_state(np.random.default_rng(8), device=0))
    model_bytes = sum(t.nbytes for t in trainer.values())
    crossed, commits = [], []
    with wsync.Publisher(f"local://wsync-dev-{secrets.token_hex(4)}", codec=codec, tier="sparse", keyframe_every=0,
                         bucket_bytes=24 << 10) as pub, \
            wsync.Subscriber(pub.address, engine=engine,
                             on_commit=lambda i: commits.append(i["keyframe"])) as sub:
        for v in range(5):
            if v:
                rl_step(trainer, rng)
            before = dict(device_rt.crossed)
            pub.publish(dict(trainer), version=v)
            assert sub.wait_for(v, timeout=60) == v
            pub.flush(timeout=30)
            crossed.append({d: device_rt.crossed[d] - before[d] for d in before})
            assert same(trainer, engine.state), f"version {v}"
    assert ipc, "no device buffer was shared"
    assert commits == [True] + [codec == "raw"] * 4
    for v in range(1, 5):
        assert crossed[v]["d2h"] < model_bytes / 100, (v, crossed[v])
        assert crossed[v]["h2d"] < model_bytes / 100, (v, crossed[v])


@pytest.mark.gpu
def test_on_a_gpu_the_device_path_runs_and_follows_bit_exact():
    """The same path on a real GPU (cupy's runtime, torch's streams): a trainer's and an engine's CUDA tensors
    over tcp, every version compared byte for byte, the engine on the device path."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    try:
        backends.device_kernels()
    except wsync.errors.BackendUnavailable as e:
        pytest.skip(str(e))
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = {f"layers.{i}.w": (256, 128 + 64 * i) for i in range(6)} | {"embed": (70_001,)}
    trainer = {n: (torch.randn(s, device="cuda", generator=g) * 0.02).to(torch.bfloat16) for n, s in shapes.items()}
    engine = DeviceModel({n: torch.zeros_like(t) for n, t in trainer.items()})
    with wsync.Publisher(ADDR, token=TOKEN, keyframe_every=0, bucket_bytes=64 << 10) as pub, \
            wsync.Subscriber(pub.address, engine=engine, token=TOKEN) as sub:
        for v in range(4):
            if v:
                for t in trainer.values():
                    bits = t.view(torch.int16)
                    mask = torch.rand(bits.shape, device="cuda", generator=g) < 0.01
                    bits[mask] += 1
            pub.publish(dict(trainer), version=v)
            assert sub.wait_for(v, timeout=60) == v
            torch.cuda.synchronize()
            assert all(torch.equal(trainer[n].view(torch.int16), engine.state[n].view(torch.int16)) for n in trainer)
        assert isinstance(sub._bound, DeviceEngine)


@pytest.mark.parametrize("tier", ["sparse", "packed"])
def test_device_payloads_are_byte_for_byte_the_host_ones(device_rt, tier):
    """The format does not know where a version was encoded: the same two versions give the same payload
    bytes from device buffers (the GPU kernels' sections and digests) as from host arrays (the C++ ones)."""
    torch = pytest.importorskip("torch")
    from wsync import api
    from wsync.device import DeviceSource

    rng = np.random.default_rng(11)
    old = bf16_state(rng, device=0)
    new = {n: FakeTensor(t.data.copy(), 0, logical="BF16") for n, t in old.items()}
    rl_step(new, rng, density=0.02)
    src_old, src_new = (DeviceSource(s, backends.device_kernels(), 24 << 10) for s in (old, new))
    dev_old, dev_new = src_old.snapshot(), src_new.snapshot()

    def host(state):
        return {n: torch.from_numpy(t.data.copy()).view(torch.bfloat16) for n, t in state.items()}

    h_old, h_new = host(old), host(new)
    for m in dev_new.buckets:
        dev_delta = api.encode(dev_old, dev_new, tier=tier, members=m, backend="device", version=1, base_version=0)
        host_delta = api.encode(h_old, h_new, tier=tier, members=m, version=1, base_version=0)
        assert dev_delta.to_bytes() == host_delta.to_bytes()
        dev_raw = api.encode(None, dev_new, codec="raw", members=m, backend="device")
        assert dev_raw.to_bytes() == api.encode(None, h_new, codec="raw", members=m).to_bytes()
        if tier == "sparse":  # a body kept on the device (for local:// and nccl://): the same bytes, there
            kept = api.encode(dev_old, dev_new, tier=tier, members=m, backend="device-body", version=1,
                              base_version=0)
            assert kept.on_device and kept.header() + kept.body.data.tobytes() == host_delta.to_bytes()
