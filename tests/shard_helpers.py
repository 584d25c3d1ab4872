"""Helpers for the sharded sync tests: a tiny Qwen3-like state, FSDP and TP layouts of it, a versioned reference,
and the engine-rank worker process.

The layouts come from wsync.shard.conventions (FSDP2's Shard(0) with torch's uneven chunks on the trainer
side; vLLM's fused, padded layout or torch TP's uneven one on the engine side), routed by wsync.shard.route.
"""
from __future__ import annotations

import os
import signal
import time

import numpy as np
from wsync.shard.layout import Param, box_numel

DT = "bfloat16"
TOKEN = "shard-test-token"


def qwen_params(layers: int = 2, hidden: int = 48, inter: int = 100, vocab: int = 130, heads: int = 4,
                kv_heads: int = 2, head_dim: int = 12) -> dict[str, Param]:
    """The parameter names and shapes of a tiny Qwen3 (uneven sizes, so TP=3 and FSDP=4 split unevenly)."""
    p = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        pre = f"model.layers.{i}."
        p |= {pre + "self_attn.q_proj.weight": (heads * head_dim, hidden),
              pre + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
              pre + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
              pre + "self_attn.o_proj.weight": (hidden, heads * head_dim),
              pre + "self_attn.q_norm.weight": (head_dim,), pre + "self_attn.k_norm.weight": (head_dim,),
              pre + "mlp.gate_proj.weight": (inter, hidden), pre + "mlp.up_proj.weight": (inter, hidden),
              pre + "mlp.down_proj.weight": (hidden, inter),
              pre + "input_layernorm.weight": (hidden,), pre + "post_attention_layernorm.weight": (hidden,)}
    p |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    return {n: Param(tuple(s), DT) for n, s in p.items()}


def make_plan(m: int, n: int, engine: str = "vllm", **dims):
    """FSDP2 over m trainer ranks -> one engine of n tensor-parallel ranks: "vllm" (fused qkv / gate_up, padded
    vocabulary; sizes must divide) or "hf" (torch TP on a transformers model, names unchanged, uneven splits)."""
    from wsync.shard.conventions import VllmConfig, fsdp_placements, hf_tp_layout, trainer_layout_for, vllm_layout
    from wsync.shard.route import route

    params = qwen_params(**dims)
    trainer = trainer_layout_for(params, fsdp_placements(params), m)
    if engine == "vllm":
        d = {"heads": 4, "kv_heads": 2, "head_dim": 12} | {k: v for k, v in dims.items() if k.endswith("head_dim")
                                                           or k.endswith("heads")}
        eng = vllm_layout(params, n, VllmConfig(num_heads=d["heads"], num_kv_heads=d["kv_heads"],
                                                 head_dim=d["head_dim"]))
    else:
        eng = hf_tp_layout(params, n)
    return route(trainer, eng)


class Reference:
    """The unsharded state at each version: random bf16 at 0, then ~1% of values move by one or two steps.

    Deterministic from the seed, so every process computes the same bytes without sending them."""

    def __init__(self, params: dict[str, Param], seed: int = 7, density: float = 0.01):
        self.params, self.seed, self.density = params, seed, density
        self.version, self.bits = 0, {}
        rng = np.random.default_rng(seed)
        for name, p in params.items():
            x = rng.standard_normal(p.shape).astype(np.float32) * 0.05
            self.bits[name] = (x.view(np.uint32) >> 16).astype(np.uint16)  # bf16 bit patterns

    def at(self, version: int) -> dict[str, np.ndarray]:
        if version < self.version:
            self.__init__(self.params, self.seed, self.density)
        while self.version < version:
            self.version += 1
            rng = np.random.default_rng((self.seed, self.version))
            for b in self.bits.values():
                flat = b.reshape(-1)
                pos = rng.choice(flat.size, max(1, int(flat.size * self.density)), replace=False)
                flat[pos] = (flat[pos].astype(np.int32) + rng.choice([-2, -1, 1, 2], pos.size)).astype(np.uint16)
        return self.bits

    def torch_state(self, version: int) -> dict:
        import torch

        return {n: torch.from_numpy(b.copy()).view(torch.bfloat16) for n, b in self.at(version).items()}


def sl(box) -> tuple:
    return tuple(slice(a, b) for a, b in box)


def trainer_local(plan, rank: int, state: dict) -> dict:
    return {h.name: state[h.name][sl(h.box)].contiguous() for h in plan.trainer.held if h.rank == rank}


def engine_expected(plan, rank: int, bits: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What engine rank `rank`'s local tensors hold at a version: the unsharded reference, sliced."""
    out = {name: np.zeros(p.shape, np.uint16) for (r, name), p in plan.engine.locals.items() if r == rank}
    for n in plan.engine.needs:
        if n.rank == rank:
            out[n.name][sl(n.dst)] = bits[n.src_name][sl(n.src)]
    return out


def piece_bytes(pieces) -> int:
    return sum(box_numel(p.src) * 2 for p in pieces)


# -- the engine-rank process ----------------------------------------------------------------------


def engine_worker(rank: int, spec: dict, coordinator: str, out, hooks: dict) -> None:
    """One engine rank: local tensors of zeros, a ShardSubscriber, and after every outcome a byte check of every
    local tensor against the reference at the version it serves, posted to `out` as
    (rank, event, version served, ok). hooks: die_at / stall_at = (version, trainer rank) and
    corrupt_at = version, the faults the tests inject; stall_s: how long a stall lasts."""
    import torch

    from wsync.shard.sync import ShardSubscriber

    plan = make_plan(spec["m"], spec["n"], spec["engine"], **spec.get("dims", {}))
    ref = Reference(qwen_params(**spec.get("dims", {})))
    tensors = {name: torch.zeros(p.shape, dtype=torch.bfloat16) for (r, name), p in plan.engine.locals.items()
               if r == rank}

    def progress(src, version, bucket, buckets, nbytes):
        if hooks.get("die_at") == (version, src):
            os.kill(os.getpid(), signal.SIGKILL)  # after this rank received a bucket of the version, never ready
        if hooks.get("stall_at") == (version, src) and bucket == 1:
            time.sleep(hooks.get("stall_s", 6.0))

    sub = ShardSubscriber(plan, rank, tensors, coordinator=coordinator, token=TOKEN, progress=progress)
    while sub.stage is None:
        time.sleep(0.02)
    if "corrupt_at" in hooks:
        _corrupt_staging(sub, hooks["corrupt_at"])
    out.put((rank, "joined", None, True, None))
    seen = 0
    while True:
        with sub.lock:
            events, version = list(sub.events), sub.version
            if len(events) > seen:
                ok = version is None or all(
                    np.array_equal(t.view(torch.uint16).numpy(), want)
                    for name, want in engine_expected(plan, rank, ref.at(version)).items()
                    for t in [tensors[name]])
        for ev in events[seen:]:
            out.put((rank, ev[0], version, ok, ev[1]))
        seen = len(events)
        time.sleep(0.02)


def _corrupt_staging(sub, version: int) -> None:
    """Flip one staged byte of this rank's first piece when the round for `version` reads its staging."""
    stage, orig = sub.stage, sub.stage.staged_sums

    def staged_sums():
        if sub._round == version:
            src = min(stage.sources)
            key = stage.by_src[src][0].key
            stage.sources[src].engine.state[key].bits[0] ^= 0x0100
        return orig()
    stage.staged_sums = staged_sums
