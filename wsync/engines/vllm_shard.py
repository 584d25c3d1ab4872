"""vLLM's tensor-parallel workers as the engine ranks of a sharded sync (wsync.shard): each worker takes only
its own slices, in vLLM's fused names, from the trainer ranks that hold them, and no worker serves a version
its peers do not.

    llm = LLM(model, tensor_parallel_size=2, worker_extension_cls="wsync.engines.vllm.WsyncWorkerExtension")
    llm.collective_rpc("wsync_shard_subscribe", args=(coordinator, token_id(TOKEN), trainer_doc, params_doc))
    ...                                                   # trainer ranks: ShardPublisher(plan, t, ...).publish(...)
    vllm_shard.update(llm, v)                             # between generate() calls: every worker serves v or newer

Each worker builds the routing plan itself, from the trainer's parameter shapes (`params_doc`, name ->
[shape, dtype]), the trainer's layout (`trainer_doc`: {"ranks": M, "placements": "fsdp"} or explicit
placements, as wsync.shard.conventions.trainer_layout_for takes them) and its own vLLM config
(wsync.shard.vllm_names.vllm_layout). The coordinator compares the plan's hash with the trainer's, so a worker
that computed another plan is refused at join, by name.

Three copies of a rank's weights, and why:
- the staging (stage.py): the pieces of the version in flight, verified apart from everything else;
- the rank's committed copy (`shadows`: engine name -> a host tensor of the rank's local shape), written by
  the ShardSubscriber's thread when the coordinator says commit, at any moment;
- vLLM's own parameters, written only by `update` on the worker's thread, between the engine's steps.
The last split is what keeps a forward pass from seeing two versions: the two-phase commit makes every rank
commit a version or none, but each rank copies at its own moment, and vLLM's workers run every step
together. `update` runs on every worker between two steps (collective_rpc); each worker swaps in what it has
committed, and the driver's helper repeats the call until every worker answers the same version (a worker
can be one commit ahead of another; the other then waits for that commit).

vLLM's CPU backend keeps linear weights prepacked for its GEMM kernels (`cpu_linear`; the parameter itself
emptied, or kept beside the packed copy for embeddings). Writing into the parameter would change nothing
those kernels read, so a layer in that form gets its parameters back from the committed copy and is
re-processed by its own quant method (`process_weights_after_loading`, which packs again), as vLLM does
after loading a checkpoint. Every other parameter is written in place, so its storage (and any graph
captured over it) stays the same.
"""
from __future__ import annotations

import threading

import xxhash

from ..errors import MismatchError, WsyncError

MAX_PARAMS = 1_000_000  # a params_doc bigger than this is refused before anything is built from it


def _check_doc(params_doc, trainer_doc) -> tuple[dict, dict]:
    from ..shard.layout import Param

    if not isinstance(params_doc, dict) or not 0 < len(params_doc) <= MAX_PARAMS:
        raise WsyncError(f"params must be a dict of 1 to {MAX_PARAMS} entries name -> [shape, dtype]")
    params = {}
    for name, v in params_doc.items():
        ok = (isinstance(name, str) and isinstance(v, (list, tuple)) and len(v) == 2
              and isinstance(v[0], (list, tuple)) and all(type(d) is int and d >= 0 for d in v[0])
              and isinstance(v[1], str))
        if not ok:
            raise WsyncError(f"params[{str(name)[:100]!r}] must be [shape (list of ints >= 0), dtype name]")
        params[name] = Param(tuple(v[0]), v[1].removeprefix("torch."))
    if not isinstance(trainer_doc, dict) or type(trainer_doc.get("ranks")) is not int or trainer_doc["ranks"] < 1:
        raise WsyncError("trainer must be {'ranks': M >= 1, 'placements': 'fsdp' | {name: placement}, "
                         "'mesh': optional}")
    return params, trainer_doc


def build_plan(params_doc: dict, trainer_doc: dict, hf_config: dict, tp: int, **vllm_opts):
    """The routing plan a worker of a `tp`-way vLLM engine computes (and the trainer ranks compute alike)."""
    from ..shard.conventions import VllmConfig, fsdp_placements, trainer_layout_for, vllm_layout
    from ..shard.route import route

    params, t = _check_doc(params_doc, trainer_doc)
    placements = t.get("placements", "fsdp")
    if placements == "fsdp":
        placements = fsdp_placements(params)
    elif isinstance(placements, dict):
        placements = {n: tuple(tuple(x) if isinstance(x, list) else x for x in p) if isinstance(p, list) else p
                      for n, p in placements.items()}
    else:
        raise WsyncError(f"trainer placements must be 'fsdp' or a dict, got {type(placements).__name__}")
    trainer = trainer_layout_for(params, placements, t["ranks"], t.get("mesh"))
    return route(trainer, vllm_layout(params, tp, VllmConfig.from_hf(hf_config, **vllm_opts)))


def _kernel_format(module) -> bool:
    return getattr(module, "cpu_linear", None) is not None


class ShardedWorker:
    """Engine rank `rank` of `plan` inside one vLLM worker, over `model` (the worker's nn.Module)."""

    def __init__(self, model, plan, rank: int, *, coordinator: str, token=None, device=None, **sub_opts):
        import torch

        from ..shard.engine import ShardSubscriber

        self.model, self.plan, self.rank = model, plan, rank
        named = dict(model.named_parameters())
        self.shadows: dict[str, torch.Tensor] = {}
        self.repack: dict[str, list[str]] = {}  # module path -> its leaves in the plan (kernel-format layers)
        self.in_place: dict[str, torch.Tensor] = {}  # engine name -> vLLM's parameter, written in place
        for (r, name), p in sorted(plan.engine.locals.items()):
            if r != rank:
                continue
            live = named.get(name)
            if live is None:
                raise MismatchError(f"vLLM worker (engine rank {rank}) has no parameter {name!r}, which the plan "
                                    f"writes; its parameters look like {sorted(named)[:3]}")
            path, leaf = name.rsplit(".", 1)
            module = model.get_submodule(path)
            dtype = getattr(torch, p.dtype, None)
            if not isinstance(dtype, torch.dtype):
                raise MismatchError(f"{name}: unknown dtype {p.dtype!r}")
            if _kernel_format(module):
                self._check_packed(name, module, leaf, live, p)
                self.repack.setdefault(path, []).append(leaf)
            else:
                if tuple(live.shape) != tuple(p.shape) or live.dtype != dtype:
                    raise MismatchError(f"vLLM worker (engine rank {rank}): {name} is {live.dtype}"
                                        f"{list(live.shape)}, the plan says {p.dtype}{list(p.shape)}")
                self.in_place[name] = live
            self.shadows[name] = torch.zeros(p.shape, dtype=dtype)
        self.device = device
        self.served: int | None = None
        self._packed_sums: dict[str, str] = {}  # engine name -> digest of the bytes last handed to a repack
        self._swap_lock = threading.Lock()
        self.sub = ShardSubscriber(plan, rank, self.shadows, coordinator=coordinator, token=token, **sub_opts)

    def _check_packed(self, name, module, leaf, live, p) -> None:
        """A prepacked layer's weight is emptied (or kept beside its packed copy): check what the layer says
        its local shape is instead."""
        if live.numel():
            ok = tuple(live.shape) == tuple(p.shape)
        elif leaf == "weight" and hasattr(module, "output_size_per_partition"):
            ok = (module.output_size_per_partition, module.input_size_per_partition) == tuple(p.shape)
        else:
            ok = False
        if not ok:
            raise MismatchError(f"vLLM worker (engine rank {self.rank}): {name} (prepacked, shape "
                                f"{list(live.shape)}) does not take the plan's {p.dtype}{list(p.shape)}")

    def update(self, version: int, timeout: float | None = 600.0) -> int:
        """Wait until this rank committed `version` (or newer), then put what it committed into vLLM's
        parameters. Call between engine steps on every worker at once (collective_rpc); returns the version
        this worker now serves."""
        import torch

        self.sub.wait_for(version, timeout=timeout)
        with self._swap_lock, self.sub.lock, torch.no_grad():  # no commit copies into the shadows meanwhile
            committed = self.sub.version
            if committed == self.served:
                return committed
            for name, live in self.in_place.items():
                live.copy_(self.shadows[name], non_blocking=False)
            for path, leaves in self.repack.items():
                self._repack(path, leaves)
            self.served = committed
        return committed

    def _repack(self, path: str, leaves: list[str]) -> None:
        import torch

        module = self.model.get_submodule(path)
        for leaf in leaves:  # a copy: the layer's processing may convert or drop the tensor it is given
            t = self.shadows[f"{path}.{leaf}"].clone()
            self._packed_sums[f"{path}.{leaf}"] = tensor_digest(t)
            setattr(module, leaf, torch.nn.Parameter(t if self.device is None else t.to(self.device),
                                                     requires_grad=False))
        method = getattr(module, "quant_method", None)
        if method is None or not hasattr(method, "process_weights_after_loading"):
            raise WsyncError(f"{path} keeps its weights prepacked but has no quant_method to pack them again")
        method.process_weights_after_loading(module)

    def status(self) -> dict:
        return {"rank": self.rank, "served": self.served, "committed": self.sub.version,
                "received_bytes": self.sub.received_bytes(), "events": [list(e) for e in self.sub.events[-5:]],
                "plan": self.plan.hash}

    def digests(self) -> dict:
        """xxh3-128 of the bytes this worker serves, per engine tensor: vLLM's own parameter where it is
        written in place, and for a prepacked layer the bytes last handed to its packing (the packed form
        itself is the kernel's). A version committed but not yet swapped in does not show here."""
        with self._swap_lock, self.sub.lock:
            return {name: tensor_digest(self.in_place[name]) if name in self.in_place else self._packed_sums.get(name)
                    for name in self.shadows}

    def close(self) -> None:
        self.sub.close()


def tensor_digest(t) -> str:
    """xxh3-128 of a tensor's bytes (C order), hex."""
    import torch

    return xxhash.xxh3_128(t.detach().cpu().contiguous().view(torch.uint8).numpy()).hexdigest()


def update(llm, version: int, timeout: float | None = 600.0) -> int:
    """Driver side: every worker of `llm` serves one version, `version` or newer; returns it.

    One round of `wsync_shard_update` on every worker; if they answer different versions (one committed the
    next version before the other looked), again with the newest, until all agree. No generate() runs in
    between, so no step computes with two versions."""
    while True:
        served = llm.collective_rpc("wsync_shard_update", args=(version, timeout))
        if len(set(served)) == 1:
            return served[0]
        version = max(served)
