"""wsync.engines.vllm_shard without vLLM: the plan a worker builds, what it refuses, and its serving rule.

The engine ranks are spawned processes holding a module tree with vLLM's per-rank names and shapes, in which
the fused qkv / gate_up layers imitate vLLM's CPU backend (weight emptied, a `cpu_linear` over a packed copy
made by the layer's quant method); the real vLLM runs in test_vllm_shard_real.py. The trainer ranks are
ShardPublishers in this process (rank 0 hosts the coordinator), over tcp loopback.
"""
from __future__ import annotations

import multiprocessing as mp

import pytest

from helpers import TOKEN
from shard_helpers import Reference, make_plan, qwen_params, trainer_local

torch = pytest.importorskip("torch")

from wsync.engines import vllm_shard  # noqa: E402
from wsync.errors import MismatchError, WsyncError  # noqa: E402
from wsync.shard.sync import ShardPublisher  # noqa: E402

HF = {"hidden_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12}
TRAINER = {"ranks": 2, "placements": "fsdp"}
PACKED = ("qkv_proj", "gate_up_proj")


def params_doc() -> dict:
    return {n: [list(p.shape), p.dtype] for n, p in qwen_params().items()}


def test_the_workers_plan_is_the_trainers():
    assert vllm_shard.build_plan(params_doc(), TRAINER, HF, 2).hash == make_plan(2, 2, "vllm").hash
    explicit = {"ranks": 2, "placements": {n: ["shard", 0] for n in params_doc()}}
    assert vllm_shard.build_plan(params_doc(), explicit, HF, 2).hash == make_plan(2, 2, "vllm").hash


@pytest.mark.parametrize("params,trainer,match", [
    ([], TRAINER, "must be a dict"),
    ({}, TRAINER, "must be a dict"),
    ({"w": [[-1, 2], "bfloat16"]}, TRAINER, "shape"),
    ({"w": [[2, 2], 7]}, TRAINER, "dtype"),
    ({"w": [[2, 2]]}, TRAINER, r"\[shape"),
    ({"w": [[2**40], "bfloat16"]}, {"ranks": 0}, "ranks"),
    ({"w": [[4], "bfloat16"]}, {"ranks": 2, "placements": 3}, "placements"),
])
def test_bad_documents_are_refused_before_anything_is_built(params, trainer, match):
    with pytest.raises(WsyncError, match=match):
        vllm_shard.build_plan(params, trainer, HF, 2)


class _Packing:
    """A quant method doing what vLLM's CPU backend does to a linear layer: pack a copy, empty the weight."""

    def process_weights_after_loading(self, layer):
        packed = layer.weight.detach().clone()
        layer.packs = getattr(layer, "packs", 0) + 1
        layer.cpu_linear = lambda x, w, b, _p=packed: torch.nn.functional.linear(x, _p, b)
        layer.weight = torch.nn.Parameter(torch.empty(0, dtype=packed.dtype), requires_grad=False)


def vllm_like(plan, rank: int):
    """A module tree with engine rank `rank`'s names; qkv_proj / gate_up_proj prepacked from a random weight."""
    root = torch.nn.Module()
    for (r, name), p in plan.engine.locals.items():
        if r != rank:
            continue
        mod = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(torch.randn(p.shape).to(torch.bfloat16), requires_grad=False))
        if path[-1] in PACKED:
            mod.output_size_per_partition, mod.input_size_per_partition = p.shape
            mod.quant_method = _Packing()
            mod.quant_method.process_weights_after_loading(mod)
            mod.packs = 0
    return root


def engine_rank(rank: int, coordinator: str, cmds, out) -> None:
    plan = make_plan(2, 2, "vllm")
    model = vllm_like(plan, rank)
    w = vllm_shard.ShardedWorker(model, plan, rank, coordinator=coordinator, token=TOKEN)
    out.put(("up", rank, None))
    while (cmd := cmds.get()) is not None:
        what, v = cmd
        if what == "wait_committed":
            w.sub.wait_for(v, timeout=60)
            out.put(("committed", rank, (w.status(), w.digests())))
        elif what == "update":
            served = w.update(v, timeout=60)
            packs = {n: m.packs for n, m in model.named_modules() if hasattr(m, "packs")}
            # what the packed layers compute with, read back through their cpu_linear
            eye = torch.eye(48, dtype=torch.bfloat16)
            used = {n: vllm_shard.tensor_digest(m.cpu_linear(eye, None, None).t().contiguous())
                    for n, m in model.named_modules() if hasattr(m, "cpu_linear") and n.endswith("qkv_proj")}
            out.put(("served", rank, (served, w.digests(), packs, used)))
    w.close()


def expected(plan, rank: int, state: dict) -> dict:
    out = {name: torch.zeros(p.shape, dtype=torch.bfloat16) for (r, name), p in plan.engine.locals.items()
           if r == rank}
    for n in plan.engine.needs:
        if n.rank == rank:
            out[n.name][tuple(slice(a, b) for a, b in n.dst)] = \
                state[n.src_name][tuple(slice(a, b) for a, b in n.src)].reshape([b - a for a, b in n.dst])
    return out


def test_committed_versions_are_served_only_on_update():
    plan, ref = make_plan(2, 2, "vllm"), Reference(qwen_params())
    pubs = [ShardPublisher(plan, 0, coordinator="tcp://127.0.0.1:0", host_coordinator=True, token=TOKEN)]
    pubs.append(ShardPublisher(plan, 1, coordinator=pubs[0].coordinator_address, token=TOKEN))
    ctx = mp.get_context("spawn")
    cmds, out = [ctx.Queue(), ctx.Queue()], ctx.Queue()
    procs = [ctx.Process(target=engine_rank, args=(r, pubs[0].coordinator_address, cmds[r], out), daemon=True)
             for r in range(2)]
    try:
        for p in procs:
            p.start()
        assert sorted(out.get(timeout=120)[:2] for _ in procs) == [("up", 0), ("up", 1)]

        def ask(what, v):
            for q in cmds:
                q.put((what, v))
            got = dict(out.get(timeout=120)[1:] for _ in procs)
            return [got[0], got[1]]

        served_digests = None
        for v in range(3):
            state = ref.torch_state(v)
            for t, pub in enumerate(pubs):
                pub.publish(trainer_local(plan, t, state), v)
            res = pubs[0].wait(v, timeout=60)
            assert res["outcome"] == "committed" and res["digest"] == res["expected"], res
            committed = ask("wait_committed", v)
            for status, digests in committed:
                assert status["committed"] == v and status["served"] == (None if v == 0 else v - 1)
                if served_digests is not None:  # committed, not served: the previous version's bytes
                    assert digests == served_digests[status["rank"]]
            served = ask("update", v)
            served_digests = []
            for rank, (version, digests, packs, used) in enumerate(served):
                want = {k: vllm_shard.tensor_digest(t) for k, t in expected(plan, rank, state).items()}
                assert version == v and digests == want, (v, rank)
                assert set(packs.values()) == {v + 1}, packs  # every prepacked layer packed once per version
                for name, d in used.items():  # the packed copy the layer computes with is the new weight
                    assert d == want[name + ".weight"], name
                served_digests.append(digests)
        assert ask("update", 2)[0][2] == served[0][2]  # the same version again: nothing re-packed
    finally:
        for q in cmds:
            q.put(None)
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        for pub in reversed(pubs):
            pub.close()


def test_a_module_that_does_not_match_the_plan_is_refused():
    plan = make_plan(2, 2, "vllm")
    model = vllm_like(plan, 0)
    attn = model.get_submodule("model.layers.0.self_attn")
    attn.o_proj.weight = torch.nn.Parameter(torch.zeros(3, 3, dtype=torch.bfloat16))
    with pytest.raises(MismatchError, match="o_proj.weight is torch.bfloat16\\[3, 3\\]"):
        vllm_shard.ShardedWorker(model, plan, 0, coordinator="tcp://127.0.0.1:9", token=TOKEN)
    model = vllm_like(plan, 0)
    attn = model.get_submodule("model.layers.0.self_attn")
    attn.qkv_proj.output_size_per_partition = 7
    with pytest.raises(MismatchError, match="prepacked"):
        vllm_shard.ShardedWorker(model, plan, 0, coordinator="tcp://127.0.0.1:9", token=TOKEN)
    del attn.qkv_proj
    with pytest.raises(MismatchError, match="no parameter"):
        vllm_shard.ShardedWorker(model, plan, 0, coordinator="tcp://127.0.0.1:9", token=TOKEN)
