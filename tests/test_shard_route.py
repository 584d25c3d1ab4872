"""Layouts and the routing plan: executing a plan on random arrays rebuilds every engine rank's tensors byte for byte.

The expected engine tensors are built here independently, by slicing and
concatenating the unsharded reference the way each engine does (torch's own
Shard._split_tensor for HF tensor parallelism, vLLM's fusion and padding
spelled out), never from the layouts under test.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import free_port

from wsync.dtypes import from_torch
from wsync.shard.conventions import (QWEN3_TP_PLAN, VllmConfig, chunk, fsdp_placements, hf_tp_layout, replicas,
                                     tp_placements, trainer_layout_for, vllm_layout)
from wsync.shard.layout import Param, TrainerLayout, box_shape
from wsync.shard.route import route

H, I, V, NH, NKV, HD, E, IE = 16, 24, 100, 4, 2, 4, 5, 6  # vocab 100 pads to 128 in vLLM; 5 experts split 3 + 2
CFG = VllmConfig(num_heads=NH, num_kv_heads=NKV, head_dim=HD)


def qwen3(moe: str = "", layers: int = 2) -> dict[str, Param]:
    """A tiny Qwen3 (moe="": dense; "per-expert" or "fused": Qwen3-MoE, experts named one by one or stacked)."""
    s = {"model.embed_tokens.weight": (V, H)}
    for li in range(layers):
        p = f"model.layers.{li}"
        s.update({f"{p}.self_attn.q_proj.weight": (NH * HD, H), f"{p}.self_attn.k_proj.weight": (NKV * HD, H),
                  f"{p}.self_attn.v_proj.weight": (NKV * HD, H), f"{p}.self_attn.o_proj.weight": (H, NH * HD),
                  f"{p}.self_attn.q_norm.weight": (HD,), f"{p}.self_attn.k_norm.weight": (HD,),
                  f"{p}.input_layernorm.weight": (H,), f"{p}.post_attention_layernorm.weight": (H,)})
        if not moe:
            s.update({f"{p}.mlp.gate_proj.weight": (I, H), f"{p}.mlp.up_proj.weight": (I, H),
                      f"{p}.mlp.down_proj.weight": (H, I)})
        elif moe == "fused":
            s.update({f"{p}.mlp.experts.gate_up_proj": (E, 2 * IE, H), f"{p}.mlp.experts.down_proj": (E, H, IE)})
        else:
            for e in range(E):
                s.update({f"{p}.mlp.experts.{e}.{w}_proj.weight": (IE, H) for w in ("gate", "up")})
                s[f"{p}.mlp.experts.{e}.down_proj.weight"] = (H, IE)
        if moe:
            s[f"{p}.mlp.gate.weight"] = (E, H)
    s.update({"model.norm.weight": (H,), "lm_head.weight": (V, H)})
    out = {n: Param(shape, "bfloat16") for n, shape in s.items()}
    if moe:
        out["model.layers.0.mlp.gate.e_score_correction_bias"] = Param((E,), "float32")  # another item size
    return out


def reference(params, seed=0, ones=False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for n, p in params.items():
        dt = from_torch(p.dtype).bits_dtype
        out[n] = np.ones(p.shape, dt) if ones else rng.integers(0, np.iinfo(dt).max, size=p.shape, dtype=dt)
    return out


def execute(plan, g):
    """Run the plan with numpy: trainer ranks hold copies of their boxes, pieces are copied into engine tensors."""
    sl = lambda box: tuple(slice(a, b) for a, b in box)  # noqa: E731
    held = {(h.rank, h.name): np.ascontiguousarray(g[h.name][sl(h.box)]) for h in plan.trainer.held}
    eng = {k: np.zeros(p.shape, from_torch(p.dtype).bits_dtype) for k, p in plan.engine.locals.items()}
    cover = {k: np.zeros(p.shape, np.int32) for k, p in plan.engine.locals.items()}
    for r in range(plan.engine.ranks):
        for pc in plan.for_engine(r):
            data = held[(pc.src_rank, pc.src_name)][sl(pc.local)]
            assert data.shape == box_shape(pc.src)
            eng[(r, pc.dst_name)][sl(pc.dst)] = data.reshape(box_shape(pc.dst))
            cover[(r, pc.dst_name)][sl(pc.dst)] += 1
    return eng, cover


def torch_split(a: np.ndarray, dim: int, tp: int, r: int) -> np.ndarray:
    """torch's own uneven split (Shard(dim)._split_tensor), trailing shards possibly empty."""
    import torch
    from torch.distributed.tensor import Shard

    signed = a.view({1: np.int8, 2: np.int16, 4: np.int32}[a.itemsize])  # torch has no uint16 arithmetic to trip on
    shards, _ = Shard(dim)._split_tensor(torch.from_numpy(signed), tp, with_padding=False)
    return shards[r].numpy().view(a.dtype)


def expected_hf(g, params, tp, pad=1):
    specs = tp_placements(params, QWEN3_TP_PLAN)
    out = {}
    for r in range(tp):
        for n, a in g.items():
            if pad > 1 and ("embed_tokens" in n or "lm_head" in n):
                vp = -(-a.shape[0] // pad) * pad
                padded = np.concatenate([a, np.zeros((vp - a.shape[0], *a.shape[1:]), a.dtype)])
                out[(r, n)] = torch_split(padded, 0, tp, r)
            elif specs[n][0] == "shard":
                out[(r, n)] = torch_split(a, specs[n][1], tp, r)
            else:
                out[(r, n)] = a
    return out


def expected_vllm(g, tp, ep=True):
    out, q_l, kv_l = {}, NH // tp * HD, max(1, NKV // tp) * HD
    reps = max(1, tp // NKV)
    rows = lambda a, n, i: a[i * n:(i + 1) * n]  # noqa: E731
    base, rem = divmod(E, tp)
    for r in range(tp):
        first, n_e = r * base + min(r, rem), base + (r < rem)
        mine = range(first, first + n_e) if ep else range(E)
        i0, il = (0, IE) if ep else (r * IE // tp, IE // tp)
        for n, a in g.items():
            pre, _, leaf = n.rpartition(".")
            if n.endswith(("k_proj.weight", "v_proj.weight", "up_proj.weight", "experts.down_proj")) or \
                    (".experts." in n and n.split(".experts.")[1][0].isdigit() and not n.endswith("gate_proj.weight")):
                continue  # taken with its partner below
            if n.endswith("q_proj.weight"):
                p = n[: -len("q_proj.weight")]
                out[(r, p + "qkv_proj.weight")] = np.concatenate(
                    [rows(a, q_l, r), rows(g[p + "k_proj.weight"], kv_l, r // reps), rows(g[p + "v_proj.weight"],
                                                                                          kv_l, r // reps)])
            elif n.endswith("mlp.gate_proj.weight") and ".experts." not in n:
                p = n[: -len("gate_proj.weight")]
                out[(r, p + "gate_up_proj.weight")] = np.concatenate(
                    [rows(a, I // tp, r), rows(g[p + "up_proj.weight"], I // tp, r)])
            elif n.endswith(("o_proj.weight", "down_proj.weight")):
                out[(r, n)] = a[:, r * a.shape[1] // tp:(r + 1) * a.shape[1] // tp]
            elif n.endswith(("embed_tokens.weight", "lm_head.weight")):
                per = -(-V // 64) * 64 // tp
                padded = np.concatenate([a, np.zeros((-(-V // 64) * 64 - V, H), a.dtype)])
                out[(r, n)] = rows(padded, per, r)
            elif n.endswith("experts.gate_up_proj"):
                p = n[: -len("gate_up_proj")] + "routed_experts."
                w13 = np.concatenate([a[:, i0:i0 + il], a[:, IE + i0:IE + i0 + il]], axis=1)
                out[(r, p + "w13_weight")] = w13[list(mine)]
                out[(r, p + "w2_weight")] = g[n.replace("gate_up_proj", "down_proj")][list(mine)][:, :, i0:i0 + il]
            elif ".experts." in n:  # experts.{e}.gate_proj.weight, e == 0 builds the layer's tensors
                p, e = n.split(".experts.")[0] + ".experts.", int(n.split(".experts.")[1].split(".")[0])
                if e == 0:
                    w = lambda k, ex: g[f"{p}{ex}.{k}_proj.weight"]  # noqa: E731
                    out[(r, p + "routed_experts.w13_weight")] = np.stack(
                        [np.concatenate([w("gate", x)[i0:i0 + il], w("up", x)[i0:i0 + il]]) for x in mine]
                    ).reshape(len(mine), 2 * il, H)
                    out[(r, p + "routed_experts.w2_weight")] = np.stack(
                        [w("down", x)[:, i0:i0 + il] for x in mine]).reshape(len(mine), H, il)
            else:
                out[(r, n)] = a
    return out


def check_plan(plan, expected_fn):
    g = reference(plan.trainer.params)
    eng, cover = execute(plan, g)
    want, mask = expected_fn(g), expected_fn(reference(plan.trainer.params, ones=True))
    assert sorted(eng) == sorted(want)
    for k in want:
        assert eng[k].shape == want[k].shape, k
        assert np.array_equal(eng[k], want[k]), k  # byte for byte (uint views of the dtype's bits)
        assert np.array_equal(cover[k], mask[k].astype(np.int32)), k  # every element once, padding never


TRAINERS = {
    "fsdp2": lambda p: trainer_layout_for(p, fsdp_placements(p), 2),
    "fsdp4": lambda p: trainer_layout_for(p, fsdp_placements(p), 4),
    "hsdp2x2": lambda p: trainer_layout_for(p, fsdp_placements(p, replicas=2), 4, mesh=(2, 2)),
    "tp3": lambda p: trainer_layout_for(p, tp_placements(p, QWEN3_TP_PLAN), 3),
}


@pytest.mark.parametrize("trainer", sorted(TRAINERS))
@pytest.mark.parametrize("engine, tp", [("hf", 2), ("hf", 3), ("hf-pad", 3), ("vllm", 2), ("vllm", 4)])
def test_dense_plans_rebuild_every_engine_rank(trainer, engine, tp):
    params = qwen3()
    if engine == "vllm":
        layout, fn = vllm_layout(params, tp, CFG), lambda g: expected_vllm(g, tp)  # tp=4: kv heads replicated
    else:
        pad = 64 if engine == "hf-pad" else 1
        layout, fn = hf_tp_layout(params, tp, vocab_pad_to=pad), lambda g: expected_hf(g, params, tp, pad)
    check_plan(route(TRAINERS[trainer](params), layout), fn)


@pytest.mark.parametrize("moe", ["per-expert", "fused"])
@pytest.mark.parametrize("ep", [True, False])
@pytest.mark.parametrize("trainer", ["fsdp2", "fsdp4"])
def test_moe_experts(moe, ep, trainer):
    import dataclasses

    params = qwen3(moe)
    layout = vllm_layout(params, 2, dataclasses.replace(CFG, expert_parallel=ep))
    w13 = {r: layout.locals[(r, "model.layers.0.mlp.experts.routed_experts.w13_weight")].shape for r in (0, 1)}
    assert w13 == ({0: (3, 2 * IE, H), 1: (2, 2 * IE, H)} if ep else {0: (E, IE, H), 1: (E, IE, H)})
    check_plan(route(TRAINERS[trainer](params), layout), lambda g: expected_vllm(g, 2, ep))


def test_vocab_padding_is_the_engines_own():
    params = qwen3()
    layout = vllm_layout(params, 2, CFG)
    assert layout.locals[(1, "lm_head.weight")].shape == (64, H)  # 100 -> 128 rows, 64 per rank
    needs = [n for n in layout.needs if n.name == "lm_head.weight"]
    assert sorted((n.rank, n.src, n.dst) for n in needs) == [
        (0, ((0, 64), (0, H)), ((0, 64), (0, H))), (1, ((64, 100), (0, H)), ((0, 36), (0, H)))]


def test_balance_4_to_2_and_between_replicas():
    params = qwen3()
    plan = route(TRAINERS["fsdp4"](params), vllm_layout(params, 2, CFG))
    total = sum(plan.bytes_by_trainer())
    assert total == sum(plan.bytes_by_engine())
    assert max(plan.bytes_by_trainer()) <= total / min(4, 2) * 1.1
    # (engine ranks receive what their layout needs, routing cannot move it: here rank 0 has 64 of 100 vocab rows)
    # two replicas of two FSDP shards: each byte has two holders, and the greedy split evens them out
    hsdp = route(TRAINERS["hsdp2x2"](params), vllm_layout(params, 2, CFG))
    assert max(hsdp.bytes_by_trainer()) <= sum(hsdp.bytes_by_trainer()) / 4 * 1.1
    assert "busiest" in plan.describe() and plan.hash[:16] in plan.describe()


def test_trainer_pieces_stay_inside_what_the_rank_holds():
    params = qwen3("per-expert")
    plan = route(TRAINERS["fsdp4"](params), vllm_layout(params, 2, CFG))
    held = {(h.rank, h.name): h.box for h in plan.trainer.held}
    for r in range(4):
        sends = plan.sends(r)
        assert [p for ps in sends.values() for p in ps] == list(plan.for_trainer(r))
        for p in plan.for_trainer(r):
            box = held[(r, p.src_name)]
            assert all(h0 <= a < b <= h1 for (a, b), (h0, h1) in zip(p.src, box))
            assert p.local == tuple((a - h0, b - h0) for (a, b), (h0, _) in zip(p.src, box))


PLAN_HASH = """
import sys
sys.path.insert(0, '.')
from test_shard_route import TRAINERS, qwen3, CFG
from wsync.shard.conventions import vllm_layout
from wsync.shard.route import route
p = qwen3("per-expert")
print(route(TRAINERS["fsdp4"](p), vllm_layout(p, 2, CFG)).hash)
"""


def test_deterministic_in_process_and_across_processes():
    from wsync.shard import route as route_mod

    params = qwen3("per-expert")
    a = route(TRAINERS["fsdp4"](params), vllm_layout(params, 2, CFG))
    assert route(TRAINERS["fsdp4"](params), vllm_layout(params, 2, CFG)) is a  # memoized by content
    route_mod._CACHE.clear()
    b = route(TRAINERS["fsdp4"](params), vllm_layout(params, 2, CFG))
    assert b is not a and b.hash == a.hash and b.pieces == a.pieces
    r = subprocess.run([sys.executable, "-c", PLAN_HASH], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONHASHSEED": "123"}, cwd=str(Path(__file__).parent))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == a.hash


def test_uncovered_need_names_the_box():
    params = qwen3()
    t = TRAINERS["fsdp2"](params)
    name = "model.layers.1.mlp.down_proj.weight"
    holes = TrainerLayout(ranks=2, params=t.params, held=tuple(h for h in t.held if (h.rank, h.name) != (1, name)))
    with pytest.raises(ValueError, match=r"down_proj.*no trainer rank holds box \(\(8, 16\), \(0, 12\)\)"):
        route(holes, vllm_layout(params, 2, CFG))


@pytest.mark.parametrize("tp, cfg, match", [
    (3, CFG, "num_attention_heads = 4"),
    (8, CFG, "num_attention_heads"),
    (3, VllmConfig(num_heads=6, num_kv_heads=4, head_dim=4), "num_key_value_heads = 4"),
    (0, CFG, ">= 1"),
    (8, VllmConfig(num_heads=8, num_kv_heads=8, head_dim=2, vocab_pad_to=1), "padded vocabulary = 100"),
])
def test_vllm_rejects_what_vllm_rejects(tp, cfg, match):
    params = {"lm_head.weight": Param((V, H), "bfloat16")}
    with pytest.raises(ValueError, match=match):
        vllm_layout(params, tp, cfg)


def test_engine_replicas_are_independent_copies():
    params = qwen3()
    two = replicas(vllm_layout(params, 2, CFG), 2)
    plan = route(TRAINERS["fsdp4"](params), two)
    check_plan(plan, lambda g: {(c * 2 + r, n): a for c in range(2)
                                for (r, n), a in expected_vllm(g, 2).items()})


@pytest.mark.parametrize("shape, mesh, spec", [
    ((8, 5), (3,), ("shard", 0)), ((2, 4), (3,), ("shard", 0)), ((7,), (4,), ("shard", 0)), ((5, 9), (3,), ("shard", 1)),
    ((0, 3), (2,), ("shard", 0)), ((4, 4), (3,), ("replicate",)), ((), (2,), ("replicate",)),
    ((10, 6), (2, 3), (("replicate",), ("shard", 0))), ((10, 6), (2, 3), (("shard", 0), ("shard", 1))),
    ((10, 6), (2, 3), (("shard", 0), ("shard", 0))), ((5, 7), (3, 2), (("shard", 1), ("shard", 1))),
    ((3, 7), (2, 2), (("shard", -1), ("replicate",))),
])
def test_trainer_boxes_are_torchs(shape, mesh, spec):
    """Every rank's box against torch's own arithmetic for each mesh coordinate, uneven and empty shards included."""
    torch = pytest.importorskip("torch")
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from wsync.shard.conventions import coordinate

    params = {"w": Param(shape, "bfloat16")}
    ranks = int(np.prod(mesh))
    layout = trainer_layout_for(params, {"w": spec}, ranks, mesh=mesh)
    one = (spec,) if isinstance(spec[0], str) else spec
    placements = [Shard(p[1]) if p[0] == "shard" else Replicate() for p in one]
    for h in layout.held:
        local, offset = _compute_local_shape_and_global_offset(torch.Size(shape), mesh, list(coordinate(h.rank, mesh)),
                                                               placements)
        assert h.box == tuple((o, o + n) for o, n in zip(offset, local)), (h.rank, h.box, local, offset)


def test_chunk_is_torch_chunk():
    torch = pytest.importorskip("torch")
    for size in range(0, 12):
        for parts in range(1, 6):
            got = [chunk(size, parts, i) for i in range(parts)]
            real = [len(c) for c in torch.arange(size).chunk(parts)] + [0] * parts
            assert [b - a for a, b in got] == real[:parts], (size, parts)


def _dtensor_rank(rank: int, port: int, out: str) -> None:
    """One of 3 gloo ranks: uneven Shard(0) by distribute_tensor and by FSDP2's fully_shard, read back."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from wsync.shard.conventions import held_from_dtensors, trainer_layout_from_dtensors

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    try:
        mesh = init_device_mesh("cpu", (3,))
        torch.manual_seed(0)
        full = {"a": torch.randn(8, 5), "b": torch.randn(2, 4), "c": torch.randn(7), "d": torch.randn(3, 3)}
        named = {n: distribute_tensor(t, mesh, [Replicate() if n == "d" else Shard(0)]) for n, t in full.items()}
        model = torch.nn.Sequential(torch.nn.Embedding(7, 4), torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        fully_shard(model, mesh=mesh)
        named.update({f"m.{n}": p for n, p in model.named_parameters()})
        shapes = {n: list(t.shape) for n, t in named.items()}
        _, held = held_from_dtensors(named, rank)
        layout = trainer_layout_from_dtensors(named)
        same = all(torch.equal(named[h.name].to_local(), named[h.name].full_tensor()[tuple(slice(a, b) for a, b in h.box)])
                   for h in held)
        doc = {"held": [[h.name, [list(x) for x in h.box]] for h in held], "shapes": shapes, "same": same,
               "layout_ranks": layout.ranks}
        Path(out).write_text(json.dumps(doc))
        # every rank past its last collective before any tears the group down: a rank that closed its
        # links while a peer was still reading the last all-gather aborted that peer (SIGABRT, CI)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # three processes import torch and form a gloo group
def test_held_from_real_dtensors_on_three_gloo_ranks(tmp_path):
    pytest.importorskip("torch")
    ctx, port = mp.get_context("spawn"), free_port()
    procs = [ctx.Process(target=_dtensor_rank, args=(r, port, str(tmp_path / f"{r}.json"))) for r in range(3)]
    [p.start() for p in procs]
    try:
        [p.join(timeout=180) for p in procs]
        assert [p.exitcode for p in procs] == [0, 0, 0]
    finally:
        [p.kill() for p in procs if p.is_alive()]
    docs = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    shapes = docs[0]["shapes"]
    params = {n: Param(tuple(s), "float32") for n, s in shapes.items()}
    spec = {n: ("replicate",) if n == "d" else ("shard", 0) for n in params}
    want = trainer_layout_for(params, spec, 3)
    for r, doc in enumerate(docs):
        assert doc["same"] and doc["layout_ranks"] == 3
        got = {n: tuple(tuple(x) for x in box) for n, box in doc["held"]}
        assert got == {h.name: h.box for h in want.held if h.rank == r}
    assert {n: box for n, box in docs[2]["held"]}["m.2.weight"] == [[2, 2], [0, 8]]  # 2 rows over 3 ranks: 1, 1, 0
