"""Tensors the sync cannot view in place, on either side: every version exact, deltas kept as deltas.

A strided CPU parameter (a transposed copy) takes the same path as a device
tensor wherever the sync cannot write or read memory through a host view: it
is copied, and the copy must be read again for every version (trainer) and
kept equal to what the engine holds (engine). It is the stand-in for a CUDA
tensor here; tests/test_device_sync.py runs actual device code on the CPU harness.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import wsync  # noqa: E402
from wsync import engines  # noqa: E402
from wsync.layout import bind_copying  # noqa: E402

from engine_helpers import publisher, rl_step, same_bytes, subscriber, tiny_qwen  # noqa: E402


def strided(model, every: int = 2):
    """Give every `every`-th 2-D parameter transposed strides (same values, not host-contiguous)."""
    with torch.no_grad():
        for i, p in enumerate(p for p in model.parameters() if p.dim() == 2):
            if i % every == 0:
                p.data = p.data.t().contiguous().t()
    assert any(not p.is_contiguous() for p in model.parameters())
    return model


def commits(log):
    return lambda info: log.append("keyframe" if info["keyframe"] else "delta")


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(3)


def test_a_bound_state_with_copied_tensors_is_read_afresh_at_every_publish(gen):
    trainer, engine_model = strided(tiny_qwen(0)), tiny_qwen(1)
    state = wsync.bind(trainer.state_dict())  # once, as the README says for large states
    assert state.sources and not state.writes_through
    log = []
    with publisher(keyframe_every=0, bucket_bytes=16 << 10) as pub, \
            subscriber(pub, engines.HF(engine_model), on_commit=commits(log)) as sub:
        for v in range(6):
            rl_step(trainer, gen)  # in place: the bound tensors are the ones that move
            pub.publish(state, version=v)
            assert sub.wait_for(v, timeout=30) == v
            assert same_bytes(trainer.state_dict(), engine_model.state_dict()), f"version {v} is stale"
    assert log == ["keyframe"] + ["delta"] * 5


def test_an_engine_with_copied_tensors_takes_deltas(gen):
    trainer, engine_model = tiny_qwen(0), strided(tiny_qwen(1))
    ptrs = {n: p.data_ptr() for n, p in engine_model.named_parameters()}
    log = []
    with publisher(keyframe_every=0, bucket_bytes=16 << 10) as pub, \
            subscriber(pub, engines.HF(engine_model), on_commit=commits(log)) as sub:
        for v in range(7):
            rl_step(trainer, gen)
            pub.publish(trainer.state_dict(), version=v)
            assert sub.wait_for(v, timeout=30) == v
            assert same_bytes(trainer.state_dict(), engine_model.state_dict()), f"version {v}"
        assert sub.stats.failures == 0
    assert log == ["keyframe"] + ["delta"] * 6  # one keyframe, then six deltas
    assert ptrs == {n: p.data_ptr() for n, p in engine_model.named_parameters()}  # loaded in place


def test_copied_tensors_on_both_sides_keep_deltas_in_the_history(gen):
    """The default path, publish(model.state_dict()) every version, with copied tensors on both ends: the
    history keeps the first keyframe and the deltas after it, so a subscriber that joins late gets that
    keyframe and then the deltas (were every version a keyframe, it would get only the newest)."""
    trainer, first, late = strided(tiny_qwen(0)), strided(tiny_qwen(1)), strided(tiny_qwen(2))
    log_first, log_late = [], []
    with publisher(keyframe_every=0, bucket_bytes=16 << 10) as pub, \
            subscriber(pub, engines.HF(first), on_commit=commits(log_first)) as sub:
        for v in range(5):
            rl_step(trainer, gen)
            pub.publish(trainer.state_dict(), version=v)
            sub.wait_for(v, timeout=30)
            assert same_bytes(trainer.state_dict(), first.state_dict()), f"version {v}"
        with subscriber(pub, engines.HF(late), on_commit=commits(log_late)) as sub2:
            sub2.wait_for(4, timeout=30)
            assert same_bytes(trainer.state_dict(), late.state_dict())
    assert log_first == ["keyframe"] + ["delta"] * 4
    assert log_late == ["keyframe"] + ["delta"] * 4


def test_bind_copying_views_what_it_can_and_copies_the_rest():
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # strided
    ro = wsync.snapshot.to_bits(torch.arange(4, dtype=torch.float32))
    ro.bits.flags.writeable = False  # a guarded engine's read-only view
    b = bind_copying({"a": a, "t": t, "ro": ro})
    assert set(b.sources) == {"t", "ro"} and not b.writes_through
    assert b["t"].bits.tobytes() == t.contiguous().numpy().tobytes()
    b["ro"].bits[:] = 0  # our own copy: writable, and the engine's memory is untouched
    assert ro.bits.tolist() == [0, 0x3F800000, 0x40000000, 0x40400000]
    t.mul_(2)
    b.refresh()
    assert b["t"].bits.tobytes() == t.contiguous().numpy().tobytes()


def test_an_engine_with_copied_tensors_loads_only_the_tensors_that_changed(gen):
    """Segments span many tensors; the engine is handed only the tensors a version wrote."""
    trainer, engine_model = tiny_qwen(0), strided(tiny_qwen(1), every=1)
    engine = engines.HF(engine_model)
    loads = []
    real_load = engine.load
    engine.load = lambda named: (loads.append(sorted(named)), real_load(named))
    strided_names = {n for n, p in engine_model.named_parameters() if not p.is_contiguous()}
    with publisher(keyframe_every=0, bucket_bytes=1 << 20) as pub, subscriber(pub, engine) as sub:
        pub.publish(trainer.state_dict(), version=0)
        sub.wait_for(0, timeout=30)
        loads.clear()
        target = sorted(strided_names)[1]
        with torch.no_grad():
            trainer.get_parameter(target).view(torch.int16).view(-1)[3] += 1
        pub.publish(trainer.state_dict(), version=1)
        sub.wait_for(1, timeout=30)
        assert same_bytes(trainer.state_dict(), engine_model.state_dict())
    assert loads == [[target]]


def test_a_state_dict_of_new_tensors_is_bound_again(gen):
    """publish(state_dict()) reuses the layout it built only while the tensors are the same memory; after
    load_state_dict(assign=True) (new tensors) it binds again and stays exact."""
    trainer, engine_model = tiny_qwen(0, tie=False), tiny_qwen(1, tie=False)
    with publisher(keyframe_every=0, bucket_bytes=16 << 10) as pub, subscriber(pub, engines.HF(engine_model)) as sub:
        pub.publish(trainer.state_dict(), version=0)
        sub.wait_for(0, timeout=30)
        rl_step(trainer, gen)
        fresh = {k: v.clone() for k, v in trainer.state_dict().items()}
        trainer.load_state_dict(fresh, assign=True)
        rl_step(trainer, gen)
        pub.publish(trainer.state_dict(), version=1)
        sub.wait_for(1, timeout=30)
        assert same_bytes(trainer.state_dict(), engine_model.state_dict())
