"""engines.HF: a real transformers model follows a publisher bit for bit while it generates."""
from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine_helpers import fuse, publisher, rl_step, same_bytes, subscriber, tiny_qwen  # noqa: E402
from wsync import engines  # noqa: E402
from wsync.errors import MismatchError  # noqa: E402
from wsync.snapshot import TensorBits  # noqa: E402
from wsync.subscriber import apply_version  # noqa: E402


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(11)


def probe(model):
    ids = torch.arange(12).reshape(2, 6) % 256
    with torch.no_grad():
        return model(ids).logits


def test_fused_engine_follows_trainer_exactly(gen):
    trainer, eng_model = tiny_qwen(0), tiny_qwen(1)
    fuse(eng_model)  # qkv_proj / gate_up_proj hold the weights, as in vLLM and SGLang
    assert not any(".q_proj." in n for n in eng_model.state_dict())
    engine = engines.HF(eng_model, fused=engines.qkv_gate_up(q=32, kv=16))
    assert set(engine.tensors()) == set(engines.HF(trainer).tensors())
    ptrs = {n: p.data_ptr() for n, p in eng_model.named_parameters()}
    with publisher(keyframe_every=3, bucket_bytes=16 << 10) as pub, \
            subscriber(pub, engine) as sub:
        for v in range(6):
            rl_step(trainer, gen)
            pub.publish(trainer.state_dict(), version=v)
            sub.wait_for(v, timeout=30)
            assert engine.digest() == engines.HF(trainer).digest()
            # the fused weight really is the three trainer tensors, row by row
            attn = trainer.model.layers[1].self_attn
            want = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
            assert same_bytes({"w": eng_model.model.layers[1].self_attn.qkv_proj.weight.data}, {"w": want})
        assert sub.stats.failures == 0 and not sub.stats.last.keyframe
    assert ptrs == {n: p.data_ptr() for n, p in eng_model.named_parameters()}
    assert torch.equal(probe(trainer), probe(eng_model))  # same bytes, same logits


def test_fused_sizes_must_add_up():
    model = tiny_qwen(0)
    fuse(model)
    with pytest.raises(MismatchError, match="add up"):
        engines.HF(model, fused=engines.qkv_gate_up(q=32, kv=8)).tensors()
    bad = [engines.Fused(fused="gate_up_proj", parts=("gate_proj", "up_proj", "x_proj"))]
    with pytest.raises(MismatchError, match="equal parts"):
        engines.HF(model, fused=bad).tensors()


def test_tied_weights_travel_once_and_stay_tied(gen):
    trainer, eng_model = tiny_qwen(0), tiny_qwen(2)
    engine = engines.HF(eng_model)
    names = list(engine.tensors())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    with publisher() as pub, subscriber(pub, engine) as sub:
        rl_step(trainer, gen)
        pub.publish(trainer.state_dict(), version=1)
        sub.wait_for(1, timeout=30)
    assert eng_model.lm_head.weight.data_ptr() == eng_model.model.embed_tokens.weight.data_ptr()
    assert same_bytes(trainer.state_dict(), eng_model.state_dict()) and engine.version == 1


def test_rename_and_names_map_trainer_names(gen):
    trainer = torch.nn.ModuleDict({"policy": tiny_qwen(0)})  # the trainer's names carry a "policy." prefix
    rl_step(trainer, gen)
    eng_model = tiny_qwen(3)
    by_fn = engines.HF(eng_model, rename=lambda n: "policy." + n)
    by_dict = engines.HF(eng_model, names={"policy." + n: n for n in engines.HF(eng_model).tensors()})
    assert set(by_fn.tensors()) == set(by_dict.tensors()) == set(engines.HF(trainer).tensors())
    with publisher() as pub, subscriber(pub, by_dict) as sub:
        pub.publish(trainer.state_dict(), version=0)
        sub.wait_for(0, timeout=30)
    assert by_fn.digest() == engines.HF(trainer).digest()
    with pytest.raises(MismatchError, match="maps both"):
        engines.HF(eng_model, names={"a": "x", "b": "x"})


def test_load_checks_names_shapes_and_dtypes():
    engine = engines.HF(tiny_qwen(0))
    with pytest.raises(MismatchError, match="no tensors named"):
        engine.load({"nope": torch.zeros(2)})
    with pytest.raises(MismatchError, match="holds"):
        engine.load({"model.norm.weight": torch.zeros(3, dtype=torch.bfloat16)})
    with pytest.raises(MismatchError, match="holds"):
        engine.load({"model.norm.weight": torch.zeros(32, dtype=torch.float32)})


def test_guarded_background_updates_never_show_half_a_version(gen):
    """A generating thread holds engine.lock per forward; every forward sees exactly one published version."""
    trainer, eng_model = tiny_qwen(0), tiny_qwen(0)
    engine = engines.HF(eng_model, guarded=True)
    want, seen, stop = [probe(trainer)], [], threading.Event()

    def generate():
        while not stop.is_set():
            with engine.lock:
                seen.append(probe(eng_model))

    t = threading.Thread(target=generate)
    t.start()
    try:
        with publisher(bucket_bytes=8 << 10) as pub, subscriber(pub, engine) as sub:
            for v in range(5):
                rl_step(trainer, gen, density=0.2)
                want.append(probe(trainer))
                pub.publish(trainer.state_dict(), version=v)
                sub.wait_for(v, timeout=30)
    finally:
        stop.set()
        t.join()
    assert same_bytes(trainer.state_dict(), eng_model.state_dict())
    assert len(seen) > 5
    assert all(any(torch.equal(s, w) for w in want) for s in seen)  # no forward saw a mix of two versions


def test_poll_between_decode_steps(gen):
    """Greedy decoding in one thread; sub.poll() between steps moves the live model from version to version."""
    trainer, eng_model = tiny_qwen(0), tiny_qwen(5)
    engine = engines.HF(eng_model)
    ptrs = {n: p.data_ptr() for n, p in eng_model.named_parameters()}
    applied = []
    with publisher() as pub, subscriber(pub, engine, apply="poll") as sub:
        pub.wait_for_subscribers(1, timeout=30)
        ids = torch.zeros(1, 1, dtype=torch.long)
        for step in range(24):
            if step % 6 == 0:
                rl_step(trainer, gen)
                pub.publish(trainer.state_dict(), version=step)
                pub.flush(timeout=30)  # received (acked on receipt in poll mode), not yet applied
            if (v := sub.poll()) is not None:
                applied.append(v)
                assert engine.digest() == engines.HF(trainer).digest()
            with torch.no_grad():
                nxt = eng_model(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)[:, -16:]
    assert applied == [0, 6, 12, 18] and engine.version == 18
    assert ptrs == {n: p.data_ptr() for n, p in eng_model.named_parameters()}


def test_transaction_on_fused_engine_rolls_back(gen):
    from wsync import encode

    trainer, eng_model = tiny_qwen(0), tiny_qwen(0)
    fuse(eng_model)
    engine = engines.HF(eng_model, fused=engines.qkv_gate_up(q=32, kv=16))
    before = {k: v.clone() for k, v in eng_model.state_dict().items()}
    rl_step(trainer, gen)
    p = encode(engine.tensors(), engines.HF(trainer).tensors(), codec="delta")
    with pytest.raises(Exception, match="digest"):
        apply_version(engine, [p], "0" * 16)
    assert same_bytes(before, eng_model.state_dict())
    apply_version(engine, [p], p.manifest.checksum)
    assert engine.digest() == engines.HF(trainer).digest()


def test_a_guarded_engine_hands_device_tensors_over_as_they_are(monkeypatch):
    """guarded=True turns host tensors into read-only views, so host updates go through load(); device
    tensors are applied on the GPU under the engine's lock, so they are handed over live. (Stand-in: the
    model's CPU parameters are declared device tensors.)"""
    from wsync.engines import hf

    model = tiny_qwen(0)
    engine = engines.HF(model, guarded=True)
    assert all(isinstance(t, TensorBits) and not t.bits.flags.writeable for t in engine.tensors().values())
    monkeypatch.setattr(hf, "is_device", lambda t: True)
    live = engine.tensors()
    assert all(isinstance(t, torch.Tensor) for t in live.values())
    assert {n: t.data_ptr() for n, t in live.items()} == {n: t.data_ptr() for n, t in engine.live().items()}
