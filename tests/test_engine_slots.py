"""engines.slots: several versions served at once, each request pinned to one, fed by a real Publisher/Subscriber.

Bit-exact throughout: bytes are compared, never allclose. Requests and updates meet through pins and events, never
through sleeps.
"""
from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
# peft's get_peft_model asks transformers a deprecated question; nothing of ours to change
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

from conftest import bits_equal  # noqa: E402
from engine_helpers import publisher, rl_step, same_bytes, subscriber, tiny_qwen  # noqa: E402
from wsync.engines.peft import adapter_state  # noqa: E402
from wsync.engines.slots import LoraSlots, Pinning, SlotsBusy, TwoInstances  # noqa: E402
from wsync.errors import NotHeld  # noqa: E402
from wsync.errors import ChecksumError, MismatchError  # noqa: E402

SEQ = (torch.arange(8) * 7) % 256
IDS = torch.stack([SEQ, SEQ, SEQ, SEQ.flip(0), SEQ.flip(0)])  # rows 0-2 alike: only their versions differ


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(7)


def lora_model(lora_seed: int):
    model = tiny_qwen(0, dtype=torch.float32)  # the same frozen base whatever the adapter
    torch.manual_seed(lora_seed)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    return peft.get_peft_model(model, cfg).eval()


def lora_step(model, gen) -> None:
    """Move about a third of every adapter tensor's elements, B included, as an optimizer step would."""
    with torch.no_grad():
        for t in adapter_state(model).values():
            t.add_((torch.rand(t.shape, generator=gen) < 0.3) * torch.randn(t.shape, generator=gen) * 0.05)


def owned(state: dict) -> dict:
    return {n: t.detach().clone() for n, t in state.items()}


def publish(pub, sub, state: dict, version: int, states: dict) -> None:
    states[version] = owned(state)
    pub.publish(state, version=version)
    sub.wait_for(version, timeout=30)


def load_adapter(model, state: dict) -> None:
    """Make `state` the only adapter of `model` (a fresh PeftModel over the same base)."""
    with torch.no_grad():
        for n, t in adapter_state(model).items():
            t.copy_(state[n])


def lora_logits(model, state: dict, names: list[str]):
    """Logits of IDS through `model` holding `state` as its only adapter, each row on it or on the base (names)."""
    load_adapter(model, state)
    with torch.no_grad():
        return model(input_ids=IDS, adapter_names=names).logits


def qwen_logits(state: dict):
    """Logits of IDS through a fresh model holding `state`, alone."""
    model = tiny_qwen(3)
    model.load_state_dict(state)
    with torch.no_grad():
        return model(input_ids=IDS).logits


def holds(engine, version: int, state: dict) -> bool:
    """The engine's memory serving `version` holds `state`'s bytes."""
    got = engine.tensors_of(version)
    return same_bytes(got, {n: state[n] for n in got})


# -- LoraSlots ---------------------------------------------------------------------------------------


def test_lora_slots_serve_a_mixed_batch_bit_exact(gen):
    trainer, served = lora_model(1), lora_model(2)
    slots = LoraSlots(served, keep=3)
    states, commits = {}, []
    with publisher(keyframe_every=3) as pub:
        for v in range(5):  # before any subscriber: a keyframe at 0 and at 3, a delta for each version
            lora_step(trainer, gen)
            states[v] = owned(adapter_state(trainer))
            pub.publish(adapter_state(trainer), version=v)
        with subscriber(pub, slots, apply="poll", on_commit=commits.append) as sub:
            sub.wait_for(4, timeout=30)  # catching up: the keyframe of 3, then the delta of 4
            for v in (5, 6):
                lora_step(trainer, gen)
                publish(pub, sub, adapter_state(trainer), v, states)
            assert [(c["version"], c["keyframe"]) for c in commits] == [(3, True), (4, False), (5, False), (6, False)]
            assert sub.stats.failures == 0 and slots.version == 6 and slots.versions == [4, 5, 6]
            assert all(holds(slots, v, states[v]) for v in (4, 5, 6))
            assert len({slots.adapter_for(v) for v in (4, 5, 6)}) == 3
            assert not any(tb.bits.flags.writeable for tb in slots.tensors().values())  # never written in place

            rows = [6, 4, 5, 6, 4]
            out = slots.forward(rows, input_ids=IDS).logits
            # the reference runs the same batch with the other rows on the bare base, so every matmul has the
            # shapes the served batch had and equal bytes are owed, not a matter of how BLAS splits a batch
            fresh = lora_model(9)
            for v in (4, 5, 6):
                ref = lora_logits(fresh, states[v], ["default" if r == v else "__base__" for r in rows])
                assert all(bits_equal(out[i], ref[i]) for i, r in enumerate(rows) if r == v), v
            with torch.no_grad(), fresh.disable_adapter():
                base = fresh(input_ids=IDS).logits
            assert not any(bits_equal(out[i], out[j]) for i, j in ((0, 1), (0, 2), (1, 2)))  # one input, 3 versions
            assert not any(bits_equal(out[i], base[i]) for i in range(len(rows)))
            toks = slots.generate([6, 4], input_ids=IDS[:2], max_new_tokens=3, do_sample=False, pad_token_id=0)
            for i, v in enumerate((6, 4)):
                load_adapter(fresh, states[v])
                ref = fresh.generate(input_ids=IDS[:2], max_new_tokens=3, do_sample=False, pad_token_id=0,
                                     adapter_names=["default" if j == i else "__base__" for j in range(2)])
                assert torch.equal(toks[i], ref[i]), v

            with pytest.raises(NotHeld, match=r"version 3: it holds versions \[4, 5, 6\]"):
                slots.forward([6, 3], input_ids=IDS[:2])
            with pytest.raises(NotHeld, match="version 9"):
                slots.adapter_for(9)

            publish(pub, sub, adapter_state(trainer), 7, states)  # the trainer did not move: nothing to load
            assert slots.versions == [5, 6, 7] and slots.adapter_for(7) == slots.adapter_for(6)
            assert holds(slots, 7, states[7]) and holds(slots, 5, states[5])


def test_lora_slot_of_a_running_request_is_not_reused_until_it_ends(gen):
    trainer, served = lora_model(1), lora_model(2)
    go, pinned, got, waits = threading.Event(), threading.Event(), {}, []
    slots = LoraSlots(served, keep=2, pinning=Pinning(wait_s=30, on_wait=lambda v, n: (waits.append((v, n)),
                                                                                        go.set())))

    def request():  # pinned to version 1, still running once version 1 is evicted
        with slots.pin([1, 1]) as names:
            pinned.set()
            go.wait(30)
            with slots.run_lock, torch.no_grad():
                got["logits"] = served(input_ids=IDS[:2], adapter_names=names).logits

    states = {}
    with publisher(keyframe_every=3) as pub, subscriber(pub, slots) as sub:
        for v in range(3):
            lora_step(trainer, gen)
            publish(pub, sub, adapter_state(trainer), v, states)
        t = threading.Thread(target=request)
        t.start()
        assert pinned.wait(30)
        lora_step(trainer, gen)
        publish(pub, sub, adapter_state(trainer), 3, states)  # a free slot no one reads: no wait
        assert slots.versions == [2, 3] and not waits
        with pytest.raises(NotHeld, match=r"holds versions \[2, 3\]"):
            slots.adapter_for(1)
        lora_step(trainer, gen)
        publish(pub, sub, adapter_state(trainer), 4, states)  # needs version 1's slot: waits for the request
        t.join(30)
        assert waits == [(1, 2)] and slots.versions == [3, 4] and sub.stats.failures == 0
        assert holds(slots, 3, states[3]) and holds(slots, 4, states[4])
    ref = lora_logits(lora_model(9), states[1], ["default"] * len(IDS))
    assert bits_equal(got["logits"], ref[:2])


class FailOnce:
    """engine.load failing for one version as `mode` says, then holding the next version's load until released.

    digest: the load writes one flipped bit, so the digest check after it fails; load: the load itself raises
    (a dtype the engine does not hold); busy: the engine refuses by itself. The Subscriber loads each version once
    and once more to put back a failed one, so the third call is the keyframe it asked for, before it writes
    anything: while it waits on `go_on`, the engine shows what the failure left."""

    def __init__(self, engine, mode: str):
        self.real, self.mode, self.calls = engine.load, mode, 0
        self.next_load, self.go_on = threading.Event(), threading.Event()
        engine.load = self  # an instance attribute: the Subscriber calls it instead of the method

    def __call__(self, named: dict) -> None:
        self.calls += 1
        first = next(iter(named))
        if self.calls == 1 and self.mode == "digest":
            bad = named[first].clone()
            bad.view(-1).view(torch.uint8)[0] ^= 1
            named = {**named, first: bad}
        elif self.calls == 1 and self.mode == "load":
            named = {**named, first: named[first].to(torch.float64)}
        elif self.calls == 3:
            self.next_load.set()
            self.go_on.wait(30)
        self.real(named)


ERRORS = {"digest": ChecksumError, "load": MismatchError, "busy": SlotsBusy}


@pytest.mark.parametrize("mode", ["digest", "load"])
def test_lora_failed_version_leaves_every_slot_as_it_was(gen, mode):
    trainer, served = lora_model(1), lora_model(2)
    slots = LoraSlots(served, keep=2)
    states = {}
    with publisher(keyframe_every=10) as pub, subscriber(pub, slots) as sub:
        for v in range(3):
            lora_step(trainer, gen)
            publish(pub, sub, adapter_state(trainer), v, states)
        before = {v: owned(slots.tensors_of(v)) for v in (1, 2)}
        names = {v: slots.adapter_for(v) for v in (1, 2)}
        fail = FailOnce(slots, mode)
        lora_step(trainer, gen)
        pub.publish(adapter_state(trainer), version=3)
        assert fail.next_load.wait(30)  # version 3 was refused; the keyframe asked for has not written yet
        assert isinstance(sub.error, ERRORS[mode]) and sub.stats.failures == 1, sub.error
        assert slots.version == 2 and slots.versions == [1, 2]
        assert all(slots.adapter_for(v) == names[v] and same_bytes(slots.tensors_of(v), before[v]) for v in (1, 2))
        # the base of the next delta is the newest committed version again
        assert {n: tb.bits.tobytes() for n, tb in slots.tensors().items()} == \
            {n: t.numpy().tobytes() for n, t in states[2].items()}
        with pytest.raises(NotHeld):
            slots.adapter_for(3)
        fail.go_on.set()
        sub.wait_for(3, timeout=30)
        assert sub.stats.last.keyframe and slots.versions == [2, 3] and sub.stats.failures == 1
        assert holds(slots, 2, states[2]) and same_bytes(slots.tensors_of(3), adapter_state(trainer))


# -- TwoInstances ------------------------------------------------------------------------------------


def test_two_instances_pinned_requests_finish_on_their_version(gen):
    trainer = tiny_qwen(0)
    go, waits = threading.Event(), []
    two = TwoInstances(tiny_qwen(1), tiny_qwen(2), pinning=Pinning(wait_s=30, on_wait=lambda v, n: (
        waits.append((v, n)), go.set())))
    states, commits, got = {}, [], {}

    def request(version, key, pinned: threading.Event, release: threading.Event):
        with two.pin(version) as (ver, model):
            pinned.set()
            release.wait(30)
            with torch.no_grad():
                got[key] = ver, model(input_ids=IDS).logits

    with publisher(keyframe_every=3) as pub:
        for v in range(5):  # before any subscriber: it catches up from the keyframe of 3
            rl_step(trainer, gen)
            states[v] = owned(trainer.state_dict())
            pub.publish(trainer.state_dict(), version=v)
        with subscriber(pub, two, on_commit=commits.append) as sub:
            sub.wait_for(4, timeout=30)
            rl_step(trainer, gen)
            publish(pub, sub, trainer.state_dict(), 5, states)
            assert two.versions == [4, 5] and holds(two, 4, states[4]) and holds(two, 5, states[5])

            # a request on the newest version runs on while the next one commits (into the other instance)
            pinned, release = threading.Event(), threading.Event()
            t = threading.Thread(target=request, args=(None, "k", pinned, release))
            t.start()
            assert pinned.wait(30)
            rl_step(trainer, gen)
            publish(pub, sub, trainer.state_dict(), 6, states)
            assert two.versions == [5, 6] and not waits
            with two.pin() as (newest, _):
                assert newest == 6
            release.set()
            t.join(30)

            # a request on the previous version holds the standby: the next version waits for it to end
            pinned = threading.Event()
            t = threading.Thread(target=request, args=(5, "k-1", pinned, go))
            t.start()
            assert pinned.wait(30)
            rl_step(trainer, gen)
            publish(pub, sub, trainer.state_dict(), 7, states)
            t.join(30)
            assert waits == [(5, 1)] and two.versions == [6, 7] and sub.stats.failures == 0
            assert holds(two, 6, states[6]) and holds(two, 7, states[7])
            newest = two.forward(None, input_ids=IDS).logits
    assert [(c["version"], c["keyframe"]) for c in commits] == [(3, True)] + [(v, False) for v in range(4, 8)]
    assert got["k"][0] == 5 and bits_equal(got["k"][1], qwen_logits(states[5]))
    assert got["k-1"][0] == 5 and bits_equal(got["k-1"][1], qwen_logits(states[5]))
    assert bits_equal(newest, qwen_logits(states[7]))


@pytest.mark.parametrize("mode", ["digest", "load", "busy"])
def test_two_instances_failed_version_leaves_both_as_they_were(gen, mode):
    trainer, a, b = tiny_qwen(0), tiny_qwen(1), tiny_qwen(2)
    two = TwoInstances(a, b, pinning=Pinning(wait_s=0))
    states = {}
    with publisher(keyframe_every=10) as pub, subscriber(pub, two) as sub:
        for v in range(3):
            rl_step(trainer, gen)
            publish(pub, sub, trainer.state_dict(), v, states)
        before = [owned(m.state_dict()) for m in (a, b)]
        fail = FailOnce(two, mode)
        with two.pin(1 if mode == "busy" else 2):  # busy: a request on the standby's version
            rl_step(trainer, gen)
            states[3] = owned(trainer.state_dict())
            pub.publish(trainer.state_dict(), version=3)
            assert fail.next_load.wait(30)  # version 3 was refused; the keyframe asked for has not written yet
        assert isinstance(sub.error, ERRORS[mode]) and sub.stats.failures == 1, sub.error
        if mode == "busy":
            assert "1 requests pinned to version 1" in str(sub.error) and "Pinning.wait_s" in str(sub.error)
        assert two.version == 2 and two.versions == [1, 2]
        assert same_bytes(a.state_dict(), before[0]) and same_bytes(b.state_dict(), before[1])
        assert holds(two, 1, states[1]) and holds(two, 2, states[2])
        fail.go_on.set()
        sub.wait_for(3, timeout=30)
        assert sub.stats.last.keyframe and two.versions == [2, 3] and sub.stats.failures == 1
        assert holds(two, 2, states[2]) and holds(two, 3, states[3])


def test_wrong_models_are_refused_with_what_to_fix():
    with pytest.raises(MismatchError, match=r"no PEFT adapter 'other' \(adapters: \['default'\]\)"):
        LoraSlots(lora_model(1), adapter_name="other")
    with pytest.raises(ValueError, match="keep must be a positive int"):
        LoraSlots(lora_model(1), keep=0)
    served = lora_model(1)
    LoraSlots(served, keep=1)
    with pytest.raises(MismatchError, match="one LoraSlots per model"):
        LoraSlots(served, keep=1)
    with pytest.raises(MismatchError, match="the two instances hold different tensors"):
        TwoInstances(tiny_qwen(0), tiny_qwen(0, dtype=torch.float32))
    with pytest.raises(NotHeld, match="nothing is committed yet"):
        with TwoInstances(tiny_qwen(0), tiny_qwen(1)).pin():
            pass
