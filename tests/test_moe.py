"""MoE-scale states: a transformers Qwen3-MoE model with over 10,000 tensors under per-expert names, synced
bit-exact version after version, in both directions of the fused/per-expert naming."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import wsync
from wsync.engines import moe
from wsync.engines.hf import HF
from wsync.errors import MismatchError


EXPERTS, LAYERS = 1024, 4  # 4 x 1024 x 3 = 12,288 expert tensors under per-expert names


def _qwen3_moe(seed: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                         num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         num_experts=EXPERTS, num_experts_per_tok=2, tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    # transformers >= 5 (the dev extra's pin) fuses a layer's experts in 3-D tensors: the layout these tests map
    assert "model.layers.0.mlp.experts.gate_up_proj" in model.state_dict()
    return model


def _rl_step(params, rng, density=0.01):
    """Move ~1% of every bf16 parameter by one or two representable values, in place (as an optimizer does)."""
    with torch.no_grad():
        for p in params:
            bits = p.detach().view(torch.int16).numpy().reshape(-1)
            idx = np.flatnonzero(rng.random(bits.size) < density)
            bits[idx] = (bits[idx].astype(np.int32) + rng.choice([-2, -1, 1, 2], size=len(idx))).astype(np.int16)


def _bytes(named) -> dict:
    return {n: t.detach().contiguous().view(torch.uint8).numpy().tobytes() for n, t in named.items()}


def _nested_module(named: dict) -> torch.nn.Module:
    """A module tree holding the given parameters under their dotted names (an engine with a module per expert)."""
    root = torch.nn.Module()
    for name, t in named.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(t.detach().clone(), requires_grad=False))
    return root


def _sync(trainer_state, engine, params, versions, rng):
    """Keyframe, then `versions` deltas through tcp loopback; returns publish -> live seconds per delta."""
    bound = wsync.bind(trainer_state)
    times = []
    with wsync.Publisher("tcp://127.0.0.1:0", keyframe_every=0) as pub:
        with wsync.Subscriber(pub.address, engine=engine) as sub:
            pub.publish(bound, version=0)
            sub.wait_for(0, timeout=120)
            for v in range(1, versions + 1):
                _rl_step(params, rng)
                t0 = time.perf_counter()
                pub.publish(bound, version=v)
                sub.wait_for(v, timeout=120)
                times.append(time.perf_counter() - t0)
                assert sub.stats.last.keyframe is False  # every version after the first went as a delta
            assert sub.error is None
    return times


def test_per_expert_trainer_into_fused_transformers_engine():
    """The trainer names 12,288 experts one by one; the engine is transformers 5's fused Qwen3-MoE."""
    trainer = _qwen3_moe(0)
    state = moe.split_fused(trainer.state_dict())  # a per-expert trainer's names
    assert len(state) >= 10_000
    served = _qwen3_moe(1)
    engine = HF(served, experts="per_expert")
    assert len(engine.tensors()) == len(state)
    times = _sync(state, engine, list(trainer.parameters()), 5, np.random.default_rng(0))
    assert _bytes(served.state_dict()) == _bytes(trainer.state_dict())  # every byte of every fused expert
    ids = torch.arange(8).unsqueeze(0)
    with torch.no_grad():  # the engine still runs, on exactly the trainer's weights
        assert torch.equal(served(ids).logits, trainer(ids).logits)
    print(f"\n{len(state):,} tensors, publish -> live per delta: {', '.join(f'{t * 1e3:.0f} ms' for t in times)}")


def test_fused_trainer_into_per_expert_engine():
    """The reverse: the trainer publishes transformers 5's fused 3-D experts, the engine has a module per expert."""
    trainer = _qwen3_moe(2)
    fused = trainer.state_dict()
    target = _nested_module(moe.split_fused(_qwen3_moe(3).state_dict()))
    assert sum(1 for _ in target.parameters()) >= 10_000
    engine = HF(target, experts="fused")
    assert set(engine.tensors()) == set(fused)
    _sync(fused, engine, list(trainer.parameters()), 5, np.random.default_rng(1))
    expect = _bytes(moe.split_fused(trainer.state_dict()))
    assert _bytes(dict(target.named_parameters())) == expect


def test_mapping_views_share_memory_and_refuse_gaps():
    model = _qwen3_moe(4)
    sd = model.state_dict()
    split = moe.split_fused(sd)
    g = sd["model.layers.0.mlp.experts.gate_up_proj"]
    assert split["model.layers.0.mlp.experts.5.up_proj.weight"].data_ptr() == g[5, g.shape[1] // 2:].data_ptr()
    fused = moe.fuse_per_expert(split)
    assert fused["model.layers.0.mlp.experts.gate_up_proj"].shape == tuple(g.shape)
    del split["model.layers.1.mlp.experts.7.up_proj.weight"]
    with pytest.raises(MismatchError, match="experts.7"):
        moe.fuse_per_expert(split)
