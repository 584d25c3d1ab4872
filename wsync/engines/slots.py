"""Serve several versions side by side, each request pinned to the version it started on.

Continual-learning deployments keep more than one version live: a request that began on version k finishes on
version k while k+1 lands (TRL serves max_staleness+1 LoRA versions at once), and a new version is staged where
no request reads it, then made live in one step. Two engines do that:

- ``LoraSlots``: the ``keep`` newest versions of a LoRA adapter as that many PEFT adapters ("slots") of one
  model over one frozen base; a batch mixes them, each row naming its version (PEFT's ``adapter_names``).
- ``TwoInstances``: full weights in two instances of a model, one live and one standby. A version is written
  into the standby and switched live; the version before it stays served on the other instance.

How they ride the Subscriber's transaction (subscriber.apply_version), so that a version that fails leaves every
version held byte for byte as it was:

- ``tensors()`` are read-only views of the newest committed version, so the Subscriber never writes them in
  place: it applies each version to a host copy of its own and hands the changed tensors to ``load``.
- ``load`` writes into memory no request reads (a free slot, the standby), first brought to the newest version's
  bytes; from then on ``tensors()`` views that memory, so the digest check after the load reads what the new
  version will serve.
- The commit is the Subscriber setting ``engine.version``: only then is that memory tied to the version. A
  version that changed no tensor (so no load) is tied to the memory of the version before it.
- ``lock`` marks the transaction: the Subscriber holds it around each apply, and an apply that raises through it
  (a corrupt payload, a digest that does not match, a load that fails) gives the pending memory up; TwoInstances
  writes back the standby bytes it had overwritten, so the version the standby served is served again.
- After a commit ``tensors()`` views other memory than the Subscriber's copy was made over: its memory check
  (subscriber.memory_key) sees that and copies the new version once before the next delta. Keyframes and catch-up
  chains are versions like any other, each committed on its own.

A request pins the versions it uses (``pin``). Memory a pinned request reads is never written: an update that
needs it waits up to ``Pinning.wait_s`` for those requests to end and is then refused (SlotsBusy), after which the
Subscriber asks the publisher for the version again.
"""
from __future__ import annotations

import copy
import logging
from abc import ABC, abstractmethod
import threading
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..errors import MismatchError, NotHeld, WsyncError
from ..snapshot import TensorBits, as_state, digest, storage_key, to_torch
from ..tables import as_array
from .hf import HF, _read_only

log = logging.getLogger("wsync.engines.slots")
SLOT_PREFIX = "wsync_slot"  # LoraSlots' adapters beside the model's own: wsync_slot1 ... wsync_slot<keep>


class SlotsBusy(WsyncError):
    """An update waited Pinning.wait_s for requests still reading the memory it must write, and was refused."""


@dataclass(kw_only=True)
class Pinning:
    """What an update does when the memory it must write still serves requests pinned to an older version."""

    wait_s: float = 60.0  # wait this long for those requests to end; then the version is refused (SlotsBusy)
    # called as on_wait(version, requests) in the applying thread when an update starts to wait (a log line, a metric)
    on_wait: Callable[[int | None, int], None] | None = None


class _Transaction:
    """The engines' ``lock``: a re-entrant lock whose outermost release by an exception aborts the pending version.

    The Subscriber holds ``engine.lock`` around each apply, so an exception leaving it is a version refused."""

    def __init__(self, abort: Callable[[], None]):
        self._lock = threading.RLock()
        self._abort = abort
        self._depth = 0
        self._owner: int | None = None

    def __enter__(self):
        self._lock.acquire()
        self._depth += 1
        self._owner = threading.get_ident()
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        self._depth -= 1
        try:
            if self._depth == 0 and kind is not None:
                self._abort()
        finally:
            if self._depth == 0:
                self._owner = None
            self._lock.release()
        return False

    @property
    def mine(self) -> bool:
        """Whether this thread is inside the transaction."""
        return self._depth > 0 and self._owner == threading.get_ident()


@dataclass(kw_only=True)
class _Pending:
    """A version being written, not committed yet."""

    key: object  # the memory written: a slot name, an instance index
    ready: bool = False  # brought to the base version's bytes: tensors() views it from now on
    retired: dict = field(default_factory=dict)  # versions that memory served before (TwoInstances)
    undo: dict = field(default_factory=dict)  # name -> its bytes before this version wrote it (TwoInstances)
    written: set = field(default_factory=set)  # names load() was handed


class _Held(ABC):
    """What both engines share: versions tied to memory, requests pinned to it, and the transaction."""

    def __init__(self, pinning: Pinning | None):
        self.pinning = pinning or Pinning()
        self._cond = threading.Condition(threading.RLock())
        self._held: dict[int, object] = {}  # version -> the memory serving it, oldest first
        self._pins: Counter = Counter()  # memory -> requests reading it now
        self._last: dict[object, int] = {}  # memory -> the newest version it served (what a wait names)
        self._pending: _Pending | None = None
        self._broken = False  # a load of this transaction failed: the Subscriber's rollback load writes nothing
        self._version: int | None = None
        self.lock = _Transaction(self.discard)

    @property
    def version(self) -> int | None:
        return self._version

    @version.setter
    def version(self, v: int) -> None:
        """The commit: the Subscriber sets this once the version's digest matched."""
        with self._cond:
            if v == self._version:
                return
            if not isinstance(v, int) or (self._version is not None and v < self._version):
                raise ValueError(f"a version is an int that only moves forward: serving {self._version}, asked to "
                                 f"commit {v!r}")
            self._commit(v)
            self._last[self._held[v]] = v
            self._pending, self._broken, self._version = None, False, v
            self._cond.notify_all()

    @property
    def versions(self) -> list[int]:
        """The versions a request can pin now, oldest first."""
        with self._cond:
            return sorted(self._held)

    def discard(self) -> None:
        """Give up a version being written (the Subscriber does this through ``lock`` when its apply fails)."""
        with self._cond:
            pending, self._pending, self._broken = self._pending, None, False
            if pending is not None:
                self._restore(pending)
            self._cond.notify_all()

    @contextmanager
    def _pinned(self, versions: list):
        """Hold the memory serving these versions (None: the newest); yields (versions, memory keys)."""
        with self._cond:
            versions = [self._version if v is None else v for v in versions]
            keys = [self._key_of(v) for v in versions]
            self._pins.update(keys)
        try:
            yield versions, keys
        finally:
            with self._cond:
                self._pins.subtract(keys)
                self._cond.notify_all()

    def _key_of(self, version):
        if version not in self._held:
            why = "nothing is committed yet" if not self._held else f"it holds versions {sorted(self._held)}"
            raise NotHeld(f"{type(self).__name__} does not serve version {version!r}: {why}; pin a version it holds "
                          f"(an evicted version comes back only by publishing it again)")
        return self._held[version]

    def _wait_unpinned(self, keys: list) -> object:
        """One of `keys` that no request reads, waiting up to wait_s for one (called without _cond held)."""
        with self._cond:
            busy = sum(self._pins[k] for k in keys)
            version = max((self._last[k] for k in keys if k in self._last), default=None)
            waits = all(self._pins[k] for k in keys)
        if waits:
            log.info("%s: an update waits for %d requests pinned to version %s", type(self).__name__, busy, version)
        if waits and self.pinning.on_wait is not None:
            try:
                self.pinning.on_wait(version, busy)  # outside the lock: it may look at this engine
            except Exception:  # noqa: BLE001 - the caller's hook; the update waits whatever it does
                log.exception("Pinning.on_wait raised (ignored)")
        with self._cond:
            if not self._cond.wait_for(lambda: any(not self._pins[k] for k in keys), timeout=self.pinning.wait_s):
                raise SlotsBusy(f"{type(self).__name__}: {sum(self._pins[k] for k in keys)} requests pinned to "
                                f"version {version} still ran after {self.pinning.wait_s:g}s, so the version after "
                                f"{self._version} was refused (the Subscriber asks for it again); finish requests "
                                f"sooner or raise Pinning.wait_s")
            return next(k for k in keys if not self._pins[k])

    def _guarded_load(self, named: dict, write: Callable[[dict], None]) -> None:
        """Run a load as part of the transaction: a failure gives the pending version up."""
        if self._broken and self.lock.mine:
            return  # the Subscriber putting back what a failed load wrote: the pending memory is dropped anyway
        try:
            write(named)
        except BaseException:
            self.discard()
            self._broken = self.lock.mine
            raise

    # per engine
    @abstractmethod
    def _commit(self, v: int) -> None:
        """(Under _cond.) Tie version v to the memory it was written into (or the newest's, if no load)."""

    @abstractmethod
    def _restore(self, pending: _Pending) -> None:
        """(Under _cond.) Give back what a refused version took: the memory it wrote, the versions it retired."""


def _checked(named: dict, meta: dict) -> dict:
    """named as torch tensors, each of the dtype and shape `meta` (name -> (torch dtype, shape)) gives its name;
    raises before anything is written."""
    import torch

    unknown = sorted(set(named) - set(meta))
    if unknown:
        raise MismatchError(f"the engine has no tensors named {unknown[:5]} ({len(unknown)} unknown)")
    out = {}
    for name, src in named.items():
        src = src if isinstance(src, torch.Tensor) else to_torch(as_state({name: src})[name])
        dtype, shape = meta[name]
        if src.dtype != dtype or tuple(src.shape) != tuple(shape):
            raise MismatchError(f"{name}: got {src.dtype}{list(src.shape)}, the engine holds {dtype}{list(shape)}")
        out[name] = src
    return out


def _meta(t) -> tuple:
    """(torch dtype, shape) of a tensor of HF.live(): a torch tensor, or experts in pieces (TensorBits)."""
    import torch

    if isinstance(t, TensorBits):
        return getattr(torch, t.dtype.torch_name), t.shape
    return t.dtype, t.shape


def _copy(dst: dict, src: dict, names) -> None:
    import torch

    names = list(names)
    if names:
        with torch.no_grad():
            torch._foreach_copy_([dst[n] for n in names], [src[n] for n in names])


class LoraSlots(_Held):
    """The ``keep`` newest committed versions of a LoRA adapter, each in a PEFT adapter of one PeftModel.

    The model's own adapter (``adapter_name``) is the first slot; ``keep`` more are added beside it (same
    LoraConfig), so one more slot than versions held is always free for the next version. Trainer side::

        pub.publish(wsync.engines.peft.adapter_state(peft_model), version=step)

    Serving: ``forward(versions, **inputs)`` / ``generate(versions, **kw)`` with one version per row, or ``pin``
    to hold versions across calls of your own. PEFT passes ``adapter_names`` through forward hooks on the shared
    modules, so two mixed-batch calls at once would see each other's: forward and generate take ``run_lock``;
    hold it around calls of your own. A plain forward (no adapter_names) runs whichever slot PEFT has active.
    """

    def __init__(self, model, *, keep: int = 2, adapter_name: str = "default", pinning: Pinning | None = None):
        super().__init__(pinning)
        if type(keep) is not int or keep < 1:
            raise ValueError(f"keep must be a positive int (versions served at once), got {keep!r}")
        config = getattr(model, "peft_config", {}).get(adapter_name)
        if config is None:
            raise MismatchError(f"the model has no PEFT adapter {adapter_name!r} (adapters: "
                                f"{sorted(getattr(model, 'peft_config', {}) or {})}); wrap it with "
                                f"peft.get_peft_model(model, LoraConfig(...)) first")
        if getattr(config, "use_dora", False):
            raise MismatchError("PEFT refuses mixed-adapter batches (adapter_names) with DoRA; serve a plain LoRA")
        self.model, self.keep = model, keep
        self.slots = [adapter_name] + [f"{SLOT_PREFIX}{i}" for i in range(1, keep + 1)]
        taken = sorted(set(self.slots[1:]) & set(model.peft_config))
        if taken:
            raise MismatchError(f"the model already has adapters {taken}: one LoraSlots per model")
        for name in self.slots[1:]:
            model.add_adapter(name, copy.deepcopy(config))
        self._params = {s: _adapter_params(model, s) for s in self.slots}
        _match(self._params, adapter_name)
        self.run_lock = threading.RLock()

    # -- what the Subscriber sees -----------------------------------------------------------------

    def tensors(self) -> dict:
        with self._cond:
            key = self._pending.key if self._pending is not None and self._pending.ready else self._base()
        return {n: _read_only(t) for n, t in self._views(key).items()}

    def load(self, named: dict) -> None:
        self._guarded_load(named, self._write)

    def _write(self, named: dict) -> None:
        named = _checked(named, {n: _meta(t) for n, t in self._views(self.slots[0]).items()})
        if self._pending is None:
            with self._cond:
                base = self._base()
                free = [s for s in self.slots if s != base and s not in self._held.values()]
            key = self._wait_unpinned(free)
            with self._cond:
                self._pending = _Pending(key=key)
            _copy(self._views(key), self._views(base), self._views(base))
            with self._cond:
                self._pending.ready = True
        _copy(self._views(self._pending.key), named, named)

    def _commit(self, v: int) -> None:
        self._held[v] = self._pending.key if self._pending is not None and self._pending.ready else self._base()
        while len(self._held) > self.keep:
            del self._held[next(iter(self._held))]

    def _restore(self, pending: _Pending) -> None:
        pass  # the slot held no version; the next version writes it whole before using it

    def _base(self) -> str:
        """The newest committed version's slot (the model's own adapter before any)."""
        return self._held[max(self._held)] if self._held else self.slots[0]

    def _views(self, slot: str) -> dict:
        return {n: p.detach() for n, p in self._params[slot].items()}

    # -- serving ------------------------------------------------------------------------------

    def adapter_for(self, version: int) -> str:
        """The PEFT adapter serving `version` now (pin it, or use forward/generate, to keep it from being reused)."""
        with self._cond:
            return self._key_of(version)

    @contextmanager
    def pin(self, versions: list[int]):
        """Hold these versions' slots for the duration: yields their adapter names, one per version."""
        with self._pinned(list(versions)) as (_, names):
            yield names

    def forward(self, versions: list[int], **inputs):
        """The model's forward over a batch whose row i runs version versions[i]."""
        import torch

        with self.pin(versions) as names, self.run_lock, torch.no_grad():
            return self.model(**inputs, adapter_names=names)

    def generate(self, versions: list[int], **kw):
        """model.generate over a batch whose row i runs version versions[i]."""
        with self.pin(versions) as names, self.run_lock:
            return self.model.generate(**kw, adapter_names=names)

    def tensors_of(self, version: int) -> dict:
        """The adapter tensors serving `version` (views of the live parameters: read them, never write)."""
        return self._views(self.adapter_for(version))

    def digest(self, version: int | None = None) -> str:
        """snapshot.digest of a version's adapter (the newest committed one by default)."""
        with self._cond:
            key = self._base() if version is None else self._key_of(version)
        return digest(as_state(self._views(key)))


def _adapter_params(model, adapter: str) -> dict:
    """Publisher name (peft's adapter_state naming) -> the Parameter holding it, for one adapter."""
    from .peft import adapter_state

    params = {storage_key(p.detach()): p for p in model.parameters()}
    views = adapter_state(model, adapter)
    lost = [n for n, t in views.items() if storage_key(t) not in params]
    if lost:
        raise MismatchError(f"adapter {adapter!r}: {lost[:3]} are not parameters of the model")
    return {n: params[storage_key(t)] for n, t in views.items()}


def _match(params: dict, first: str) -> None:
    """Every slot holds the first slot's names in parameters of its own; their dtypes and devices are made the first
    slot's (peft may upcast the adapters it adds)."""
    import torch

    want = params[first]
    for slot, got in params.items():
        if got.keys() != want.keys():
            raise MismatchError(f"adapter {slot!r} has other tensors than {first!r}: "
                                f"{sorted(got.keys() ^ want.keys())[:5]}")
    if len({id(p) for got in params.values() for p in got.values()}) != len(want) * len(params):
        raise MismatchError(f"adapters {sorted(params)} share parameters: peft told their names apart wrongly")
    with torch.no_grad():
        for slot, got in params.items():
            for n, p in got.items():
                if (p.dtype, p.device) != (want[n].dtype, want[n].device):
                    p.data = p.data.to(want[n].device, want[n].dtype)
                if slot != first:
                    p.requires_grad_(False)


class TwoInstances(_Held):
    """Full weights in two instances of one architecture: a version goes into the standby, then switches live.

    Each update brings the standby to the live instance's bytes (only the tensors where they may differ: those the
    last version wrote, everything at first), writes the version into it and, at the commit, makes it live; the
    instance that was live keeps serving the version before. While the standby is being written its old version
    takes no new requests; requests already pinned to it are waited for (Pinning). A refused version writes back
    what it overwrote in the standby (a host copy of those tensors is kept until the commit), so both instances
    serve what they served before.

    Pass engines.HF's naming options (rename=, names=, fused=, select=, experts=) when the trainer's names differ
    from the model's. ``pin(version)`` yields (version, model): run the request on that model.

    On a GPU, ``tensors()`` are host copies read from the device at each call (the Subscriber's in-place device
    apply would write the live instance), so each version also costs a few reads of the model over PCIe.
    """

    def __init__(self, live, standby, *, pinning: Pinning | None = None, **hf):
        super().__init__(pinning)
        self.instances = (HF(live, **hf), HF(standby, **hf))
        self._live = 0
        self._differ: set | None = None  # names where the two instances may hold other bytes; None: all
        shapes = [{n: _meta(t) for n, t in e.live().items()} for e in self.instances]
        if shapes[0] != shapes[1]:
            diff = sorted(n for n in shapes[0].keys() | shapes[1].keys() if shapes[0].get(n) != shapes[1].get(n))
            raise MismatchError(f"the two instances hold different tensors: {diff[:5]} ({len(diff)} differ); "
                                f"build both from the same architecture and dtype")

    # -- what the Subscriber sees -----------------------------------------------------------------

    def tensors(self) -> dict:
        with self._cond:
            key = self._pending.key if self._pending is not None and self._pending.ready else self._live
        return {n: _read_only(t) for n, t in self.instances[key].live().items()}

    def load(self, named: dict) -> None:
        self._guarded_load(named, self._write)

    def _write(self, named: dict) -> None:
        live = self.instances[self._live].live()
        named = _checked(named, {n: _meta(t) for n, t in live.items()})
        if self._pending is None:
            standby = 1 - self._live
            with self._cond:  # from here its version takes no new requests
                retired = {v: k for v, k in self._held.items() if k == standby}
                for v in retired:
                    del self._held[v]
                self._pending = _Pending(key=standby, retired=retired)
            self._wait_unpinned([standby])
            sync = (set(live) if self._differ is None else self._differ) - set(named)
            self._save(sync | set(named))
            self.instances[standby].load({n: _source(live[n]) for n in sync})
            with self._cond:
                self._pending.ready = True
        self._save(set(named) - set(self._pending.undo))
        self._pending.written |= set(named)
        self.instances[self._pending.key].load(named)

    def _save(self, names: set) -> None:
        standby = self.instances[self._pending.key].live()
        self._pending.undo.update({n: _owned(standby[n]) for n in names})

    def _commit(self, v: int) -> None:
        if self._pending is not None and self._pending.ready:
            self._live, self._differ = self._pending.key, set(self._pending.written)
        self._held[v] = self._live

    def _restore(self, pending: _Pending) -> None:
        if pending.undo:
            self.instances[pending.key].load(pending.undo)
        self._held.update(pending.retired)
        self._held = dict(sorted(self._held.items()))

    # -- serving ------------------------------------------------------------------------------

    @contextmanager
    def pin(self, version: int | None = None):
        """Hold the instance serving `version` (None: the newest) for the duration; yields (version, model)."""
        with self._pinned([version]) as ((version,), (key,)):
            yield version, self.instances[key].model

    def forward(self, version: int | None, *args, **kw):
        """The forward pass of the instance serving `version` (None: the newest)."""
        import torch

        with self.pin(version) as (_, model), torch.no_grad():
            return model(*args, **kw)

    def tensors_of(self, version: int) -> dict:
        """Publisher name -> views of the instance serving `version` (read them, never write)."""
        with self._cond:
            return self.instances[self._key_of(version)].live()

    def digest(self, version: int | None = None) -> str:
        """snapshot.digest of the instance serving a version (the newest by default)."""
        with self._cond:
            key = self._live if version is None else self._key_of(version)
        return self.instances[key].digest()


def _source(t):
    """A torch tensor with t's values: t itself, or the gathered pieces of experts presented as one tensor."""
    if isinstance(t, TensorBits):
        return to_torch(TensorBits(t.dtype, t.shape, as_array(t.bits)))
    return t


def _owned(t):
    """A host copy of t's bytes, to write back if the version fails."""
    if isinstance(t, TensorBits):
        return to_torch(TensorBits(t.dtype, t.shape, as_array(t.bits).copy()))
    return t.detach().to("cpu", copy=True)
