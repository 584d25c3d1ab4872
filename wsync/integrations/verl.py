"""verl: a ``wsync`` backend for verl's checkpoint engine (``checkpoint_engine.backend=wsync``).

verl moves weights from its actor workers to its rollout replicas through a
registry of checkpoint engines (``verl.checkpoint_engine.CheckpointEngineRegistry``;
written against verl 0.9.1). For every update it calls ``prepare`` on all
workers, ``build_topology`` once with their metadata, ``init_process_group``
with each worker's share, then ``send_weights`` on the actor ranks (every rank
walks the generator, because producing a full tensor is collective) and
``receive_weights`` on the rollout workers, whose (name, tensor) pairs go to
the server adapter's ``update_weights``, and finally ``finalize``.

Here actor rank 0 owns a wsync Publisher and every rollout worker a
Subscriber; both live across updates, because the delta codec needs the
previous version on both ends, so ``finalize`` keeps them. What a rollout
worker yields is only the tensors that changed (all of them on a keyframe, or
every version with ``whole=True``), already checked against the trainer's
checksums. ``get_weights`` is the cached variant verl asks of
``CheckpointEngineWithCache``: the newest version from the worker's host copy,
without touching the network.

verl config (Hydra overrides; verl 0.9.1 has ``custom_backend_module`` in its config, so no ``+``)::

    actor_rollout_ref.rollout.checkpoint_engine.backend=wsync
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=wsync.integrations.verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.wsync.address=tcp://0.0.0.0:7070

with the token in every worker's environment (``WSYNC_TOKEN=<hex>``, e.g. through
Ray's runtime_env), not in the config, which verl prints; a tcp address beyond
loopback without a token is refused.
"""
from __future__ import annotations

import asyncio
import sys

from ..engines.staged import Staged
from ..errors import BackendUnavailable, WsyncError
from ..sync import PublisherStats
from .common import SyncConfig, host_state, next_version

BACKEND = "wsync"  # the name in verl's CheckpointEngineRegistry

# verl names this module calls or overrides, checked against verl's published source (tests/test_integrations_signatures.py)
CALLS = [("verl.checkpoint_engine.base", "CheckpointEngineRegistry.register", 1, (), False)]
OVERRIDES = [("verl.checkpoint_engine.base", f"CheckpointEngine.{m}") for m in
             ("prepare", "build_topology", "init_process_group", "finalize", "send_weights", "receive_weights")] + \
            [("verl.checkpoint_engine.base", "CheckpointEngineWithCache.get_weights")]


class Collect(Staged):
    """A rollout worker's host copy; each version's changed tensors wait in ``out`` for receive_weights."""

    def __init__(self):
        super().__init__()
        self.out: dict = {}

    def push(self, named: dict, *, whole: bool) -> None:
        self.out.update(named)  # a rolled-back version pushes the old values again, so the newest write wins


class WsyncCheckpointEngineCore:
    """The backend's logic; ``engine_class()`` mixes it into verl's CheckpointEngineWithCache."""

    def __init__(self, bucket_size: int, is_master: bool = False, *, whole: bool = False, **config):
        self.bucket_size, self.is_master, self.whole = bucket_size, is_master, whole
        config.setdefault("publisher_opts", {}).setdefault("bucket_bytes", bucket_size)
        self.config = SyncConfig(**config)
        self.rank: int | None = None
        self.pub = self.sub = None
        self.engine = Collect()
        self._last: int | None = None

    # -- topology: actor rank 0 publishes, every rollout worker subscribes -------------------

    def prepare(self) -> dict:
        if self.is_master and self.pub is None:
            self.pub = self.config.publisher()
        return {"address": self.config.dial_address(self.pub)} if self.is_master else {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        address = (metadata[0] or {}).get("address") if metadata else None
        if not address:
            raise WsyncError("wsync checkpoint engine: actor rank 0 reported no publisher address; "
                             "verl must build the actor's engine with is_master=True on rank 0")
        actor = {"rank": [0] + [-1] * (actor_wg_world_size - 1), "address": [address] * actor_wg_world_size}
        rollout = {"rank": list(range(1, rollout_world_size + 1)), "address": [address] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int, address: str):
        self.rank = rank
        if rank >= 1 and self.sub is None:
            from ..subscriber import Subscriber

            # poll: versions are applied inside receive_weights, when verl asks for them
            self.sub = Subscriber(address, engine=self.engine, token=self.config.token_bytes(), apply="poll")

    def finalize(self):
        """Nothing to tear down per update: the links and both host copies carry the next delta."""

    def close(self) -> None:
        for end in (self.pub, self.sub):
            if end is not None:
                end.close()
        self.pub = self.sub = None

    # -- one update -------------------------------------------------------------------------

    async def send_weights(self, weights, global_steps: int | None = None):
        if not self.is_master:
            await _drain(weights)  # gathering is collective: every actor rank walks the generator
            return {}
        state = host_state([item async for item in _aiter(weights)])
        version = next_version(global_steps, self._last)
        self.pub.publish(state, version=version)
        self._last = version
        await asyncio.to_thread(self.pub.flush, self.config.timeout_s)
        return sync_metrics(self.pub.stats, version, state)

    async def receive_weights(self, global_steps: int | None = None):
        if self.sub is None:
            raise WsyncError("wsync checkpoint engine: receive_weights before init_process_group")
        version = next_version(global_steps, self._last)
        served = await asyncio.to_thread(self.sub.wait_for, version, self.config.timeout_s)
        self._last = max(version, served)
        with self.engine.lock:
            out, self.engine.out = self.engine.out, {}
        if self.whole:
            out = _whole(self.engine)
        for name, tensor in out.items():
            yield name, tensor

    async def get_weights(self):
        """The newest version from this worker's host copy (verl's cached path: no network)."""
        for name, tensor in _whole(self.engine).items():
            yield name, tensor


def sync_metrics(stats: PublisherStats, version: int, state: dict) -> dict:
    """What send_weights hands verl's trainer, which logs every value as a number (tensorboard, wandb)."""
    wire = stats.bytes.get(version)
    keyframe = wire is None  # a keyframe ships the raw tensors, not an encoded delta
    return {"wsync/version": version, "wsync/keyframe": float(keyframe),
            "wsync/wire_bytes": sum(t.nbytes for t in state.values()) if keyframe else wire,
            "wsync/encode_s": stats.encode_s.get(version) or 0.0}


def _whole(engine: Staged) -> dict:
    from ..snapshot import to_torch

    with engine.lock:
        return {n: to_torch(tb).clone() for n, tb in engine.shadow.state.items()}


async def _aiter(weights):
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


async def _drain(weights) -> None:
    async for _ in _aiter(weights):
        pass


_CLASS = None


def engine_class():
    """WsyncCheckpointEngine: the core mixed into verl's CheckpointEngineWithCache (imports verl)."""
    global _CLASS
    if _CLASS is None:
        try:
            from verl.checkpoint_engine.base import CheckpointEngineWithCache
        except ImportError as e:
            raise BackendUnavailable(f"the wsync checkpoint engine needs verl (pip install verl): {e}") from e
        _CLASS = type("WsyncCheckpointEngine", (WsyncCheckpointEngineCore, CheckpointEngineWithCache),
                      {"__module__": __name__, "__doc__": WsyncCheckpointEngineCore.__doc__})
    return _CLASS


def register() -> type:
    """Put "wsync" in verl's CheckpointEngineRegistry; returns the class."""
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    cls = engine_class()
    CheckpointEngineRegistry.register(BACKEND)(cls)
    return cls


# verl imports this module by name (custom_backend_module) after importing its own checkpoint engines:
# register then, and only then, so that importing wsync.integrations.verl elsewhere stays light
if "verl.checkpoint_engine.base" in sys.modules:
    register()
