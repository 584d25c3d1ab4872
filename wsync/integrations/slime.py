"""slime: an update-weight class that publishes through wsync; engines reload from local folders.

slime's Megatron actor (THUDM/slime, checked at commit 624b824) picks one of
its ``UpdateWeightFrom*`` classes in ``MegatronTrainRayActor.init`` and drives
it through ``connect_rollout_engines(...)``, ``update_weights()``,
``weight_version`` and ``pop_metrics()``. The choice is an if/elif with no
registry, so ``patch()`` replaces the one class name the actor uses for
``--update-weight-transport disk`` (``UpdateWeightFromDisk``) with
``WsyncUpdateWeight``. It converts the Megatron shards to Hugging Face names
with slime's own ``HfWeightIteratorBase`` (the converter its tensor and NCCL
paths use), publishes them from rank 0 as one wsync version, and waits until
every sidecar (``wsync.integrations.disk.sidecar`` on each engine host, writing
``<update_weight_disk_dir>/weight_v{N:06d}``) holds it; slime's own
SGLang disk reload then runs unchanged. Only the delta crosses the network,
where ``UpdateWeightFromDisk`` writes the full model to shared storage each step.

Where the patch runs: slime's training actors are Ray actors (``RayTrainGroup``),
so a patch in the launcher never reaches them. slime's own hook does: at the end
of ``slime.backends.megatron_utils.initialize.init(args)``, which
``MegatronTrainRayActor.init`` calls before it picks its update-weight class,
it calls the function named by ``--custom-megatron-init-path``. So:
``--custom-megatron-init-path wsync.integrations.slime.megatron_init`` and the
config in the actors' environment through slime's ``--train-env-vars``
(``WSYNC_SLIME``: JSON of SyncConfig fields plus ``sidecars``; the token from
``WSYNC_TOKEN`` / ``WSYNC_TOKEN_FILE``). With ``--update-weight-mode delta``
slime uses its own ``UpdateWeightFromDiskDelta`` and this patch stays out.
"""
from __future__ import annotations

import importlib
from pathlib import Path

from .common import SyncConfig, env_config, host_state

ACTOR = "slime.backends.megatron_utils.actor"
CONFIG_ENV = "WSYNC_SLIME"  # JSON: SyncConfig fields and "sidecars", in the training actors' environment
PATCHED = "UpdateWeightFromDisk"
UPDATER = "slime.backends.megatron_utils.update_weight.update_weight_from_disk"
OVERRIDES = [(UPDATER, f"UpdateWeightFromDisk.{m}") for m in
             ("__init__", "connect_rollout_engines", "disconnect_rollout_engines", "pop_metrics", "update_weights")]
CALLS = [("slime.backends.megatron_utils.update_weight.hf_weight_iterator_base", "HfWeightIteratorBase.create", 2,
          ("model_name", "quantization_config"), False)]

_CONFIG = SyncConfig()
_SIDECARS = 1  # sidecars (engine hosts) each version must reach before update_weights returns


def version_dir(disk_dir, version: int) -> Path:
    """The folder slime's disk reload reads for a version (UpdateWeightFromDisk's layout)."""
    return Path(disk_dir) / f"weight_v{version:06d}"


class WsyncUpdateWeight:
    """slime's update-weight interface over a wsync Publisher on rank 0."""

    def __init__(self, args, model, weights_getter, *, model_name, quantization_config, hf_chunks=None):
        self.args, self.model, self.weights_getter = args, model, weights_getter
        self.model_name, self.quantization_config = model_name, quantization_config
        self.weight_version = 0
        self.update_weight_metrics: dict[str, float] = {}
        self.rollout_engines, self.rollout_engine_lock = [], None
        self._hf_chunks = hf_chunks  # tests / custom models: () -> iterable of lists of (hf_name, tensor)
        self._pub = None

    def connect_rollout_engines(self, rollout_engines, rollout_engine_lock, engine_gpu_counts=None,
                                engine_gpu_offsets=None, engine_parallel_configs=None) -> None:
        self.rollout_engines, self.rollout_engine_lock = rollout_engines, rollout_engine_lock
        if _rank0() and self._pub is None:
            self._pub = _CONFIG.publisher()

    def disconnect_rollout_engines(self) -> None:
        return

    def pop_metrics(self) -> dict[str, float]:
        out, self.update_weight_metrics = self.update_weight_metrics, {}
        return out

    def update_weights(self) -> None:
        self.weight_version += 1
        state = {}
        for chunk in self._chunks():  # collective over the Megatron ranks: all of them iterate
            if _rank0():
                state.update(host_state(chunk))
        if _rank0():
            if self._pub is None:
                self._pub = _CONFIG.publisher()
            self._pub.wait_for_subscribers(_SIDECARS, timeout=_CONFIG.timeout_s)
            self._pub.publish(state, version=self.weight_version)
            self._pub.flush(_CONFIG.timeout_s)  # every sidecar has written weight_v{N}
            self.update_weight_metrics = {"wsync/wire_bytes": float(self._pub.stats.bytes.get(self.weight_version) or 0)}
        _barrier()

    def _chunks(self):
        if self._hf_chunks is not None:
            return self._hf_chunks()
        base = importlib.import_module("slime.backends.megatron_utils.update_weight.hf_weight_iterator_base")
        it = base.HfWeightIteratorBase.create(self.args, self.model, model_name=self.model_name,
                                              quantization_config=self.quantization_config)
        return it.get_hf_weight_chunks(self.weights_getter())

    @property
    def address(self) -> str | None:
        """Where sidecars dial (after the first update_weights on rank 0)."""
        return None if self._pub is None else _CONFIG.dial_address(self._pub)


def _rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def patch(sidecars: int = 1, **config) -> None:
    """In slime's training actors: --update-weight-transport disk goes through wsync (config: SyncConfig fields)."""
    global _CONFIG, _SIDECARS
    _CONFIG, _SIDECARS = SyncConfig(**config), sidecars
    setattr(importlib.import_module(ACTOR), PATCHED, WsyncUpdateWeight)


def megatron_init(args) -> None:
    """slime's --custom-megatron-init-path hook, in every training actor: patch with the config in WSYNC_SLIME."""
    config, extra = env_config(CONFIG_ENV, ("sidecars",))
    patch(sidecars=int(extra.get("sidecars", 1)), **_fields(config))


def _fields(config: SyncConfig) -> dict:
    from dataclasses import fields

    return {f.name: getattr(config, f.name) for f in fields(config)}


def sidecar(address: str, disk_dir, *, token: str | None = None, keep: int = 2):
    """On each engine host: write every version to <disk_dir>/weight_v{N:06d}."""
    from .disk import sidecar as start

    return start(address, lambda v: version_dir(disk_dir, v), token=token, keep=keep)
