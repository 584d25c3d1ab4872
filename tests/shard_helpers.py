"""Helpers for the sharded sync tests: a tiny Qwen3-like state, FSDP and TP layouts of it, a versioned reference,
and the engine-rank worker process.

The layouts come from wsync.shard.conventions (FSDP2's Shard(0) with torch's uneven chunks on the trainer
side; vLLM's fused, padded layout or torch TP's uneven one on the engine side), routed by wsync.shard.route.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time

import numpy as np
from wsync.shard.layout import Param, box_numel

from helpers import TOKEN

DT = "bfloat16"


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
    (rank, event, version served, ok, event's version); also a "received" event once every trainer rank's
    last bucket of a version has arrived. hooks: die_at / stall_at = (version, trainer rank) and
    corrupt_at = version, the faults the tests inject; stall_s: how long a stall lasts."""
    import threading

    import torch

    from wsync.shard.sync import ShardSubscriber

    plan = make_plan(spec["m"], spec["n"], spec["engine"], **spec.get("dims", {}))
    ref = Reference(qwen_params(**spec.get("dims", {})))
    tensors = {name: torch.zeros(p.shape, dtype=torch.bfloat16) for (r, name), p in plan.engine.locals.items()
               if r == rank}

    sources = {p.src_rank for p in plan.for_engine(rank)}
    arrived, arrived_lock = {}, threading.Lock()  # version -> the trainer ranks whose last bucket of it arrived

    def progress(src, version, bucket, buckets, nbytes):
        if hooks.get("die_at") == (version, src):
            os.kill(os.getpid(), signal.SIGKILL)  # after this rank received a bucket of the version, never ready
        if hooks.get("stall_at") == (version, src) and bucket == 1:
            time.sleep(hooks.get("stall_s", 6.0))
        if bucket == buckets:
            with arrived_lock:
                arrived.setdefault(version, set()).add(src)
                if arrived[version] == sources:
                    out.put((rank, "received", None, True, version))

    sub = ShardSubscriber(plan, rank, tensors, coordinator=coordinator, token=TOKEN, progress=progress)
    while sub.stage is None:
        time.sleep(0.02)
    if "corrupt_at" in hooks:
        _corrupt_staging(sub, hooks["corrupt_at"])
    out.put((rank, "joined", None, True, None))
    report_outcomes(sub, rank, out, lambda version: all(
        np.array_equal(tensors[name].view(torch.uint16).numpy(), want)
        for name, want in engine_expected(plan, rank, ref.at(version)).items()))


def report_outcomes(sub, rank: int, out, check) -> None:
    """Forever: each round outcome `sub` records, posted to `out` as (rank, event, version served, ok, event's
    version), ok being check(version served) under the rank's lock (True while it serves none)."""
    seen = 0
    while True:
        sub.wait_outcome(seen, timeout=1.0)
        with sub.lock:
            events, version = list(sub.events), sub.version
            if len(events) > seen:
                ok = version is None or check(version)
        for ev in events[seen:]:
            out.put((rank, ev[0], version, ok, ev[1]))
        seen = len(events)


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


# -- the headline: FSDP2 trainer processes -> torch tensor-parallel engine processes (gloo, CPU) ----------------

TP_PLAN = {"model.embed_tokens": "RowwiseParallel", "model.layers.*.self_attn.q_proj": "ColwiseParallel",
           "model.layers.*.self_attn.k_proj": "ColwiseParallel", "model.layers.*.self_attn.v_proj": "ColwiseParallel",
           "model.layers.*.self_attn.o_proj": "RowwiseParallel", "model.layers.*.mlp.gate_proj": "ColwiseParallel",
           "model.layers.*.mlp.up_proj": "ColwiseParallel", "model.layers.*.mlp.down_proj": "RowwiseParallel",
           "lm_head": "ColwiseParallel"}


def tiny_qwen3():
    """A transformers Qwen3 whose sizes split unevenly over 3 and 4 ranks (vocab 250, intermediate 100)."""
    import torch
    import transformers

    cfg = transformers.Qwen3Config(vocab_size=250, hidden_size=48, intermediate_size=100, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=3, head_dim=8,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16)


# Qwen3-MoE as transformers 5 stores it: experts fused into 3-D gate_up_proj [E, 2I, H] / down_proj [E, H, I].
# 5 experts: FSDP2 over 2 trainer ranks holds experts 0-2 and 3-4 (Shard(0), torch's uneven chunks), and so does
# vLLM's expert parallelism over 2 engine ranks ("linear": the first E % tp ranks take one more); the experts of
# the two sides line up, the q/k/v, vocabulary and norm slices do not.
MOE = {"vocab": 250, "hidden": 32, "inter": 64, "moe_inter": 24, "experts": 5, "layers": 2, "heads": 4,
       "kv_heads": 2, "head_dim": 8}


def qwen3_moe_params(d: dict = MOE) -> dict[str, Param]:
    """The parameter names and shapes of tiny_qwen3_moe(), known to the engine without importing transformers."""
    h, e, i = d["hidden"], d["experts"], d["moe_inter"]
    p = {"model.embed_tokens.weight": (d["vocab"], h)}
    for layer in range(d["layers"]):
        pre = f"model.layers.{layer}."
        p |= {pre + "self_attn.q_proj.weight": (d["heads"] * d["head_dim"], h),
              pre + "self_attn.k_proj.weight": (d["kv_heads"] * d["head_dim"], h),
              pre + "self_attn.v_proj.weight": (d["kv_heads"] * d["head_dim"], h),
              pre + "self_attn.o_proj.weight": (h, d["heads"] * d["head_dim"]),
              pre + "self_attn.q_norm.weight": (d["head_dim"],), pre + "self_attn.k_norm.weight": (d["head_dim"],),
              pre + "mlp.experts.gate_up_proj": (e, 2 * i, h), pre + "mlp.experts.down_proj": (e, h, i),
              pre + "mlp.gate.weight": (e, h),
              pre + "input_layernorm.weight": (h,), pre + "post_attention_layernorm.weight": (h,)}
    p |= {"model.norm.weight": (h,), "lm_head.weight": (d["vocab"], h)}
    return {n: Param(tuple(s), DT) for n, s in p.items()}


def tiny_qwen3_moe():
    """A transformers Qwen3-MoE (every layer sparse, 5 experts, 2 per token) of qwen3_moe_params()' shapes."""
    import torch
    import transformers

    d = MOE
    cfg = transformers.Qwen3MoeConfig(vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"],
                                      moe_intermediate_size=d["moe_inter"], num_experts=d["experts"],
                                      num_experts_per_tok=2, num_hidden_layers=d["layers"],
                                      num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"],
                                      head_dim=d["head_dim"], decoder_sparse_step=1, mlp_only_layers=[],
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    got = {name: Param(tuple(p.shape), DT) for name, p in model.named_parameters()}
    assert got == qwen3_moe_params(), "transformers' Qwen3-MoE names or shapes changed; update qwen3_moe_params"
    return model


def moe_plan(m: int, n: int):
    """FSDP2 over m trainer ranks -> vLLM over n ranks with expert parallelism (experts by index into w13 / w2,
    fused qkv, vocabulary padded to 64), from the shapes alone."""
    from wsync.shard.conventions import VllmConfig, fsdp_placements, trainer_layout_for, vllm_layout
    from wsync.shard.route import route

    params = qwen3_moe_params()
    cfg = VllmConfig(num_heads=MOE["heads"], num_kv_heads=MOE["kv_heads"], head_dim=MOE["head_dim"],
                     expert_parallel=True)
    return route(trainer_layout_for(params, fsdp_placements(params), m), vllm_layout(params, n, cfg))


def _plan_from_shapes(model, m: int, n: int):
    """What every rank computes on its own from the parameter shapes: FSDP2 over m, torch TP over n."""
    from wsync.shard.conventions import fsdp_placements, hf_tp_layout, trainer_layout_for
    from wsync.shard.route import route

    params = {name: Param(tuple(p.shape), "bfloat16") for name, p in model.named_parameters()}
    return route(trainer_layout_for(params, fsdp_placements(params), m), hf_tp_layout(params, n))


def fsdp_trainer(rank: int, m: int, n: int, ports: tuple, tmp: str, out, versions: int, moe: bool = False,
                 quant: str | None = None) -> None:
    """A trainer rank: FSDP2 over m gloo ranks, AdamW steps; its layout read from its own DTensors.
    moe: train tiny_qwen3_moe() for the vLLM expert-parallel plan (moe_plan) instead of tiny_qwen3() for torch TP.
    quant: a quantizer_for kind: ShardPublisher(quantize=q) on quant_plan's plan, handed the DTensors as they are."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from wsync.shard.conventions import trainer_layout_from_dtensors
    from wsync.shard.sync import ShardPublisher

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=m)
    model = tiny_qwen3_moe() if moe else tiny_qwen3()
    if quant:
        trainer, plan = quant_plan(m, n, quant, params={name: Param(tuple(p.shape), DT)
                                                        for name, p in model.named_parameters()})
    else:
        plan = moe_plan(m, n) if moe else _plan_from_shapes(model, m, n)
        trainer = plan.trainer
    vocab = model.config.vocab_size
    mesh = init_device_mesh("cpu", (m,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    named = dict(model.named_parameters())
    assert trainer_layout_from_dtensors(named) == trainer  # what torch did is what every rank assumed
    pub = ShardPublisher(plan, rank, coordinator=f"tcp://127.0.0.1:{ports[2]}", host_coordinator=rank == 0,
                         token=TOKEN, quantize=quantizer_for(quant) if quant else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    for v in range(versions):
        if v:
            ids = torch.randint(0, vocab, (2, 12), generator=gen)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        full = {name: p.full_tensor() for name, p in named.items()}  # the test's reference only: a collective
        if rank == 0:
            np.savez(os.path.join(tmp, f"ref{v}.npz"), **{k: t.view(torch.uint16).numpy() for k, t in full.items()})
        dist.barrier()
        pub.publish(named if quant else {name: p.to_local() for name, p in named.items()}, v)
        res = pub.wait(v, timeout=120)
        out.put(("trainer", rank, v, res["outcome"] == "committed" and res["digest"] == res["expected"]))
        deadline = time.monotonic() + 120
        while rank == 0 and len([f for f in os.listdir(tmp) if f.startswith(f"checked{v}-")]) < n:
            assert time.monotonic() < deadline, f"engine ranks did not check version {v}"
            time.sleep(0.02)  # every engine rank compared version v before the next step changes the weights
        dist.barrier()
    pub.close()
    dist.destroy_process_group()


def tp_engine(rank: int, m: int, n: int, ports: tuple, tmp: str, out, versions: int) -> None:
    """An engine rank: the same model under torch tensor parallelism over n gloo ranks, written in place."""
    import torch
    import torch.distributed as dist
    import torch.distributed.tensor.parallel as tp
    from torch.distributed.device_mesh import init_device_mesh

    from wsync.shard.sync import ShardSubscriber
    from wsync.shard.tensors import local_of

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[1]}", rank=rank, world_size=n)
    model = tiny_qwen3()
    plan = _plan_from_shapes(model, m, n)
    tp.parallelize_module(model, init_device_mesh("cpu", (n,)), {k: getattr(tp, s)() for k, s in TP_PLAN.items()})
    named = dict(model.named_parameters())
    sub = ShardSubscriber(plan, rank, named, coordinator=f"tcp://127.0.0.1:{ports[2]}", token=TOKEN)
    for v in range(versions):
        sub.wait_for(v, timeout=120)
        with sub.lock:
            ref = np.load(os.path.join(tmp, f"ref{sub.version}.npz"))
            want = engine_expected(plan, rank, {k: ref[k] for k in ref.files})
            ok = sub.version == v and all(np.array_equal(local_of(named[k]).view(torch.uint16).numpy(), w)
                                          for k, w in want.items())
        out.put(("engine", rank, v, ok))
        open(os.path.join(tmp, f"checked{v}-{rank}"), "w").close()
    sub.close()
    dist.destroy_process_group()


def vllm_moe_engine(rank: int, m: int, n: int, ports: tuple, tmp: str, out, versions: int) -> None:
    """An engine rank of vLLM's expert-parallel layout as plain per-rank tensors (what its loaders would hold:
    qkv_proj, w13_weight / w2_weight of this rank's experts, padded vocabulary rows), no transformers import."""
    import torch

    from wsync.shard.sync import ShardSubscriber

    torch.set_num_threads(1)
    plan = moe_plan(m, n)
    tensors = {name: torch.zeros(p.shape, dtype=torch.bfloat16) for (r, name), p in plan.engine.locals.items()
               if r == rank}
    sub = ShardSubscriber(plan, rank, tensors, coordinator=f"tcp://127.0.0.1:{ports[2]}", token=TOKEN)
    for v in range(versions):
        sub.wait_for(v, timeout=120)
        with sub.lock:
            ref = np.load(os.path.join(tmp, f"ref{sub.version}.npz"))
            want = engine_expected(plan, rank, {k: ref[k] for k in ref.files})
            ok = sub.version == v and want.keys() == tensors.keys() and all(
                np.array_equal(tensors[k].view(torch.uint16).numpy(), w) for k, w in want.items())
            ok = ok and _experts_by_index(rank, n, tensors, ref)
            ok = ok and all(c._tables is not None for c in sub.stage._live_tables.values())  # one call per dtype
        out.put(("engine", rank, v, ok))
        open(os.path.join(tmp, f"checked{v}-{rank}"), "w").close()
    sub.close()


def _experts_by_index(rank: int, n: int, tensors: dict, ref) -> bool:
    """Independently of the plan: this rank's w13 / w2 are the reference's experts [start, start + count) of
    vLLM's linear expert map, whole (gate rows then up rows, as transformers 5 fuses them)."""
    base, rem = divmod(MOE["experts"], n)
    count, start = base + (rank < rem), rank * base + min(rank, rem)
    ok = True
    for layer in range(MOE["layers"]):
        pre = f"model.layers.{layer}.mlp.experts."
        for mine, theirs in (("routed_experts.w13_weight", "gate_up_proj"), ("routed_experts.w2_weight", "down_proj")):
            ok &= np.array_equal(tensors[pre + mine].view(__import__("torch").uint16).numpy(),
                                 ref[pre + theirs][start:start + count])
    return bool(ok)


class Group:
    """m trainer ranks in this process, n engine-rank processes, the coordinator on trainer rank 0."""

    def __init__(self, m: int, n: int, hooks: dict | None = None, timeout: float = 30.0, engine: str = "vllm",
                 coordinator: str | None = None, **config):
        from wsync.shard.sync import ShardPublisher

        # a killed engine rank's links give up after 3 s, not 30: closing the Publishers waits for them
        config.setdefault("listen_opts", {"resume_window": 3.0})
        self.spec = {"m": m, "n": n, "engine": engine}
        self.plan = make_plan(m, n, engine)
        self.ref = Reference(qwen_params())
        self.pubs = []
        if coordinator is None:  # trainer rank 0 hosts it; else one runs at that address
            self.pubs = [ShardPublisher(self.plan, 0, coordinator="tcp://127.0.0.1:0", host_coordinator=True,
                                        token=TOKEN, timeout=timeout, **config)]
            coordinator = self.pubs[0].coordinator_address
        self.address = coordinator
        self.pubs += [ShardPublisher(self.plan, t, coordinator=self.address, token=TOKEN, **config)
                      for t in range(len(self.pubs), m)]
        self.ctx = mp.get_context("spawn")
        self.out = self.ctx.Queue()
        self.procs = {}
        self.log: list[tuple] = []
        for r in range(n):
            self.start(r, (hooks or {}).get(r, {}))
        self.expect("joined", None, range(n))

    def start(self, rank: int, hooks: dict) -> None:
        p = self.ctx.Process(target=engine_worker, args=(rank, self.spec, self.address, self.out, hooks), daemon=True)
        p.start()
        self.procs[rank] = p

    def publish(self, v: int) -> None:
        state = self.ref.torch_state(v)
        for t, pub in enumerate(self.pubs):
            pub.publish(trainer_local(self.plan, t, state), v)

    def outcome(self, v: int, timeout: float = 60.0) -> dict:
        return self.pubs[0].wait(v, timeout=timeout)

    def expect(self, kind: str, v, ranks, timeout: float = 60.0) -> dict:
        """Each rank's (version served, bytes ok) at its `kind` event for version v."""
        got, deadline = {}, time.monotonic() + timeout
        while set(got) != set(ranks):
            for rank, ev, served, ok, ev_v in self.log:
                if ev == kind and ev_v == v and rank in ranks:
                    got[rank] = (served, ok)
            if set(got) == set(ranks):
                break
            try:
                self.log.append(self.out.get(timeout=max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                raise AssertionError(f"no {kind} {v} from ranks {sorted(set(ranks) - set(got))}; log {self.log}")
        return got

    def close(self) -> None:
        # the trainer's Publishers first, while their engine ranks live to say goodbye to, then the engine ranks
        for pub in reversed(self.pubs):
            pub.close()
        for p in self.procs.values():
            p.kill()
            p.join(5)


def commit(g: Group, v: int) -> None:
    """Publish version v on every trainer rank; every engine rank commits it."""
    g.publish(v)
    res = g.outcome(v)
    assert res["outcome"] == "committed" and res["version"] == v, res
    assert res["digest"] == res["expected"] is not None, res  # what engine ranks hold = what trainers announced
    got = g.expect("committed", v, range(g.spec["n"]))
    assert all(served == v and ok for served, ok in got.values()), got


# -- quantized sharded sync: the trainer's BF16 boxes -> the engine's boxes of q(full state) -------------------

# every quantized matrix's sides are multiples of 256, so FSDP over 2 ranks and TP over 2 cut FP8's 128x128
# blocks nowhere; over 3 trainer ranks the rows split 86, 86, 84 (INT4 and INT8 take any row split)
QDIMS = {"layers": 2, "hidden": 256, "inter": 256, "vocab": 130, "heads": 4, "kv_heads": 2, "head_dim": 64}


def quantizer_for(kind: str, group: int = 32):
    """compressed-tensors' INT4 group / INT8 channel or vLLM's block FP8 on every Linear but lm_head (as quantized
    checkpoints leave it); FP8 on the MLP projections only (the k / v rows are 128: FSDP over 2 cuts them)."""
    from wsync.quant import Fp8Block, Int4Group, Int8Channel, Quantizer

    if kind == "int4":
        return Quantizer([(["Linear"], Int4Group(group))], ignore=["lm_head"])
    if kind == "int8":
        return Quantizer([(["Linear"], Int8Channel())], ignore=["lm_head"])
    return Quantizer([(["re:.*mlp\\."], Fp8Block())], ignore=["lm_head"])


def quant_plan(m: int, n: int, kind: str, dims: dict = QDIMS, params: dict[str, Param] | None = None):
    """(the BF16 trainer layout, the plan): FSDP2 over m trainer ranks, torch TP over n engine ranks, both over
    the quantized state's tensors (of qwen_params(**dims), or of `params`)."""
    from wsync.shard.conventions import fsdp_placements, hf_tp_layout, quantized_layout, trainer_layout_for
    from wsync.shard.route import route

    params, q = params or qwen_params(**dims), quantizer_for(kind)
    trainer = trainer_layout_for(params, fsdp_placements(params), m)
    return trainer, route(quantized_layout(trainer, q), hf_tp_layout(params, n, quantize=q))


def quant_reference(q, params: dict[str, Param], bits: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """q(full state) as bit patterns, from wsync.quant's numpy reference (ref.py) on the unsharded state."""
    out = {}
    for name, b in bits.items():
        scheme = q.scheme_for(name, params[name].shape, "BF16")
        if scheme is None:
            out[name] = b
            continue
        for o, a in zip(scheme.outputs(params[name].shape, "BF16"), scheme.reference(b, "BF16", name)):
            a = np.ascontiguousarray(a)
            out[name[: -len("weight")] + o.suffix] = a.view(f"<u{a.dtype.itemsize}").reshape(o.shape)
    return out


def quant_expected(plan, rank: int, qbits: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Engine rank `rank`'s local tensors at a version, as bit patterns: q(full state) sliced by the layout."""
    from wsync import dtypes

    out = {name: np.zeros(p.shape, dtypes.from_torch(p.dtype).bits_dtype)
           for (r, name), p in plan.engine.locals.items() if r == rank}
    for n in plan.engine.needs:
        if n.rank == rank:
            out[n.name][sl(n.dst)] = qbits[n.src_name][sl(n.src)]
    return out


def bits_of(t) -> np.ndarray:
    """A CPU tensor's bit patterns (unsigned ints of its width)."""
    import torch

    return t.view(getattr(torch, f"uint{8 * t.element_size()}")).numpy()


def quant_engine_worker(rank: int, spec: dict, coordinator: str, out) -> None:
    """engine_worker for quant_plan: local tensors of zeros in the quantized dtypes, and after every outcome a
    byte check of each against q(full state) (the numpy reference) at the version it serves."""
    import torch

    from wsync.shard.sync import ShardSubscriber

    _, plan = quant_plan(spec["m"], spec["n"], spec["kind"])
    params, q = qwen_params(**QDIMS), quantizer_for(spec["kind"])
    ref = Reference(params)
    tensors = {name: torch.zeros(p.shape, dtype=getattr(torch, p.dtype))
               for (r, name), p in plan.engine.locals.items() if r == rank}
    sub = ShardSubscriber(plan, rank, tensors, coordinator=coordinator, token=TOKEN)
    while sub.stage is None:
        time.sleep(0.02)
    out.put((rank, "joined", None, True, None))
    cache = {}

    def check(version: int) -> bool:
        if version not in cache:
            cache.clear()
            cache[version] = quant_expected(plan, rank, quant_reference(q, params, ref.at(version)))
        want = cache[version]
        return want.keys() == tensors.keys() and all(np.array_equal(bits_of(tensors[k]), w) for k, w in want.items())

    report_outcomes(sub, rank, out, check)


class QuantGroup(Group):
    """Group over quant_plan: m ShardPublishers(quantize=q) here, each handed its BF16 local tensors, and n
    quant_engine_worker processes."""

    def __init__(self, m: int, n: int, kind: str, timeout: float = 30.0, **config):
        from wsync.shard.sync import ShardPublisher

        config.setdefault("listen_opts", {"resume_window": 3.0})
        self.spec = {"m": m, "n": n, "kind": kind}
        self.bf16, self.plan = quant_plan(m, n, kind)
        self.ref = Reference(qwen_params(**QDIMS))
        q = quantizer_for(kind)  # one per trainer rank would be as good: its output buffers are per name
        self.pubs = [ShardPublisher(self.plan, 0, coordinator="tcp://127.0.0.1:0", host_coordinator=True,
                                    token=TOKEN, timeout=timeout, quantize=q, **config)]
        self.address = self.pubs[0].coordinator_address
        self.pubs += [ShardPublisher(self.plan, t, coordinator=self.address, token=TOKEN, quantize=quantizer_for(kind),
                                     **config) for t in range(1, m)]
        self.ctx = mp.get_context("spawn")
        self.out = self.ctx.Queue()
        self.procs, self.log = {}, []
        for r in range(n):
            self.start(r, {})
        self.expect("joined", None, range(n))

    def start(self, rank: int, hooks: dict) -> None:
        assert not hooks, "quant_engine_worker injects no faults"
        p = self.ctx.Process(target=quant_engine_worker, args=(rank, self.spec, self.address, self.out), daemon=True)
        p.start()
        self.procs[rank] = p

    def publish(self, v: int) -> None:
        state = self.ref.torch_state(v)
        for t, pub in enumerate(self.pubs):
            pub.publish({h.name: state[h.name][sl(h.box)].contiguous() for h in self.bf16.held if h.rank == t}, v)


def quant_tensor_engine(rank: int, m: int, n: int, ports: tuple, tmp: str, out, versions: int, kind: str) -> None:
    """An engine rank of fsdp_trainer(quant=kind)'s plan: plain local tensors in the quantized dtypes, each compared
    byte for byte with its boxes of q(full state) (the numpy reference on the trainer's unsharded state)."""
    import torch

    from wsync.shard.sync import ShardSubscriber

    torch.set_num_threads(1)
    params = {name: Param(tuple(p.shape), DT) for name, p in tiny_qwen3().named_parameters()}
    _, plan = quant_plan(m, n, kind, params=params)
    q = quantizer_for(kind)
    tensors = {name: torch.zeros(p.shape, dtype=getattr(torch, p.dtype))
               for (r, name), p in plan.engine.locals.items() if r == rank}
    sub = ShardSubscriber(plan, rank, tensors, coordinator=f"tcp://127.0.0.1:{ports[2]}", token=TOKEN)
    for v in range(versions):
        sub.wait_for(v, timeout=120)
        with sub.lock:
            ref = np.load(os.path.join(tmp, f"ref{sub.version}.npz"))
            want = quant_expected(plan, rank, quant_reference(q, params, {k: ref[k] for k in ref.files}))
            ok = sub.version == v and want.keys() == tensors.keys() and all(
                np.array_equal(bits_of(tensors[k]), w) for k, w in want.items())
        out.put(("engine", rank, v, ok))
        open(os.path.join(tmp, f"checked{v}-{rank}"), "w").close()
    sub.close()


def run_processes(tmp_path, m: int, n: int, trainer, engine, versions: int, trainer_args: tuple = (),
                  engine_args: tuple = ()) -> None:
    """m trainer processes and n engine processes for `versions` versions; each posts (side, rank, version, ok),
    and every one must say ok."""
    from helpers import free_port

    ctx = mp.get_context("spawn")
    ports, out = (free_port(), free_port(), free_port()), ctx.Queue()
    args = (m, n, ports, str(tmp_path), out, versions)
    procs = [ctx.Process(target=trainer, args=(r, *args, *trainer_args)) for r in range(m)] + \
        [ctx.Process(target=engine, args=(r, *args, *engine_args)) for r in range(n)]
    for p in procs:
        p.start()
    got = []
    try:
        while len(got) < (m + n) * versions:
            got.append(out.get(timeout=400))  # spawning, importing transformers and FSDP setup under a loaded CI machine
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0] * (m + n)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert sorted(got) == sorted([("trainer", r, v, True) for r in range(m) for v in range(versions)]
                                 + [("engine", r, v, True) for r in range(n) for v in range(versions)]), got
