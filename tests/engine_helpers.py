"""Shared pieces of the engine tests: tiny models, RL-like steps, fused engine layouts, addresses."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers

from helpers import TOKEN


def publisher(**kw):
    """A Publisher on loopback tcp, authenticated."""
    from wsync.sync import Publisher

    return Publisher("tcp://127.0.0.1:0", token=TOKEN, **kw)


def subscriber(pub, engine, **kw):
    from wsync.subscriber import Subscriber

    return Subscriber(pub.address, engine=engine, token=TOKEN, **kw)


def tiny_qwen(seed: int, tie: bool = True, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                   tie_word_embeddings=tie, max_position_embeddings=64)
    return transformers.Qwen3ForCausalLM(cfg).to(dtype).eval()


def rl_step(model, gen: torch.Generator, density: float = 0.02) -> None:
    """~2% of bf16 elements move by one or two representable steps, as in an RL step."""
    with torch.no_grad():
        for p in model.parameters():
            bits = p.data.view(torch.int16)
            mask = torch.rand(bits.shape, generator=gen) < density
            step = torch.randint(-2, 3, bits.shape, generator=gen, dtype=torch.int16)
            bits[mask] += step[mask]


def same_bytes(sa: dict, sb: dict) -> bool:
    return sa.keys() == sb.keys() and all(
        sa[k].contiguous().view(torch.uint8).numpy().tobytes() == sb[k].contiguous().view(torch.uint8).numpy().tobytes()
        for k in sa)


class Rows(torch.nn.Module):
    """A Linear that computes with rows [start, start+n) of a fused Linear's weight (holds no parameter)."""

    def __init__(self, fused: torch.nn.Linear, start: int, n: int):
        super().__init__()
        object.__setattr__(self, "fused", fused)  # not a submodule: the weight lives once, in the fused Linear
        self.start, self.n = start, n

    def forward(self, x):
        return F.linear(x, self.fused.weight.narrow(0, self.start, self.n))


def fuse(model) -> None:
    """Turn a Qwen3 model into a vLLM-style engine layout: qkv_proj and gate_up_proj hold the weights."""
    for layer in model.model.layers:
        for mod, parts, fused_name in ((layer.self_attn, ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
                                       (layer.mlp, ("gate_proj", "up_proj"), "gate_up_proj")):
            ws = [getattr(mod, p).weight.data for p in parts]
            big = torch.nn.Linear(ws[0].shape[1], sum(w.shape[0] for w in ws), bias=False,
                                  dtype=ws[0].dtype)
            with torch.no_grad():
                big.weight.copy_(torch.cat(ws))
            setattr(mod, fused_name, big)
            off = 0
            for p, w in zip(parts, ws):
                setattr(mod, p, Rows(big, off, w.shape[0]))
                off += w.shape[0]


class Served(torch.nn.Module):
    """vLLM's model as the worker sees it: load_weights over (name, tensor) pairs."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def load_weights(self, weights):
        params = dict(self.inner.named_parameters())
        for name, t in weights:
            params[name].data.copy_(t)
