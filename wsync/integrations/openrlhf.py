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

Where the patches run. OpenRLHF's driver only creates Ray actors: the trainer
(``ActorPPOTrainer``) lives in each ``PolicyModelActor`` process, which imports
``openrlhf.trainer.ray.ppo_actor`` afresh, so a patch made in the driver never
reaches it. ``runtime_env(...)`` gives the Ray job a ``worker_process_setup_hook``
(``ray_setup``) and the config as an environment variable (``WSYNC_OPENRLHF``,
JSON of SyncConfig fields, never the token); in every Ray worker process of the
job the hook arranges for the two trainer methods to be patched the moment
``ppo_actor`` is imported (and the worker methods when ``vllm_worker_wrap`` is),
and imports nothing else. vLLM's engine-core processes are not Ray workers:
there ``vllm_plugin`` (a ``vllm.general_plugins`` entry point) patches
``WorkerWrap`` and reads the same inherited variable. ``patch_trainer`` patches
this process only: for a trainer built here, not through Ray.
"""
from __future__ import annotations

import importlib
import importlib.abc
import json
import os
import sys
from contextlib import nullcontext

from .common import TOKEN_FILE_ENV, SyncConfig, engine_token, env_config, host_state

SYNC_BACKEND = "wsync"
PREFIX = "wsync:"
TRAINER = ("openrlhf.trainer.ray.ppo_actor", "ActorPPOTrainer")
WORKER = ("openrlhf.trainer.ray.vllm_worker_wrap", "WorkerWrap")
CONFIG_ENV = "WSYNC_OPENRLHF"  # SyncConfig fields as JSON, for every process of the Ray job
SETUP_HOOK = "wsync.integrations.openrlhf.ray_setup"
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
        if getattr(self.strategy.args.vllm, "enable_prefix_caching", False):  # cached KV is of the old weights
            _resolve([engine.reset_prefix_cache.remote() for engine in self.vllm_engines])
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
    """Route sync_backend=wsync through wsync for a trainer built in this process (config: SyncConfig fields).

    Not in OpenRLHF's Ray driver: its trainer lives in ``PolicyModelActor`` processes. Use ``runtime_env``.
    """
    global _CONFIG
    _CONFIG = SyncConfig(**config)
    _patch_trainer_class()


def _patch_trainer_class(module=None) -> None:
    _swap(TRAINER, "_init_vllm_sync_group", init_vllm_sync_group)
    _swap(TRAINER, "broadcast_to_vllm", broadcast_to_vllm)


# -- inside OpenRLHF's Ray actors ------------------------------------------------------------------

def runtime_env(token_file: str | None = None, **config) -> dict:
    """The Ray job's runtime_env entries that patch OpenRLHF inside its actors (config: SyncConfig fields).

    For ``ray.init(runtime_env=...)`` before OpenRLHF's ``train(args)``, or ``ray job submit
    --runtime-env-json``: Ray merges it with the env_vars OpenRLHF's own ``ray.init`` sets. The token
    stays out (the job's runtime_env is stored and shown by Ray's dashboard): each process reads
    WSYNC_TOKEN, or the file ``token_file`` names (WSYNC_TOKEN_FILE, a path on every node).
    """
    if config.get("token"):
        raise ValueError("runtime_env would store the token in the Ray job's config, which Ray's dashboard shows: "
                         "give every node the token in a file (token_file=PATH) or in WSYNC_TOKEN")
    SyncConfig(**config)  # a wrong field fails here, in the driver, not in every actor
    env = {CONFIG_ENV: json.dumps(config)}
    if token_file:
        env[TOKEN_FILE_ENV] = str(token_file)
    return {"worker_process_setup_hook": SETUP_HOOK, "env_vars": env}


def ray_setup() -> None:
    """Ray's worker_process_setup_hook, in every worker process of the job: patch OpenRLHF's classes on import."""
    global _CONFIG
    _CONFIG = _env_config()
    _after_import(TRAINER[0], _patch_trainer_class)
    _after_import(WORKER[0], lambda module: patch_worker())


def _env_config() -> SyncConfig:
    return env_config(CONFIG_ENV)[0]


def _after_import(name: str, then) -> None:
    """Run then(module) once module `name` is imported: now if it already is, else right after its code runs."""
    if name in sys.modules:
        then(sys.modules[name])
        return
    finder = next((f for f in sys.meta_path if isinstance(f, _AfterImport)), None)
    if finder is None:
        finder = _AfterImport()
        sys.meta_path.insert(0, finder)
    finder.waiting.setdefault(name, []).append(then)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader the other finders return for a watched module."""

    def __init__(self):
        self.waiting: dict[str, list] = {}

    def find_spec(self, name, path, target=None):
        if name not in self.waiting:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self or not hasattr(finder, "find_spec") else finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Then(spec.loader, self.waiting.pop(name))
                return spec
        return None


class _Then(importlib.abc.Loader):
    def __init__(self, loader, callbacks):
        self.loader, self.callbacks = loader, callbacks

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self.loader  # the module keeps its real loader (resources, source)
        self.loader.exec_module(module)
        for then in self.callbacks:
            then(module)

    def __getattr__(self, name):
        return getattr(self.loader, name)


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
    # the worker's own device: a layerwise reload moves the model's parameters to meta first
    self._wsync_engine = LoadWeights(lambda: self.model_runner.model, device=getattr(self, "device", None))
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
    global _CONFIG
    try:
        importlib.import_module(WORKER[0])
    except ImportError:
        return
    if os.environ.get(CONFIG_ENV):  # inherited from the rollout actor's Ray runtime_env
        _CONFIG = _env_config()
    patch_worker()


def unpatch() -> None:
    for (where, name), fn in list(_ORIGINAL.items()):
        setattr(_cls(where), name, fn)
        del _ORIGINAL[(where, name)]


def main(argv=None) -> None:
    """python -m wsync.integrations.openrlhf [--token-file PATH] [FIELD=VALUE ...]: runtime_env as JSON.

    For ``ray job submit --runtime-env-json``; FIELD is a SyncConfig field, VALUE JSON or a plain string.
    """
    import argparse

    parser = argparse.ArgumentParser(prog="python -m wsync.integrations.openrlhf", description=main.__doc__)
    parser.add_argument("--token-file", help="path of the hex token on every node (WSYNC_TOKEN_FILE)")
    parser.add_argument("fields", nargs="*", metavar="FIELD=VALUE", help="SyncConfig fields, e.g. "
                        "address=tcp://0.0.0.0:7070 keyframe_every=50")
    ns = parser.parse_args(argv)
    config = {}
    for item in ns.fields:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"expected FIELD=VALUE, got {item!r}")
        try:
            config[key] = json.loads(value)
        except ValueError:
            config[key] = value
    try:
        print(json.dumps(runtime_env(token_file=ns.token_file, **config)))
    except (TypeError, ValueError) as e:
        parser.error(str(e))


if __name__ == "__main__":
    main()
