"""A quantizing Publisher: each version's targeted weights travel as codes and scales, in deltas like any tensor.

Subscribers hold exactly what the quantizer makes of the trainer's weights (their digest is that state's), across
keyframes and deltas; a weight the quantizer refuses fails that publish() alone and loses nothing.
"""
from __future__ import annotations

import pytest
import torch

from helpers import TOKEN

from wsync import engines
from wsync.quant import QuantizeError, from_config
from wsync.snapshot import as_state, digest
from wsync.subscriber import Subscriber
from wsync.sync import Publisher

from test_quant_ref import KIMI_CONFIG, moe_state


def rl_step(state: dict, gen: torch.Generator) -> None:
    """1% of every weight's elements move by a relative step of up to 1%."""
    for t in state.values():
        mask = torch.rand(t.shape, generator=gen) < 0.01
        t.add_(torch.where(mask, t * (torch.rand(t.shape, generator=gen) * 0.02 - 0.01).to(t.dtype), 0))


def test_subscribers_hold_the_quantized_state_through_keyframes_and_deltas():
    gen, state = torch.Generator().manual_seed(1), moe_state()
    reference = from_config(KIMI_CONFIG, backend="ref")  # a quantizer of its own: the publisher's is not read
    with Publisher("tcp://127.0.0.1:0", token=TOKEN, quantize=KIMI_CONFIG, keyframe_every=3) as pub, \
            Subscriber(pub.address, engine=engines.Shadow(), token=TOKEN) as sub:
        for v in range(7):
            rl_step(state, gen)
            pub.publish(state, version=v)
            sub.wait_for(v, timeout=60)
            want = as_state(reference(state))
            assert sub.engine.digest() == digest(want), f"version {v}"
            got = sub.engine.tensors()
            assert got.keys() == want.keys()
            packed = "model.layers.1.mlp.experts.1.up_proj.weight_packed"
            assert got[packed].dtype.name == "I32" and got[packed].bits.tobytes() == want[packed].bits.tobytes()
        pub.flush(60)  # every version's encoding recorded
        # what each version after the first cost on the wire: a small part of the quantized state's bytes
        full = sum(t.bits.nbytes for t in want.values())
        assert all(pub.stats.bytes[v] < full / 10 for v in range(1, 7)), (pub.stats.bytes, full)


def test_a_refused_weight_fails_that_publish_only():
    gen, state = torch.Generator().manual_seed(2), moe_state()
    with Publisher("tcp://127.0.0.1:0", token=TOKEN, quantize=KIMI_CONFIG) as pub, \
            Subscriber(pub.address, engine=engines.Shadow(), token=TOKEN) as sub:
        pub.publish(state, version=0)
        sub.wait_for(0, timeout=60)
        served = sub.engine.digest()
        expert = state["model.layers.1.mlp.experts.0.down_proj.weight"]
        expert[5, 7] = float("nan")
        with pytest.raises(QuantizeError, match=r"experts\.0\.down_proj\.weight: element 327 \(flat index\) is nan"):
            pub.publish(state, version=1)
        assert sub.engine.digest() == served and sub.version == 0
        expert[5, 7] = 0.5
        rl_step(state, gen)
        pub.publish(state, version=1)  # the refused version's number is free: nothing of it was sent
        sub.wait_for(1, timeout=60)
        assert sub.engine.digest() == digest(as_state(from_config(KIMI_CONFIG)(state)))


def test_a_quantizing_publisher_takes_state_dicts_only(tmp_path):
    with Publisher("tcp://127.0.0.1:0", token=TOKEN, quantize=KIMI_CONFIG) as pub:
        with pytest.raises(TypeError, match="takes the trainer's state dict"):
            pub.publish(str(tmp_path), version=0)
        with pytest.raises(TypeError, match="not frozen"):
            pub.publish(moe_state(), version=0, frozen=True)


def test_a_config_the_quantizer_cannot_make_fails_before_anything_listens():
    with pytest.raises(QuantizeError, match="'awq'"):
        Publisher("tcp://127.0.0.1:0", token=TOKEN, quantize={"quant_method": "awq"})
