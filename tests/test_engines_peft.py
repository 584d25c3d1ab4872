"""engines.PEFT and MoE adapters: only adapter tensors travel, and a running model follows them bit for bit."""
from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from engine_helpers import publisher, same_bytes, subscriber, tiny_qwen  # noqa: E402
from wsync import engines  # noqa: E402
from wsync.engines import moe_lora  # noqa: E402
from wsync.engines.peft import PEFT, adapter_state, base_digest  # noqa: E402
from wsync.errors import MismatchError  # noqa: E402

IDS = (torch.arange(24).reshape(3, 8) * 7) % 256


def lora_model(base_seed: int, lora_seed: int):
    model = tiny_qwen(base_seed, dtype=torch.float32)
    torch.manual_seed(lora_seed)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                               "gate_proj", "up_proj", "down_proj"])
    return peft.get_peft_model(model, cfg)


def train_step(model, opt) -> None:
    """One real optimizer step on a next-token loss (moves every adapter tensor, B included)."""
    model.train()
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    model.eval()


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_peft_model_follows_adapter_only_while_generating():
    trainer, served = lora_model(0, 1), lora_model(0, 2)
    assert base_digest(trainer) == base_digest(served)  # same frozen base, different adapters
    assert not same_bytes(adapter_state(trainer), adapter_state(served))
    engine = PEFT(served, guarded=True)
    opt = torch.optim.AdamW([p for p in trainer.parameters() if p.requires_grad], lr=1e-2)
    stop, outs = threading.Event(), []

    def generate():  # a decode loop that never stops while versions land
        ids = IDS[:1, :2]
        while not stop.is_set():
            with engine.lock, torch.no_grad():
                nxt = served(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)[:, -12:]
            outs.append(nxt)

    t = threading.Thread(target=generate)
    t.start()
    try:
        with publisher(keyframe_every=4) as pub, subscriber(pub, engine) as sub:
            for v in range(6):
                train_step(trainer, opt)
                pub.publish(adapter_state(trainer), version=v)
                sub.wait_for(v, timeout=30)
                assert engine.digest() == PEFT(trainer).digest()
            full = sum(t.numel() * t.element_size() for t in trainer.state_dict().values())
            adapter = sum(t.numel() * t.element_size() for t in adapter_state(trainer).values())
            # what travels is the adapter: Adam moves every adapter value, so a delta costs about as much as raw
            assert sub.stats.failures == 0 and sub.stats.bytes < 6 * 2 * adapter and 2 * adapter < full / 3
    finally:
        stop.set()
        t.join()
    assert len(outs) > 6
    assert same_bytes(adapter_state(trainer), adapter_state(served))
    assert base_digest(trainer) == base_digest(served)  # the base was never touched
    assert torch.equal(logits(trainer), logits(served))


def test_peft_poll_mode_in_place():
    trainer, served = lora_model(0, 1), lora_model(0, 3)
    engine = PEFT(served)
    ptrs = {n: p.data_ptr() for n, p in served.named_parameters()}
    opt = torch.optim.SGD([p for p in trainer.parameters() if p.requires_grad], lr=0.5)
    with publisher() as pub, subscriber(pub, engine, apply="poll") as sub:
        pub.wait_for_subscribers(1, timeout=30)
        for v in range(3):
            train_step(trainer, opt)
            pub.publish(adapter_state(trainer), version=v)
            pub.flush(timeout=30)
            assert sub.poll() == v
    assert ptrs == {n: p.data_ptr() for n, p in served.named_parameters()}
    assert torch.equal(logits(trainer), logits(served))


def test_peft_refuses_a_missing_adapter():
    with pytest.raises(MismatchError, match="no PEFT adapter"):
        PEFT(lora_model(0, 1), adapter_name="other")
    with pytest.raises(MismatchError, match="no PEFT adapter"):
        PEFT(tiny_qwen(0))


def tiny_moe(seed: int):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                      num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      max_position_embeddings=64, decoder_sparse_step=1, mlp_only_layers=[])
    return transformers.Qwen3MoeForCausalLM(cfg).eval()


@pytest.mark.parametrize("layout", moe_lora.LAYOUTS)
def test_moe_adapter_layouts_follow_exactly(layout):
    from wsync.plan.lora import site_lora_params
    from wsync.plan.params import Site

    trainer, served = tiny_moe(0), tiny_moe(0)
    with torch.no_grad():
        plain = trainer(input_ids=IDS % 128).logits
    torch.manual_seed(1)
    assert moe_lora.attach(trainer, rank=4, layout=layout) == 2
    with torch.no_grad():  # B starts at zero: the wrapped experts compute what the plain ones did (up to the
        # summation order of transformers' own experts kernel; this checks the forward, not a sync path)
        torch.testing.assert_close(trainer(input_ids=IDS % 128).logits, plain, rtol=0, atol=1e-6)
    torch.manual_seed(2)
    moe_lora.attach(served, rank=4, layout=layout)
    engine = engines.HF(served, select=moe_lora.is_adapter)
    names = engine.tensors()
    assert names and all(".experts." in n for n in names)
    # the adapter holds exactly as many values as wsync.plan.lora counts for this layout
    sites = [Site(name=f"experts.{p}", group="routed_experts", d_in=i, d_out=o, layers=2, experts=4)
             for p, i, o in (("gate_proj", 32, 16), ("up_proj", 32, 16), ("down_proj", 16, 32))]
    assert sum(t.numel() for t in names.values()) == sum(site_lora_params(s, 4, layout) for s in sites)
    params = [p for n, p in trainer.named_parameters() if moe_lora.is_adapter(n)]
    for n, p in trainer.named_parameters():
        p.requires_grad_(moe_lora.is_adapter(n))
    opt = torch.optim.SGD(params, lr=0.5)
    ids = IDS % 128
    with publisher() as pub, subscriber(pub, engine) as sub:
        for v in range(3):
            trainer.train()
            trainer(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            pub.publish({n: p.detach() for n, p in trainer.named_parameters() if moe_lora.is_adapter(n)}, version=v)
            sub.wait_for(v, timeout=30)
    trainer.eval()
    assert same_bytes(trainer.state_dict(), served.state_dict())
    with torch.no_grad():
        assert torch.equal(trainer(input_ids=ids).logits, served(input_ids=ids).logits)


def test_moe_shared_outer_is_smaller_and_shapes_are_defined():
    per = moe_lora.adapter_shapes(experts=8, hidden=64, inter=16, rank=4, layout="per-expert")
    shared = moe_lora.adapter_shapes(experts=8, hidden=64, inter=16, rank=4, layout="shared-outer")
    assert shared["gate_proj.lora_A"] == (4, 64) and per["gate_proj.lora_A"] == (8, 4, 64)
    assert shared["down_proj.lora_B"] == (64, 4) and shared["down_proj.lora_A"] == (8, 4, 16)
    count = lambda s: sum(torch.Size(v).numel() for v in s.values())  # noqa: E731
    assert count(shared) < count(per)
    with pytest.raises(ValueError, match="layout"):
        moe_lora.adapter_shapes(experts=8, hidden=64, inter=16, rank=4, layout="dense")
