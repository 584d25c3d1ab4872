"""The rank processes of `wsync bench reshard`: trainer ranks and engine ranks, driven over pipes.

Each trainer rank generates only its own shards (deterministic from the
parameter, the box and the version, so both paths see the same bytes without
anyone holding the whole model); the gather path then does what a rank-0
funnel does: a gloo gather of every rank's shards to rank 0, which assembles
the full parameters and publishes them with one Publisher to every engine
rank. Engine ranks end each version with their local tensors written and
report when, and an xxh3 of those tensors, so the two paths can be compared
byte for byte.
"""
from __future__ import annotations

import os
import time

import numpy as np
import xxhash

from wsync.shard.layout import Param, box_shape


def qwen3_params(layers, hidden, inter, vocab, heads, kv_heads, head_dim) -> dict[str, Param]:
    p = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        p |= {a + "q_proj.weight": (heads * head_dim, hidden), a + "k_proj.weight": (kv_heads * head_dim, hidden),
              a + "v_proj.weight": (kv_heads * head_dim, hidden), a + "o_proj.weight": (hidden, heads * head_dim),
              a + "q_norm.weight": (head_dim,), a + "k_norm.weight": (head_dim,),
              m + "gate_proj.weight": (inter, hidden), m + "up_proj.weight": (inter, hidden),
              m + "down_proj.weight": (hidden, inter), f"model.layers.{i}.input_layernorm.weight": (hidden,),
              f"model.layers.{i}.post_attention_layernorm.weight": (hidden,)}
    return {n: Param(tuple(s), "bfloat16") for n, s in p.items()}


def make_plan(spec: dict):
    """FSDP2 Shard(0) over the trainer ranks -> one vLLM engine of tensor-parallel ranks (fused qkv and gate_up,
    row-parallel o/down, padded vocabulary), routed once."""
    from wsync.shard.conventions import VllmConfig, fsdp_placements, trainer_layout_for, vllm_layout
    from wsync.shard.route import route

    d = spec["dims"]
    params = qwen3_params(**d)
    trainer = trainer_layout_for(params, fsdp_placements(params), spec["m"])
    engine = vllm_layout(params, spec["n"], VllmConfig(num_heads=d["heads"], num_kv_heads=d["kv_heads"],
                                                       head_dim=d["head_dim"]))
    return route(trainer, engine)


def _sl(box) -> tuple:
    return tuple(slice(a, b) for a, b in box)


class Shards:
    """One trainer rank's shards at a version: random bf16, then `density` of them moved by 1-2 steps a version."""

    def __init__(self, plan, rank: int, density: float):
        import torch

        self.held = [h for h in plan.trainer.held if h.rank == rank]
        self.density, self.version = density, 0
        self.bits = {}
        for h in self.held:
            rng = np.random.default_rng([xxhash.xxh32_intdigest(h.name.encode()), *[a for a, _ in h.box]])
            x = (rng.standard_normal(box_shape(h.box)).astype(np.float32) * 0.02).view(np.uint32)
            self.bits[h.name] = ((x + 0x8000) >> 16).astype(np.uint16)
        self.tensors = {n: torch.from_numpy(b).view(torch.bfloat16) for n, b in self.bits.items()}

    def step_to(self, version: int) -> None:
        while self.version < version:
            self.version += 1
            for h in self.held:
                flat = self.bits[h.name].reshape(-1)
                rng = np.random.default_rng([xxhash.xxh32_intdigest(h.name.encode()), h.box[0][0], self.version])
                idx = np.flatnonzero(rng.random(flat.size) < self.density)
                flat[idx] = (flat[idx].astype(np.int64) + rng.choice([-2, -1, 1, 2], idx.size)).astype(np.uint16)


def trainer_main(rank: int, spec: dict, conn, dist_port: int) -> None:
    """Commands: ("sharded", codec, coordinator|None), ("gather", codec), ("publish", v), ("bytes",), ("stop",),
    ("exit",). Each answers with one reply."""
    import torch
    import torch.distributed as dist

    from wsync.sync import Publisher
    from wsync.shard.sync import ShardPublisher

    torch.set_num_threads(1)
    plan, m = make_plan(spec), spec["m"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank, world_size=m)
    path = pub = shards = None
    full = {}
    while True:
        cmd = conn.recv()
        if cmd[0] in ("sharded", "gather"):
            path, codec, shards = cmd[0], cmd[1], Shards(plan, rank, spec["density"])
            if path == "sharded":
                pub = ShardPublisher(plan, rank, coordinator=cmd[2] or "tcp://127.0.0.1:0",
                                     host_coordinator=cmd[2] is None, codec=codec, timeout=600.0,
                                     transport=spec.get("transport", "tcp"))
                conn.send(pub.coordinator_address)
            else:
                pub = Publisher(gather_address(spec), codec=codec) if rank == 0 else None
                full = {n: torch.empty(p.shape, dtype=torch.bfloat16) for n, p in plan.trainer.params.items()} \
                    if rank == 0 else {}
                conn.send(pub.address if pub else None)
        elif cmd[0] == "publish":
            shards.step_to(cmd[1])
            t0 = time.monotonic()
            if path == "sharded":
                pub.publish(shards.tensors, cmd[1])
                conn.send((t0, 0))
            else:
                conn.send((t0, _gather(plan, rank, m, shards, full, pub, cmd[1])))
        elif cmd[0] == "bytes":
            conn.send(pub.stats.bytes if pub else {})
        elif cmd[0] == "stop":
            if pub is not None:
                pub.close()
            pub = None
            conn.send(True)
        elif cmd[0] == "exit":
            dist.destroy_process_group()
            return


def gather_address(spec: dict) -> str:
    """Where trainer rank 0 publishes the gathered state on the gather path: the transport the sharded path's pairs
    use, so the two differ only in who sends what (over gloo: one broadcast group of rank 0 and every engine rank,
    the gather-and-broadcast most frameworks run)."""
    transport = spec.get("transport", "tcp")
    if transport == "local":
        return f"local://ws-bench-{os.getpid()}"
    if transport in ("gloo", "nccl"):
        return f"{transport}://127.0.0.1:0?world_size={spec['n'] + 1}"
    return f"{transport}://127.0.0.1:0"


def _gather(plan, rank: int, m: int, shards: Shards, full: dict, pub, version: int) -> int:
    """Every rank's shards to rank 0 (one gloo gather of a padded flat buffer each), assembled into the full
    parameters and published there; returns the bytes rank 0 received."""
    import torch
    import torch.distributed as dist

    sizes = [sum(int(np.prod(box_shape(h.box))) for h in plan.trainer.held if h.rank == t) for t in range(m)]
    flat = torch.zeros(max(sizes), dtype=torch.int16)
    if sizes[rank]:
        torch.cat([shards.tensors[h.name].reshape(-1).view(torch.int16) for h in shards.held], out=flat[:sizes[rank]])
    bufs = [torch.empty_like(flat) for _ in range(m)] if rank == 0 else None
    dist.gather(flat.view(torch.uint8), [b.view(torch.uint8) for b in bufs] if bufs else None, dst=0)  # gloo: no int16
    if rank != 0:
        return 0
    for t in range(m):
        at = 0
        for h in (h for h in plan.trainer.held if h.rank == t):
            n = int(np.prod(box_shape(h.box)))
            full[h.name][_sl(h.box)] = bufs[t][at:at + n].view(torch.bfloat16).reshape(box_shape(h.box))
            at += n
    pub.publish(full, version)
    return (m - 1) * flat.numel() * 2


def engine_main(rank: int, spec: dict, conn) -> None:
    """Commands: ("sharded", coordinator), ("gather", address), ("await", v), ("stop",), ("exit",)."""
    import torch

    from wsync.engines import Shadow
    from wsync.shard.sync import ShardSubscriber
    from wsync.subscriber import Subscriber

    torch.set_num_threads(1)
    plan = make_plan(spec)
    mine = {name: p for (r, name), p in plan.engine.locals.items() if r == rank}
    needs = [nd for nd in plan.engine.needs if nd.rank == rank]
    sub = path = None
    while True:
        cmd = conn.recv()
        if cmd[0] in ("sharded", "gather"):
            path = cmd[0]
            local = {n: torch.zeros(p.shape, dtype=torch.bfloat16) for n, p in mine.items()}
            sub = ShardSubscriber(plan, rank, local, coordinator=cmd[1]) if path == "sharded" else \
                Subscriber(cmd[1], engine=Shadow())
            conn.send(True)
        elif cmd[0] == "await":
            sub.wait_for(cmd[1], timeout=180)
            if path == "gather":  # the engine rank's slices of the full state it was sent
                held = sub.engine.state
                for nd in needs:
                    tb = held[nd.src_name]
                    full = torch.from_numpy(tb.bits).view(torch.bfloat16).reshape(tb.shape)
                    local[nd.name][_sl(nd.dst)] = full[_sl(nd.src)]
            t = time.monotonic()
            got = sub.received_bytes() if path == "sharded" else sub.stats.bytes
            h = xxhash.xxh3_64()
            for n in sorted(local):
                h.update(local[n].view(torch.int16).numpy().tobytes())
            conn.send((t, h.hexdigest(), got))
        elif cmd[0] == "stop":
            sub.close()
            conn.send(True)
        elif cmd[0] == "exit":
            return
