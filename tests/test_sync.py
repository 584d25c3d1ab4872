"""Publisher -> Subscriber over real sockets, with real transformers models, compared byte for byte."""
from __future__ import annotations

import gc
import time
import tracemalloc

import numpy as np
import pytest

from wsync import engines
from wsync.errors import ChecksumError, MismatchError, SnapshotError, VersionError
from wsync.snapshot import TensorBits, as_state
from wsync.subscriber import Subscriber, apply_version
from wsync import sync
from wsync.sync import Publisher

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from engine_helpers import rl_step  # noqa: E402  (an RL step's effect on bf16 weights)
from helpers import TOKEN, free_port  # noqa: E402

ADDR = "tcp://127.0.0.1:0"


def tiny_qwen(seed: int, tie: bool = True, vocab: int = 256):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                   tie_word_embeddings=tie, max_position_embeddings=64)
    return transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()


def same_bytes(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(
        sa[k].contiguous().view(torch.uint8).numpy().tobytes() == sb[k].contiguous().view(torch.uint8).numpy().tobytes()
        for k in sa)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(7)


def publish_steps(pub, trainer, gen, versions, subs=(), timeout=60):
    """An RL step then a publish for each of versions; then every subscriber serves the last one."""
    for v in versions:
        rl_step(trainer, gen)
        pub.publish(trainer.state_dict(), version=v)
    for s in subs:
        s.wait_for(versions[-1], timeout=timeout)


def test_hf_model_follows_bit_exact(gen):
    trainer, engine_model = tiny_qwen(0), tiny_qwen(1)
    assert not same_bytes(trainer, engine_model)
    with Publisher(ADDR, token=TOKEN, keyframe_every=4, bucket_bytes=8 << 10) as pub, \
            Subscriber(pub.address, engine=engines.HF(engine_model), token=TOKEN) as sub:
        ptrs = {n: p.data_ptr() for n, p in engine_model.named_parameters()}
        for v in range(10):
            rl_step(trainer, gen)
            pub.publish(trainer.state_dict(), version=v)
            assert sub.wait_for(v, timeout=30) == v
            assert same_bytes(trainer, engine_model)
        # written in place: the live parameters were never reallocated, tied weights still tied
        assert ptrs == {n: p.data_ptr() for n, p in engine_model.named_parameters()}
        assert engine_model.lm_head.weight.data_ptr() == engine_model.model.embed_tokens.weight.data_ptr()
        assert sub.version == 9
        assert sub.stats.versions == 10 and not sub.stats.last.keyframe


def test_eight_subscribers_fifty_deltas(gen):
    trainer = tiny_qwen(0)
    models = [tiny_qwen(10 + i) for i in range(4)]
    with Publisher(ADDR, token=TOKEN, keyframe_every=20, bucket_bytes=32 << 10) as pub:
        subs = [Subscriber(pub.address, engine=engines.HF(m), token=TOKEN) for m in models]
        subs += [Subscriber(pub.address, engine=engines.Shadow(), token=TOKEN, apply="poll") for _ in range(4)]
        try:
            pub.wait_for_subscribers(8, timeout=30)
            publish_steps(pub, trainer, gen, range(51), subs)
            pub.flush(timeout=30)
        finally:
            for s in subs:
                s.close()
    want = engines.HF(trainer).digest()
    for s in subs:
        assert s.version == 50 and s.stats.failures == 0
        assert s.stats.versions == 51, (s.mode, s.stats)  # one keyframe, then every delta applied in turn
        assert s.engine.digest() == want
    assert all(same_bytes(trainer, m) for m in models)
    raw = sum(t.numel() * 2 for t in engines.HF(trainer).tensors().values())
    deltas = [b for v, b in pub.stats.bytes.items() if b is not None]
    assert len(deltas) == 50 and max(deltas) < raw / 5


@pytest.mark.parametrize("scheme", ["local", "gloo", "ucx"])
def test_two_engines_follow_over_each_transport(scheme, gen):
    """The same protocol over same-host shared memory, a gloo broadcast group (lockstep) and UCX."""
    if scheme == "ucx":
        pytest.importorskip("ucxx")
    addr = {"local": f"local://wsync-test-{free_port()}", "gloo": f"gloo://127.0.0.1:{free_port()}?world_size=3",
            "ucx": f"ucx://127.0.0.1:{free_port()}"}[scheme]
    trainer, models = tiny_qwen(0), [tiny_qwen(5), tiny_qwen(6)]
    with Publisher(addr, keyframe_every=3) as pub:
        subs = [Subscriber(pub.address, engine=engines.HF(m)) for m in models]
        try:
            pub.wait_for_subscribers(2, timeout=60)
            publish_steps(pub, trainer, gen, range(6), subs)
        finally:
            for s in subs:
                s.close()
    assert all(same_bytes(trainer, m) for m in models)
    for s in subs:
        assert s.version == 5 and s.stats.failures == 0, s.stats
        # every version from keyframe 0; or, where its sender first looked after version 3 was published
        # (on a loaded machine publish() can outrun a sender), from keyframe 3
        assert s.stats.versions in (6, 3), s.stats


@pytest.mark.soak
def test_gloo_groups_opened_and_closed_in_a_loop():
    """A gloo publisher and two subscribers, built, fed and closed over and over in one process: closes land
    wherever the links' threads happen to be, and a group dropped with an operation in flight would block its
    last holder in its destructor (tests/conftest.py's hang guard turns such a freeze into a failure with every
    thread's stack)."""
    rng = np.random.default_rng(0)
    state = {f"w{i}": rng.standard_normal(256).astype(np.float32) for i in range(8)}
    for _ in range(25):
        with Publisher("gloo://127.0.0.1:0?world_size=3", keyframe_every=3) as pub:
            subs = [Subscriber(pub.address, engine=engines.Shadow()) for _ in range(2)]
            try:
                pub.wait_for_subscribers(2, timeout=60)
                for v in range(3):
                    state = {k: a + np.float32(0.01) for k, a in state.items()}
                    pub.publish(state, version=v)
                for s in subs:
                    assert s.wait_for(2, timeout=60) == 2
            finally:
                for s in subs:
                    s.close()
        assert all(s.stats.failures == 0 for s in subs)


def test_relay_tree_forwards_bit_exact(gen):
    """publisher -> relay (e.g. one per remote site) -> two subscribers behind it."""
    trainer = tiny_qwen(0)
    leaves = [tiny_qwen(20), tiny_qwen(21)]
    with Publisher(ADDR, token=TOKEN, keyframe_every=3) as pub, \
            Subscriber(pub.address, engine=engines.Shadow(), token=TOKEN, relay=ADDR) as relay:
        subs = [Subscriber(relay.relay.address, engine=engines.HF(m), token=TOKEN) for m in leaves]
        try:
            publish_steps(pub, trainer, gen, range(6), subs, timeout=30)
        finally:
            for s in subs:
                s.close()
    assert all(same_bytes(trainer, m) for m in leaves)
    assert relay.version == 5 and all(s.version == 5 for s in subs)


def test_versions_must_increase():
    with Publisher(ADDR, token=TOKEN) as pub:
        state = {"w": np.zeros(8, np.float32)}
        pub.publish(state, version=3)
        with pytest.raises(VersionError, match="increase"):
            pub.publish(state, version=3)
        with pytest.raises(ValueError):
            pub.publish(state, version=-1)


@pytest.mark.parametrize("live", [False, True], ids=["copied", "measured-live"])
def test_publish_that_fails_mid_read_leaves_no_version(gen, monkeypatch, live):
    """publish() reads the state bucket by bucket while the encoder streams (copying it, or measuring it against
    the mirror): a read that dies half way raises to the trainer, the half-sent version never commits anywhere,
    and the same number can be published again."""
    from wsync import mirror, snapshot

    trainer, engine_model = tiny_qwen(0), tiny_qwen(1)
    with Publisher(ADDR, token=TOKEN, keyframe_every=0, bucket_bytes=8 << 10, live=live) as pub, \
            Subscriber(pub.address, engine=engines.HF(engine_model), token=TOKEN) as sub:
        pub.publish(trainer.state_dict(), version=0)
        assert sub.wait_for(0, timeout=30) == 0
        pub.flush(timeout=30)  # the mirror is made behind publish(): wait for it, or version 1 would be copied
        held = engines.HF(engine_model).digest()
        rl_step(trainer, gen)
        if live:
            real, calls = mirror.LiveDelta._step, []

            def dies_half_way(self, name, m, new):
                calls.append(1)
                if len(calls) > 6:
                    raise OSError("the trainer's memory went away")
                return real(self, name, m, new)
            monkeypatch.setattr(mirror.LiveDelta, "_step", dies_half_way)
            with pytest.raises(SnapshotError, match="went away"):
                pub.publish(trainer.state_dict(), version=1)
            monkeypatch.setattr(mirror.LiveDelta, "_step", real)
        else:
            real_run = snapshot.Copying.run

            def dies_after_two_buckets(self, groups):
                real_run(self, groups[:2])  # the first buckets reach the encoder (and the wire), then it fails
            monkeypatch.setattr(snapshot.Copying, "run", dies_after_two_buckets)
            with pytest.raises(ValueError, match="in no group"):
                pub.publish(trainer.state_dict(), version=1)
            monkeypatch.setattr(snapshot.Copying, "run", real_run)
        assert sub.version == 0 and engines.HF(engine_model).digest() == held
        pub.publish(trainer.state_dict(), version=1)  # the failed one never counted
        assert sub.wait_for(1, timeout=30) == 1
        assert same_bytes(trainer, engine_model) and held != engines.HF(engine_model).digest()
        assert sub.stats.failures == 0
        # a half-written mirror is not trusted: that version goes out whole
        assert sub.stats.last.keyframe == live
        pub.flush(timeout=30)
        rl_step(trainer, gen)
        pub.publish(trainer.state_dict(), version=2)  # and deltas go on against version 1
        assert sub.wait_for(2, timeout=30) == 2 and same_bytes(trainer, engine_model)
        assert not sub.stats.last.keyframe


def test_copying_that_misses_a_tensor_fails_its_readers():
    from wsync import snapshot

    state = snapshot.Copying({"a": np.arange(4), "b": np.arange(3)})
    with pytest.raises(ValueError, match="in no group"):
        state.run([["a"]])
    state.wait(["a"])
    with pytest.raises(SnapshotError):
        state.wait(["b"])


def test_late_and_returning_subscribers_catch_up(gen):
    trainer = tiny_qwen(0)
    with Publisher(ADDR, token=TOKEN, keyframe_every=5, bucket_bytes=16 << 10) as pub:
        for v in range(8):
            pub.publish(trainer.state_dict(), version=v)
            rl_step(trainer, gen)
        late_model = tiny_qwen(3)
        with Subscriber(pub.address, engine=engines.HF(late_model), token=TOKEN) as late:
            late.wait_for(7, timeout=30)
            assert late.stats.versions == 3  # keyframe 5, then deltas 6 and 7
        for v in range(8, 10):
            pub.publish(trainer.state_dict(), version=v)
            rl_step(trainer, gen)
        engine = engines.HF(late_model)
        engine.version = 7
        with Subscriber(pub.address, engine=engine, token=TOKEN) as back:
            back.wait_for(9, timeout=30)
            assert back.stats.versions == 2 and not back.stats.last.keyframe  # deltas 8 and 9 only
        pub.publish(trainer.state_dict(), version=10)  # a keyframe; the deltas before it are dropped
        rl_step(trainer, gen)
        pub.publish(trainer.state_dict(), version=11)
        with Subscriber(pub.address, engine=engines.HF(late_model), token=TOKEN) as again:
            again.wait_for(11, timeout=30)
        assert same_bytes(trainer, late_model)


def test_copied_delta_becomes_the_mirror_with_the_checksums_its_encoding_gave(gen, monkeypatch):
    """A delta publish() had to copy (the mirror was not ready) becomes the mirror without being hashed again:
    its checksums come from its encoding, and the next delta, measured against them, applies bit-exact."""
    from wsync import mirror, sync

    real_live, real_adopt, adopted = sync.Publisher._publish_live, mirror.Mirror.adopt, []
    monkeypatch.setattr(sync.Publisher, "_publish_live", lambda self, v, state: v >= 2 and real_live(self, v, state))

    def adopt(self, version, state, *, copy, sums=None):
        adopted.append((version, copy, sums is not None))
        return real_adopt(self, version, state, copy=copy, sums=sums)
    monkeypatch.setattr(mirror.Mirror, "adopt", adopt)
    trainer, model = tiny_qwen(0), tiny_qwen(1)
    with Publisher(ADDR, token=TOKEN, keyframe_every=0) as pub, \
            Subscriber(pub.address, engine=engines.HF(model), token=TOKEN) as sub:
        # 0: a keyframe, 1: copied (publish_live said no). One at a time: a version becomes the mirror only if
        # it is still the newest when its encoding ends, and on a loaded machine 1 could be published by then
        for v in range(2):
            publish_steps(pub, trainer, gen, [v], [sub])
            pub.flush(timeout=30)
        assert adopted == [(0, True, False), (1, False, True)]  # the keyframe is copied and hashed in one pass
        publish_steps(pub, trainer, gen, [2], [sub])  # measured against the mirror, with version 1's sums as base
        assert pub._mirror.version == 2 and sub.stats.failures == 0 and not sub.stats.last.keyframe
        assert same_bytes(trainer, model)
        k = pub._mirror.kernels
        from wsync.layout import segments

        want = {key: k.checksum(seg.bits) for m in pub._buckets(pub._mirror.state)
                for key, seg in zip(m.keys(), segments(pub._mirror.state, m))}
        assert pub._mirror.sums == want  # each segment's checksum, as the encoding gave it


@pytest.mark.parametrize("live", [False, True], ids=["copied", "measured-live"])
def test_drifted_engine_refuses_delta_then_recovers_by_keyframe(gen, live):
    """live: version 1 is measured against the mirror, so its on-demand keyframe is a frozen copy of the mirror."""
    trainer, model = tiny_qwen(0), tiny_qwen(1)
    with Publisher(ADDR, token=TOKEN, keyframe_every=100, live=live) as pub, \
            Subscriber(pub.address, engine=engines.HF(model), token=TOKEN) as sub:
        pub.publish(trainer.state_dict(), version=0)
        sub.wait_for(0, timeout=30)
        pub.flush(timeout=30)
        with torch.no_grad():
            model.model.norm.weight.view(torch.int16)[0] += 1  # someone wrote into the engine
        drifted = {k: v.clone() for k, v in model.state_dict().items()}
        rl_step(trainer, gen)
        pub.publish(trainer.state_dict(), version=1)
        sub.wait_for(1, timeout=30)  # the delta is refused, a keyframe of version 1 follows
        assert isinstance(sub.error, VersionError) and sub.stats.failures == 1
        assert sub.stats.last.keyframe and same_bytes(trainer, model)
        assert not all(torch.equal(drifted[k], v) for k, v in model.state_dict().items())
        assert (pub._mirror.version == 1) == live
        rl_step(trainer, gen)
        pub.publish(trainer.state_dict(), version=2)  # and deltas go on, against the mirror the keyframe froze
        sub.wait_for(2, timeout=30)
        assert not sub.stats.last.keyframe and same_bytes(trainer, model)


def test_poll_mode_applies_only_when_asked(gen):
    trainer, model = tiny_qwen(0), tiny_qwen(1)
    with Publisher(ADDR, token=TOKEN) as pub, \
            Subscriber(pub.address, engine=engines.HF(model), token=TOKEN, apply="poll") as sub:
        pub.wait_for_subscribers(1, timeout=30)
        pub.publish(trainer.state_dict(), version=0)
        pub.flush(timeout=30)  # received and acknowledged, not applied
        assert sub.version is None and not same_bytes(trainer, model)
        assert sub.poll() == 0 and same_bytes(trainer, model)
        assert sub.poll() is None


def test_memory_flat_across_200_versions(gen, monkeypatch):
    trainer = tiny_qwen(0, vocab=8192)  # ~0.6 MB of weights, so a leak of one copy per version would show
    # the stats keep a bounded window of per-version entries; a small window is full before the first mark,
    # so what grows between the marks is what no bound holds
    monkeypatch.setattr(sync, "KEPT_PER_VERSION", 50)
    with Publisher(ADDR, token=TOKEN, keyframe_every=20) as pub, \
            Subscriber(pub.address, engine=engines.Shadow(), token=TOKEN) as sub:
        tracemalloc.start()
        try:
            marks = {}
            for v in range(200):
                rl_step(trainer, gen, density=0.01)
                pub.publish(trainer.state_dict(), version=v)
                if v in (99, 199):
                    pub.flush(timeout=60)
                    gc.collect()
                    marks[v] = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        assert sub.version == 199 and len(pub._history.deltas) <= 40
        model_bytes = sum(t.nbytes for t in as_state(engines.HF(trainer).tensors()).values())
        assert marks[199] - marks[99] < model_bytes / 10, (marks, model_bytes)


# -- the transaction itself, without a network ----------------------------------------------


def _payloads(base, new, **kw):
    from wsync import encode

    return [encode(base, new, codec="delta", **kw)]


def test_corrupt_payload_leaves_engine_untouched(gen):
    a, b = tiny_qwen(0), tiny_qwen(0)
    rl_step(b, gen)
    engine = engines.HF(a)
    before = {k: v.clone() for k, v in a.state_dict().items()}
    p = _payloads(engine.tensors(), engines.HF(b).tensors())[0]
    body = bytearray(p.body)
    body[len(body) // 2] ^= 0x40
    from wsync.payload import Payload

    bad = Payload(p.manifest, memoryview(body))
    with pytest.raises(ChecksumError):
        apply_version(engine, [bad], p.manifest.checksum)
    assert all(torch.equal(before[k].view(torch.uint8), v.view(torch.uint8)) for k, v in a.state_dict().items())


def test_wrong_digest_rolls_back_every_tensor(gen):
    a, b = tiny_qwen(0), tiny_qwen(0)
    rl_step(b, gen)
    engine = engines.HF(a)
    before = {k: v.clone() for k, v in a.state_dict().items()}
    p = _payloads(engine.tensors(), engines.HF(b).tensors())[0]
    with pytest.raises(ChecksumError, match="digest"):
        apply_version(engine, [p], "0" * 16)
    assert all(torch.equal(before[k].view(torch.uint8), v.view(torch.uint8)) for k, v in a.state_dict().items())
    apply_version(engine, [p], p.manifest.checksum)
    assert same_bytes(a, b)


class _FailingLoad(engines.Shadow):
    """An engine that is not host memory (tensors() hands out copies), whose first load dies halfway."""

    calls = 0

    def tensors(self):
        out = {}
        for n, tb in self.state.items():
            bits = tb.bits.copy()
            bits.flags.writeable = False
            out[n] = TensorBits(tb.dtype, tb.shape, bits)
        return out

    def load(self, named):
        self.calls += 1
        if self.calls == 1:
            super().load(dict(list(named.items())[:1]))
            raise VersionError("engine worker went away mid-load")
        super().load(named)


def test_failed_load_restores_engine(rng):
    base = {"a": rng.standard_normal(64).astype(np.float32), "b": rng.standard_normal(32).astype(np.float32)}
    new = {k: v + 1 for k, v in base.items()}
    engine = _FailingLoad(base)
    p = _payloads(base, new)[0]
    with pytest.raises(VersionError, match="went away"):
        apply_version(engine, [p], p.manifest.checksum)
    assert engine.calls == 2  # the failed load, then the one that put the old values back
    assert all(engine.state[k].bits.tobytes() == base[k].tobytes() for k in base)
    apply_version(engine, [p], p.manifest.checksum)
    assert all(engine.state[k].bits.tobytes() == new[k].tobytes() for k in new)


def test_mismatched_tensor_set_is_refused(rng):
    base = {"a": rng.standard_normal(16).astype(np.float32)}
    p = _payloads(base, {"a": base["a"] + 1})[0]
    engine = engines.Shadow({"a": base["a"], "extra": np.zeros(3, np.float32)})
    with pytest.raises(MismatchError, match="engine-only"):
        apply_version(engine, [p], p.manifest.checksum)


class _Refuses(engines.Shadow):
    """An engine that refuses every version (say, a dtype it cannot hold)."""

    def replace(self, state):
        raise MismatchError("this engine holds fp8 weights; the publisher sends bf16")


def test_a_version_that_can_never_apply_surfaces_instead_of_looping():
    with Publisher(ADDR, token=TOKEN) as pub, Subscriber(pub.address, engine=_Refuses(), token=TOKEN) as sub:
        pub.publish({"w": np.zeros(16, np.float32)}, version=0)
        with pytest.raises(MismatchError, match="fp8"):
            sub.wait_for(0, timeout=60)
        assert sub.version is None and 3 <= sub.stats.failures <= 6  # backed off, not a hot loop


def test_on_commit_once_per_committed_version_in_order(gen):
    """One poll commits a keyframe and the deltas after it: one call each, in order; a refused delta gives none,
    the keyframe that replaces it one; a hook that raises never stops the subscriber."""
    trainer, model = tiny_qwen(0), tiny_qwen(1)
    seen: list[dict] = []

    def hook(c: dict) -> None:
        seen.append(c)
        if c["version"] == 1:
            raise RuntimeError("a broken hook")

    with Publisher(ADDR, token=TOKEN, keyframe_every=100) as pub, \
            Subscriber(pub.address, engine=engines.HF(model), token=TOKEN, apply="poll", on_commit=hook) as sub:
        pub.wait_for_subscribers(1, timeout=30)
        publish_steps(pub, trainer, gen, [0, 1, 2])
        pub.flush(timeout=30)  # all three staged, none applied
        assert seen == [] and sub.poll() == 2 and same_bytes(trainer, model)
        assert [(c["version"], c["keyframe"]) for c in seen] == [(0, True), (1, False), (2, False)]
        assert all(c["bytes"] > 0 and c["apply_s"] >= 0 for c in seen)
        assert seen[0]["bytes"] > seen[1]["bytes"]  # the keyframe is raw, the deltas are small
        with torch.no_grad():
            model.model.norm.weight.view(torch.int16)[0] += 1  # drift: the next delta must be refused
        publish_steps(pub, trainer, gen, [3])
        pub.flush(timeout=30)
        # the delta is refused; the keyframe the refusal asks for may arrive while this poll still runs
        polled = sub.poll()
        assert polled in (None, 3) and sub.stats.failures == 1, (polled, sub.stats)
        if polled is None:
            assert isinstance(sub.error, VersionError) and len(seen) == 3
        sub.wait_announced(timeout=30)
        deadline = time.monotonic() + 30
        while sub.version != 3 and time.monotonic() < deadline:
            sub.poll()  # the keyframe of version 3 that the refusal asked for
            time.sleep(0.02)
        assert sub.version == 3 and same_bytes(trainer, model)
        assert [(c["version"], c["keyframe"]) for c in seen] == [(0, True), (1, False), (2, False), (3, True)]


def test_an_engine_whose_tensors_moved_gets_the_next_delta_in_its_new_memory(gen):
    """A model reloaded with assign=True (or moved, or rebuilt by its framework) between two deltas: the
    subscriber binds the new memory, and the delta lands where the model reads."""
    trainer, engine_model = tiny_qwen(0), tiny_qwen(1)
    with Publisher(ADDR, token=TOKEN, keyframe_every=100) as pub, \
            Subscriber(pub.address, engine=engines.HF(engine_model), token=TOKEN) as sub:
        publish_steps(pub, trainer, gen, [0, 1], [sub])
        copies = {}  # one copy per storage: tied weights stay tied
        state = {k: copies.setdefault(v.data_ptr(), v.clone()) for k, v in engine_model.state_dict().items()}
        engine_model.load_state_dict(state, assign=True)
        assert engine_model.lm_head.weight.data_ptr() == engine_model.model.embed_tokens.weight.data_ptr()
        publish_steps(pub, trainer, gen, [2, 3], [sub])
        assert same_bytes(trainer, engine_model)
        assert not sub.stats.last.keyframe and sub.stats.failures == 0
