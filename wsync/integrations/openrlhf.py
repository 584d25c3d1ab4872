"""OpenRLHF: ``broadcast_to_vllm`` over wsync, as a patch (OpenRLHF has no weight-transport hook).

OpenRLHF (0.11.2) sends weights from DeepSpeed rank 0 to its vLLM engines one
parameter at a time: ``ActorPPOTrainer._init_vllm_sync_group`` builds a
torch/NCCL group with every vLLM worker, and ``broadcast_to_vllm`` calls
``engine.update_weight.remote(name, dtype, shape)`` and broadcasts each
parameter; on the engine side the vLLM worker extension
``openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap`` receives it and calls
``model.load_weights``. The transport is chosen by ``--vllm.sync_backend``, but
only NCCL/gloo groups exist, so this module patches four methods and routes
``sync_backend=wsync`` through them (every other value runs OpenRLHF's own code):

- trainer: ``_init_vllm_sync_group`` starts a wsync Publisher and passes its
  address through the same ``init_process_group`` RPC (``backend="wsync"``,
  ``group_name`` carries ``wsync:<token id>``, a fingerprint: the token itself
  never rides an RPC argument or a group name, which get logged; each vLLM
  worker reads it from ``WSYNC_TOKEN`` / ``WSYNC_TOKEN_FILE``); ``broadcast_to_vllm`` gathers
  each parameter as before (ZeRO-3 too), publishes the whole model as one
  version, and sends one ``update_weight("wsync:<version>")`` per engine;
- vLLM worker: ``WorkerWrap.init_process_group`` subscribes, and
  ``WorkerWrap.update_weight`` applies that version through ``load_weights``.

The worker patch has to run inside every vLLM worker process: ``vllm_plugin``
does it from vLLM's ``vllm.general_plugins`` entry point; ``patch_trainer`` runs
in the trainer's driver script before the actors are created.
"""
from __future__ import annotations

import importlib
from contextlib import nullcontext

from .common import SyncConfig, engine_token, host_state

SYNC_BACKEND = "wsync"
PREFIX = "wsync:"
TRAINER = ("openrlhf.trainer.ray.ppo_actor", "ActorPPOTrainer")
WORKER = ("openrlhf.trainer.ray.vllm_worker_wrap", "WorkerWrap")
# OpenRLHF names patched or called, checked against its published source
OVERRIDES = [(TRAINER[0], "ActorPPOTrainer._init_vllm_sync_group"), (TRAINER[0], "ActorPPOTrainer.broadcast_to_vllm"),
             (WORKER[0], "WorkerWrap.init_process_group"), (WORKER[0], "WorkerWrap.update_weight")]
CALLS = [("openrlhf.trainer.ray.vllm_engine", "RolloutRayActor.init_process_group", 7, (), True),
         ("openrlhf.trainer.ray.vllm_engine", "RolloutRayActor.update_weight", 1, ("dtype", "shape"), True)]

_CONFIG = SyncConfig()
_ORIGINAL: dict = {}


def _cls(where):
    return getattr(importlib.import_module(where[0]), where[1])


def _swap(where, name, fn) -> None:
    cls = _cls(where)
    _ORIGINAL.setdefault((where, name), getattr(cls, name))
    setattr(cls, name, fn)


def _original(where, name):
    return _ORIGINAL.get((where, name)) or getattr(_cls(where), name)


def _resolve(refs):
    """ray.get on Ray object refs; plain values (engines called in-process) pass through."""
    try:
        import ray
    except ImportError:
        return refs
    return ray.get(refs) if refs and isinstance(refs[0], ray.ObjectRef) else refs


# -- trainer side -----------------------------------------------------------------------------

def init_vllm_sync_group(self, backend: str):
    if backend != SYNC_BACKEND:
        return _original(TRAINER, "_init_vllm_sync_group")(self, backend)
    self._wsync_pub = _CONFIG.publisher()
    self._wsync_version = -1
    tp = self.strategy.args.vllm.tensor_parallel_size
    world_size = len(self.vllm_engines) * tp + 1
    group = PREFIX + (_CONFIG.token_id() or "")  # a fingerprint, never the token
    address = _CONFIG.dial_address(self._wsync_pub)
    _resolve([engine.init_process_group.remote(address, 0, i * tp + 1, world_size, group, backend=SYNC_BACKEND,
                                               use_ray=False) for i, engine in enumerate(self.vllm_engines)])


def broadcast_to_vllm(self):
    if getattr(self.strategy.args.vllm, "sync_backend", "nccl") != SYNC_BACKEND:
        return _original(TRAINER, "broadcast_to_vllm")(self)
    import torch.distributed as dist

    model = self.actor.model.module
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad or not getattr(self.actor, "is_vlm", False)]
    state = {}
    for name, param in params:
        with _gather(self, model, param):  # collective under ZeRO-3 / DeepSpeed TP: every rank walks
            if rank0:
                state.update(host_state([(name, param.data)]))
    if rank0:
        self._wsync_version += 1
        self._wsync_pub.publish(state, version=self._wsync_version)
        _resolve([engine.update_weight.remote(f"{PREFIX}{self._wsync_version}", dtype=None, shape=None)
                  for engine in self.vllm_engines])
    if dist.is_initialized():
        dist.barrier()


def _gather(self, model, param):
    ds = self.strategy.args.ds
    if getattr(ds, "tensor_parallel_size", 1) > 1:
        import deepspeed

        return deepspeed.module_inject.layers.GatherReplacedLayerParams([param], model, enabled=True)
    if getattr(ds, "zero_stage", 0) == 3:
        import deepspeed

        return deepspeed.zero.GatheredParameters([param], enabled=True)
    return nullcontext()


def patch_trainer(**config) -> None:
    """In the driver, before the actors start: route sync_backend=wsync through wsync (config: SyncConfig fields)."""
    global _CONFIG
    _CONFIG = SyncConfig(**config)
    _swap(TRAINER, "_init_vllm_sync_group", init_vllm_sync_group)
    _swap(TRAINER, "broadcast_to_vllm", broadcast_to_vllm)


# -- vLLM worker side ---------------------------------------------------------------------------

def worker_init_process_group(self, master_address, master_port, rank_offset, world_size, group_name,
                              backend="nccl", use_ray=False):
    if backend != SYNC_BACKEND:
        return _original(WORKER, "init_process_group")(self, master_address, master_port, rank_offset, world_size,
                                                      group_name, backend, use_ray)
    from ..engines.vllm import LoadWeights
    from ..subscriber import Subscriber

    wanted = group_name[len(PREFIX):] if group_name.startswith(PREFIX) else ""
    token = engine_token(wanted or None)  # this worker's own token (environment), checked against the id
    self._wsync_engine = LoadWeights(lambda: self.model_runner.model)
    self._wsync_sub = Subscriber(master_address, engine=self._wsync_engine, token=token, apply="poll")


def worker_update_weight(self, name, dtype, shape, empty_cache=False):
    if not (isinstance(name, str) and name.startswith(PREFIX) and hasattr(self, "_wsync_sub")):
        return _original(WORKER, "update_weight")(self, name, dtype, shape, empty_cache)
    return self._wsync_sub.wait_for(int(name[len(PREFIX):]), timeout=_CONFIG.timeout_s)


def patch_worker() -> None:
    _swap(WORKER, "init_process_group", worker_init_process_group)
    _swap(WORKER, "update_weight", worker_update_weight)


def vllm_plugin() -> None:
    """vLLM general plugin: patch OpenRLHF's worker extension when OpenRLHF is installed (else nothing)."""
    try:
        importlib.import_module(WORKER[0])
    except ImportError:
        return
    patch_worker()


def unpatch() -> None:
    for (where, name), fn in list(_ORIGINAL.items()):
        setattr(_cls(where), name, fn)
        del _ORIGINAL[(where, name)]
