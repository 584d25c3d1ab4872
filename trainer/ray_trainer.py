"""The trainer of the Ray loop: ranks of one FSDP2 group, one of which publishes the weights.

Each rank is a Ray actor holding a shard of every parameter (``fully_shard`` over
a gloo mesh on CPU, NCCL on GPUs), so no rank holds the whole model between
steps. A GRPO step splits the batch's groups between the ranks; the loss is
scaled so that FSDP's gradient average equals the gradient of the one-process
loop's loss (sum over the batch's tokens / tokens in the batch), and the
diagnostics are reduced across ranks, so a step is the same step as
``trainer.grpo.Learner`` takes on the whole batch.

Publishing: every rank takes part in gathering the full state (FSDP's own
all-gather, checked bit for bit against ``full_tensor()`` of every tensor when
the group starts), rank 0 hands it to a wsync Publisher on tcp. That gather is
the stopgap until the sharded M->N path lands; the weights never travel
through Ray.
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict

from .grpo import Learner, surrogate
from .driver import LoopConfig, last_sync
from .policy import PolicyConfig


class ShardedLearner(Learner):
    """Learner whose ``_update`` runs on this rank's share of the groups, reduced over the group."""

    def __init__(self, model, cfg, *, rank: int, world: int, **kw):
        super().__init__(model, cfg, **kw)
        self.rank, self.world = rank, world

    def _update(self, groups, adv) -> dict:
        import torch
        import torch.distributed as dist

        size = len(groups[0])
        mine = list(range(self.rank, len(groups), self.world))
        part = [s for i in mine for s in groups[i]]
        a = torch.cat([adv[i * size : (i + 1) * size] for i in mine])
        total = max(sum(len(s["response"]) for g in groups for s in g), 1)
        logp, behaviour, mask = self._batch(part)
        loss, stats = surrogate(logp, behaviour, a, mask, self.cfg)
        # FSDP averages gradients over ranks: scale so the average is d(sum of all tokens' losses / all tokens)
        scaled = loss * (stats["tokens"] * self.world / total)
        self.opt.zero_grad(set_to_none=True)
        scaled.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        with torch.no_grad():
            rho = torch.exp(logp - behaviour)[mask]
            sums = torch.tensor([float(stats["tokens"]), float(rho.sum()), float((rho * rho).sum()),
                                 stats["clip_frac"] * stats["tokens"], float(loss.detach()) * stats["tokens"]],
                                dtype=torch.float64)
            highs = torch.tensor([stats["ratio_max"], stats["logprob_diff_max"]], dtype=torch.float64)
            dist.all_reduce(sums)
            dist.all_reduce(highs, op=dist.ReduceOp.MAX)
        n, r1, r2, held, lsum = sums.tolist()
        return {"ratio_mean": r1 / n, "ratio_max": highs[0].item(), "ess": r1 * r1 / (n * r2) if r2 else 1.0,
                "clip_frac": held / n, "logprob_diff_max": highs[1].item(), "tokens": int(n), "loss": lsum / n,
                "grad_norm": float(_full(norm))}


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state(model) -> dict:
    """The whole state on every rank, one ``full_tensor()`` (an all-gather) per tensor; tied parameters stay one
    tensor, as in an unsharded state_dict. The reference for ``gather``."""
    import torch

    out, first = {}, {}
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if id(t) in first:  # tied (lm_head = embed_tokens)
                out[name] = out[first[id(t)]]
                continue
            first[id(t)] = name
            out[name] = _full(t).detach()
    return out


def gather(model, keep: bool = True) -> dict:
    """The whole state through FSDP's own gather: ``unshard()`` all-gathers each FSDP unit's parameters in one
    collective (``full_state`` takes a collective per tensor, and their count is what costs). Every rank must
    call it; a rank that keeps the state gets copies (the gathered buffers are FSDP's, freed again by
    ``reshard()``, and must not be handed to numpy), tied parameters as one tensor."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    names = model.state_dict(keep_vars=True)  # before unshard(): FSDP's state_dict hook puts the shards back
    for u in units:
        u.unshard()
    try:
        if not keep:
            return {}
        params = dict(model.named_parameters(remove_duplicate=False))  # unsharded now; tied names: one tensor
        out, copies = {}, {}
        with torch.no_grad():
            for name, t in names.items():  # parameters unsharded, buffers as they are
                src = params.get(name, t)
                if id(src) not in copies:
                    copies[id(src)] = src.detach().clone()
                out[name] = copies[id(src)]
        return out
    finally:
        for u in units:
            u.reshard()


def _bits(t) -> bytes:
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def digest(state: dict) -> str:
    """trainer.policy.state_digest of a plain state dict."""
    from types import SimpleNamespace

    from .policy import state_digest

    return state_digest(SimpleNamespace(state_dict=lambda: state))


class TrainerRank:
    """One rank of the trainer group (a Ray actor). Rank 0 also owns the wsync Publisher."""

    def __init__(self, rank: int, world: int, cfg: LoopConfig):
        os.environ["OMP_NUM_THREADS"] = str(cfg.threads)  # before torch starts its pool (see trainer.cli)
        import torch

        torch.set_num_threads(cfg.threads)
        self.rank, self.world, self.cfg = rank, world, cfg
        self.pub = None
        self.store = None

    def open(self, publish: str, token: bytes | None, host: str) -> dict:
        """Rank 0: listen for samplers at `publish`, and open the group's TCPStore on a free port of `host`."""
        import torch.distributed as dist
        import wsync

        cfg = self.cfg
        self.pub = wsync.Publisher(publish, codec=cfg.codec, keyframe_every=cfg.keyframe_every, token=token,
                                   metrics_port=cfg.metrics_port)
        self.store = dist.TCPStore(host, 0, self.world, is_master=True, wait_for_workers=False)
        return {"address": self.pub.address, "port": self.store.port}

    def setup(self, host: str, port: int) -> dict:
        """Join the group at host:port (rank 0's store), shard the seeded policy, publish version 0 (rank 0)."""
        from datetime import timedelta

        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        from .policy import build

        store = self.store or dist.TCPStore(host, port, self.world, is_master=False)
        # a rank that died makes the others fail fast instead of hanging in a collective for 30 minutes
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world,
                                timeout=timedelta(seconds=60))
        mesh = init_device_mesh("cpu", (self.world,))
        cfg = self.cfg
        # every rank builds the same seeded model, then keeps its shard: version 0 equals the one-process loop's
        self.model = build(PolicyConfig(**{**asdict(cfg.policy), "seed": cfg.seed}))
        # one FSDP unit for the whole (tiny) policy, unsharded from forward to backward: one all-gather and one
        # reduce-scatter per step. A real model shards each block (fully_shard(layer)) and reshards after forward
        fully_shard(self.model, mesh=mesh, reshard_after_forward=False)
        self.learner = ShardedLearner(self.model, cfg.grpo, rank=self.rank, world=self.world,
                                      temperature=cfg.decode.temperature, top_p=cfg.decode.top_p)
        sharded = all(isinstance(p, DTensor) for p in self.model.parameters())
        reference, state = full_state(self.model), gather(self.model)  # the fast gather is full_tensor(), bit for bit
        same = reference.keys() == state.keys() and all(_bits(reference[k]) == _bits(state[k]) for k in state)
        out = self._publish(0)
        out.update(sharded=sharded, gather_checked=same)
        return out

    def step(self, batch: list, version: int) -> dict:
        """One GRPO step on `batch` (groups of samples), then publish the result as `version`."""
        t = time.perf_counter()
        stats = self.learner.step(batch)
        out = self._publish(version)
        out.update(stats=stats, train_s=time.perf_counter() - t - out["gather_s"] - out["publish_s"])
        return out

    def _publish(self, version: int) -> dict:
        t = time.perf_counter()
        state = gather(self.model, keep=self.pub is not None)
        out = {"gather_s": time.perf_counter() - t, "publish_s": 0.0, "digest": None, "sync": {}}
        if self.pub is not None:
            t = time.perf_counter()
            self.pub.publish(state, version=version)
            out["publish_s"] = time.perf_counter() - t
            out["sync"] = last_sync(self.pub.stats)
            if self.cfg.report_digests:
                out["digest"] = digest(state)
        return out

    def sync_stats(self, flush: float = 0.0):
        """Rank 0: the publisher's PublisherStats (bytes, encode and send seconds per version), after a flush if
        asked; None on the other ranks, which publish nothing."""
        if self.pub is None:
            return None
        if flush:
            from wsync.sync import FlushTimeout

            try:
                self.pub.flush(timeout=flush)
            except FlushTimeout:
                pass  # a sampler that is gone holds nothing up; its lag is in the report
        return self.pub.stats

    def node(self) -> dict:
        import ray

        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address()}

    def close(self) -> None:
        import torch.distributed as dist

        if self.pub is not None:
            self.pub.close()
            self.pub = None
        if dist.is_initialized():
            dist.destroy_process_group()
