"""LoRA adapter versions into vLLM's LoRA manager from memory: no adapter folders, no reload from disk.

vLLM (0.32) loads a LoRA adapter only from a path: ``WorkerLoRAManager._load_adapter``
reads ``adapter_config.json`` and ``adapter_model.safetensors`` and builds a
``LoRAModel``, cached by ``lora_int_id``. Here the adapter's versions arrive over
a wsync transport into each vLLM worker (a Subscriber beside the worker, as for
full weights), and each version is built into a ``LoRAModel`` straight from the
received tensors (``LoRAModel.from_lora_tensors``, what vLLM's own loader ends
in) and put in place of the previous one under the same id, by vLLM's own
in-place replacement (``add_adapter`` of a request with ``load_inplace=True``).

The worker's ``_load_adapter`` is wrapped (on that one manager instance) so that
whenever vLLM builds an adapter whose path is ``wsync://...`` (after its LRU
cache evicted it, or after a base-weight update cleared every adapter) it builds
it from the tensors held here; any other path goes to vLLM's loader unchanged.

Requests name the adapter with an ordinary ``LoRARequest`` (``lora_request``):
its path carries the version, so vLLM's prefix cache, whose block keys include
the LoRA path, never reuses blocks computed with an older version. Driver side,
through ``wsync.engines.vllm.WsyncWorkerExtension``::

    llm = LLM(model, enable_lora=True, max_lora_rank=8,
              worker_extension_cls="wsync.engines.vllm.WsyncWorkerExtension")
    llm.collective_rpc("wsync_lora_subscribe", args=(address, token_id(TOKEN), "policy", 1, config))
    pub.publish(wsync.engines.peft.adapter_state(peft_model), version=v)      # trainer
    llm.collective_rpc("wsync_lora_update", args=(v,))
    llm.generate(prompts, params, lora_request=lora_request("policy", 1, v))

``config`` is the adapter's LoraConfig as JSON values (``wsync.engines.peft.config_dict``).

Several versions at once (``keep``). Continual learning keeps more than one version live: a request that
started on version k runs on k while k+1 lands (TRL serves max_staleness+1 versions), as ``slots.LoraSlots``
does for PEFT. Subscribed with ``keep=N`` (the sixth argument of ``wsync_lora_subscribe``), a worker holds the
N newest committed versions, each servable under an id of its own, so that one batch mixes them::

    llm.collective_rpc("wsync_lora_subscribe", args=(address, token_id(TOKEN), "policy", 1, config, 2))
    reqs = pinned_requests(llm, "policy", 1, [7, 8, 7])     # one per prompt; NotHeld names the versions held
    llm.generate(prompts, params, lora_request=reqs)

- Ids. vLLM tells adapters apart by ``lora_int_id`` alone (its cache, its slots, the scheduler's count of
  adapters per step), so two versions live at once need two ids, and the driver must be able to compute them
  without asking the worker. ``version_id(lora_int_id, v)`` is ``2**30 | lora_int_id << 16 | v % 2**16``: an
  int32 (vLLM's model runner keeps request ids in int32 arrays), and from 2**30 up, away from the ids users
  give their own adapters (keep those below 2**30; a wsync adapter's own id below 2**14). Ids are not slots:
  vLLM puts whichever adapters a step needs into its ``max_loras`` slots (``lora_index_to_id``) and its
  ``max_cpu_loras`` cache, and evicts the least recently used; a held version that vLLM evicted is rebuilt
  from the tensors held here at its next request. Start vLLM with ``max_loras`` of at least the versions one
  batch mixes: its scheduler puts at most ``max_loras`` adapters in a step, and runs the rest in turns.
- Pinned requests are named ``<name>@<v>``: vLLM's LoRARequest compares and hashes by name, and the worker
  gathers a step's requests in a set, where two versions under one name would be one.
- The plain id (``lora_request(name, id)``) still serves the newest version, replaced in place at each
  update; that replacement is also the check every version passes (vLLM's own load and activation into a
  slot) before it is held. A version refused there changes nothing held: the held versions' tensors are
  written only at the commit, and the plain id gets the newest one back (the Subscriber's rollback).
- The newest version is served from the host copy the Subscriber applies deltas to; at the next update, before
  that copy is written, the versions it stood for are copied (with keep=1, never: memory as before).
- A version leaves the held set when N newer ones are committed. vLLM may keep its LoRAModel cached until its
  LRU evicts it, so a request still running on it finishes on its own bytes; it is never rebuilt. A request
  for a version not held therefore fails only where vLLM has to build it, inside a step, which vLLM 0.32
  treats as fatal to its engine: build pinned requests with ``pinned_requests`` (it asks the workers what they
  hold, and refuses here), and under ``vllm serve`` choose N so no request outlives its version's place.
- Versions equal modulo 2**16 share an id: the older one leaves the held set when the newer one is committed,
  and vLLM's cached copy under that id is dropped then.

vLLM has no public verb for an adapter from memory, so this leans on the worker
manager's internals as vLLM 0.32 has them (``vllm/lora/worker_manager.py``:
``_load_adapter``, ``_adapter_manager``, ``_lora_model_cls``; the adapter
manager's ``modules``, ``packed_modules``, ``lora_index_to_id``; the layers'
``lora_a_stacked`` / ``lora_b_stacked``). They are not in signatures.json (a
0.33.0 wheel's public calls); tests/test_vllm_lora_real.py runs them for real.
"""
from __future__ import annotations

import base64
import logging
from collections import OrderedDict

from ..errors import NotHeld
from ..snapshot import TensorBits
from .staged import Staged, current_tensors

log = logging.getLogger("wsync.engines.vllm_lora")
SCHEME = "wsync://"  # the lora_path of an adapter served from memory
PINNED = 1 << 30  # pinned versions' ids start here: below it, users' own ids; vLLM's end at 2**31 - 1 (int32)
ADAPTER_BITS, VERSION_BITS = 14, 16  # a pinned id: PINNED | adapter id << VERSION_BITS | version % 2**VERSION_BITS


def version_id(lora_int_id: int, version: int) -> int:
    """The lora_int_id a pinned request for `version` of the wsync adapter `lora_int_id` carries."""
    if not 1 <= lora_int_id < 1 << ADAPTER_BITS:
        raise ValueError(f"pinned versions need the adapter's lora_int_id in [1, {1 << ADAPTER_BITS}) (its versions' "
                         f"ids are {PINNED} | id << {VERSION_BITS} | version, an int32), got {lora_int_id}")
    if version < 0:
        raise ValueError(f"a version is >= 0, got {version}")
    return PINNED | lora_int_id << VERSION_BITS | version % (1 << VERSION_BITS)


def lora_request(lora_name: str, lora_int_id: int, version: int | None = None, *, pin: bool = False):
    """The LoRARequest for generate(): an adapter from memory.

    pin=False: the newest version the worker committed, under the adapter's own id (`version` only goes in the
    path, for the prefix cache's keys). pin=True: `version` itself, under its own id (version_id), as long as
    the worker holds it (subscribed with keep > 1 to hold more than the newest); ``pinned_requests`` checks."""
    from vllm.lora.request import LoRARequest

    if not pin:
        path = f"{SCHEME}{lora_name}" + ("" if version is None else f"@{version}")
        return LoRARequest(lora_name=lora_name, lora_int_id=lora_int_id, lora_path=path)
    if version is None:
        raise ValueError("a pinned request names its version")
    version = int(version)
    # a name of its own: LoRARequest compares and hashes by name, and vLLM gathers a step's requests in a set
    return LoRARequest(lora_name=f"{lora_name}@{version}", lora_int_id=version_id(lora_int_id, version),
                       lora_path=f"{SCHEME}{lora_name}@{version}")


def pinned_requests(llm, lora_name: str, lora_int_id: int, versions) -> list:
    """One pinned LoRARequest per entry of `versions` (a list for generate's lora_request, one per prompt),
    after asking every worker which versions it holds (one collective_rpc). A version some worker does not
    hold raises NotHeld here, naming those it holds; inside a vLLM step it would stop vLLM's engine."""
    versions = [int(v) for v in versions]
    for rank, st in enumerate(llm.collective_rpc("wsync_lora_status", args=(lora_int_id,))):
        missing = sorted(set(versions) - set(st["held"]))
        if missing:
            raise NotHeld(_not_held(lora_name, lora_int_id, missing, st["held"], f" (worker {rank})"))
    return [lora_request(lora_name, lora_int_id, v, pin=True) for v in versions]


def _not_held(lora_name: str, lora_int_id: int, versions: list, held: list, where: str = "") -> str:
    why = f"it holds versions {sorted(held)}" if held else "it holds no version yet (call wsync_lora_update)"
    return (f"wsync adapter {lora_name!r} (lora_int_id {lora_int_id}){where} does not hold version"
            f"{'s' if len(versions) > 1 else ''} {', '.join(map(str, versions))}: {why}; pin a version it holds "
            f"(one that left comes back only by publishing it again; subscribe with a larger keep to hold more)")


class VLLMLoRA(Staged):
    """One adapter in one vLLM worker's LoRA manager, exact: each version replaces the last under its id, and
    the `keep` newest committed versions are each served under an id of their own (version_id).

    manager: the worker's ``WorkerLoRAManager`` (``worker.model_runner.lora_manager``).
    config: the adapter's LoraConfig as JSON values (r, lora_alpha, target_modules, ...).
    keep: how many committed versions pinned requests can name (1: the newest only).
    The digest is of the host copy of the newest version (what was handed to vLLM); ``held_tensors`` reads back
    what vLLM's layers compute with.
    """

    def __init__(self, manager, *, lora_name: str, lora_int_id: int, config: dict, keep: int = 1):
        if type(keep) is not int or keep < 1:
            raise ValueError(f"keep must be a positive int (versions served at once), got {keep!r}")
        if not 1 <= lora_int_id < PINNED:
            raise ValueError(f"lora_int_id must be in [1, {PINNED}) (vLLM wants >= 1; from {PINNED} up are the ids "
                             f"of pinned versions), got {lora_int_id}")
        if keep > 1:
            version_id(lora_int_id, 0)  # the adapter's id must leave room for its versions' ids
        self.keep = keep
        # committed version -> its tensors (TensorBits by name), oldest first; None: the host copy (the newest)
        self._held: OrderedDict[int, dict | None] = OrderedDict()
        super().__init__()
        self.manager, self.lora_name, self.lora_int_id, self.config = manager, lora_name, lora_int_id, dict(config)
        self._pending = None  # the version being pushed, which _load_adapter builds while push runs
        install(manager)
        manager._wsync_adapters[lora_int_id] = self
        slots = manager.lora_config.max_loras
        if keep > slots:
            log.warning("%s holds %d versions, vLLM runs at most max_loras=%d adapters in one step: a batch mixing "
                        "more runs in turns", lora_name, keep, slots)

    # -- the Subscriber's side ------------------------------------------------------------------

    @property
    def version(self) -> int | None:
        return self._version

    @version.setter
    def version(self, v: int | None) -> None:
        """The commit (the Subscriber sets it once the version's digest matched): v joins the held versions."""
        self._version = v
        if v is None:
            return
        with self.lock:
            for old in [u for u in self._held if u != v and (u - v) % (1 << VERSION_BITS) == 0]:
                del self._held[old]  # v takes its id
            self._held[v] = None
            self._held.move_to_end(v)
            while len(self._held) > self.keep:
                self._held.popitem(last=False)
            if self.lora_int_id < 1 << ADAPTER_BITS:
                # whatever vLLM still caches under v's id is an older version that had it: requests for v rebuild
                self.manager.remove_adapter(version_id(self.lora_int_id, v))

    def load(self, named: dict) -> None:
        self._keep_held()
        super().load(named)

    def replace(self, state) -> None:
        self._keep_held()
        super().replace(state)

    def _keep_held(self) -> None:
        """Copy the host copy for the held versions that stand on it, before an update writes it."""
        if self.keep == 1:
            return  # the one held version leaves at the next commit; a refused version gets the copy back
        with self.lock:
            on_copy = [v for v, t in self._held.items() if t is None]
            if on_copy:
                copy = {n: TensorBits(tb.dtype, tb.shape, tb.bits.copy()) for n, tb in self.shadow.state.items()}
                for v in on_copy:
                    self._held[v] = copy

    def push(self, named: dict, *, whole: bool) -> None:
        self._pending = current_tensors(self, named, whole)  # the whole adapter, as _load_adapter will build it
        try:
            self.manager.add_adapter(self.request(load_inplace=True))  # vLLM's own replace: load, remove, add, activate
        except BaseException:
            # vLLM removes the old adapter before it activates the new one: if that fails (a shape its slots do
            # not take), drop whatever got registered; the next request rebuilds the version still held here
            self.manager.remove_adapter(self.lora_int_id)
            raise
        finally:
            self._pending = None

    # -- vLLM's side ----------------------------------------------------------------------------

    def request(self, *, load_inplace: bool = False):
        from vllm.lora.request import LoRARequest

        return LoRARequest(lora_name=self.lora_name, lora_int_id=self.lora_int_id, lora_path=SCHEME + self.lora_name,
                           load_inplace=load_inplace)

    @property
    def held(self) -> list[int]:
        """The versions a pinned request can name now, oldest first."""
        with self.lock:
            return list(self._held)

    def build(self, lora_request=None):
        """A fresh LoRAModel, as vLLM's _load_adapter builds one: under the adapter's own id the newest version
        (or the one being pushed); under a pinned id (version_id) that version, if held."""
        from ..snapshot import to_torch

        lora_int_id = self.lora_int_id if lora_request is None else lora_request.lora_int_id
        with self.lock:
            if lora_int_id == self.lora_int_id:
                pending = self._pending
                state = None if pending is not None else self.shadow.state
            else:
                version = _pinned_version(lora_request)
                if version_id(self.lora_int_id, version) != lora_int_id:
                    raise ValueError(f"LoRA request {lora_request.lora_name!r}: id {lora_int_id} is not version "
                                     f"{version}'s ({version_id(self.lora_int_id, version)}); use lora_request")
                if version not in self._held:
                    raise NotHeld(_not_held(self.lora_name, self.lora_int_id, [version], list(self._held)))
                pending, state = None, self._held[version]
                state = self.shadow.state if state is None else state
            # clones: vLLM folds the scaling into lora_b in place (LoRALayerWeights.optimize), and tensors of the
            # right dtype and device are not copied on the way in; the host copy must keep the published bytes
            tensors = {n: t.clone() for n, t in pending.items()} if pending is not None \
                else {n: to_torch(tb).clone() for n, tb in state.items()}
        if not tensors:
            raise RuntimeError(f"wsync adapter {self.lora_name!r} (id {self.lora_int_id}) has no version yet: "
                               f"call wsync_lora_update first")
        return build_lora_model(self.manager, lora_int_id, tensors, self.config)

    def status(self) -> dict:
        adapters = self.manager._adapter_manager
        return {"loaded": self.lora_int_id in self.manager.list_adapters(),
                "slot": _slot(adapters, self.lora_int_id), "held": self.held}


def _pinned_version(lora_request) -> int:
    """The version a pinned request's path names (wsync://<name>@<version>)."""
    _, _, version = lora_request.lora_path[len(SCHEME):].rpartition("@")
    try:
        return int(version)
    except ValueError:
        raise ValueError(f"LoRA request {lora_request.lora_name!r} (id {lora_request.lora_int_id}) has the id of a "
                         f"pinned version but its path {lora_request.lora_path!r} names none; use lora_request(..., "
                         f"pin=True)") from None


def install(manager) -> None:
    """Wrap this worker manager's _load_adapter: wsync:// paths are built from memory (idempotent)."""
    if hasattr(manager, "_wsync_adapters"):
        return
    manager._wsync_adapters = {}
    original = manager._load_adapter

    def _load_adapter(lora_request):
        if not lora_request.lora_path.startswith(SCHEME):
            return original(lora_request)
        lora_int_id = lora_request.lora_int_id
        if lora_int_id >= PINNED:  # a pinned version: the adapter's id is in the middle bits
            lora_int_id = lora_int_id >> VERSION_BITS & ((1 << ADAPTER_BITS) - 1)
        engine = manager._wsync_adapters.get(lora_int_id)
        if engine is None:
            raise ValueError(f"no wsync adapter with lora_int_id {lora_int_id} in this worker "
                             f"(have {sorted(manager._wsync_adapters)}); call wsync_lora_subscribe first")
        return engine.build(lora_request)

    manager._load_adapter = _load_adapter


def build_lora_model(manager, lora_int_id: int, tensors: dict, config: dict):
    """vLLM's WorkerLoRAManager._load_adapter, from tensors and a config dict instead of a folder."""
    from vllm.lora.peft_helper import PEFTHelper

    adapters = manager._adapter_manager
    helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    model = adapters.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    mapper = mapper.get_rename_mapper() if mapper is not None else None
    skip = getattr(model, "lora_skip_prefixes", None)
    _check_modules(adapters, tensors, helper, mapper)
    lora = manager._lora_model_cls.from_lora_tensors(
        lora_model_id=lora_int_id, tensors=tensors, peft_helper=helper, device="cpu",
        dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size, weights_mapper=mapper,
        skip_prefixes=skip)
    for check in ("_validate_moe_lora_format", "_validate_modules_to_save", "_validate_token_classification_lora"):
        if hasattr(adapters, check):  # vLLM's own checks of a loaded adapter, where this version has them
            getattr(adapters, check)(lora)
    return lora


def _check_modules(adapters, tensors: dict, helper, mapper) -> None:
    """Refuse an adapter for modules this model does not LoRA-wrap (vLLM's from_local_checkpoint does the same)."""
    from vllm.lora.utils import is_base_embedding_weights, parse_fine_tuned_lora_name

    expected = set()
    for module in adapters.supported_lora_modules:
        expected.update(adapters.packed_modules_mapping.get(module, [module]))
    allowed = expected | set(helper.modules_to_save or ())
    modules = {parse_fine_tuned_lora_name(n, mapper)[0] for n in tensors if not is_base_embedding_weights(n)}
    bad = sorted(m for m in modules if m.rsplit(".", 1)[-1] not in allowed and ".experts" not in m)
    if bad:
        raise ValueError(f"the adapter has LoRA weights for modules vLLM does not wrap in this model: {bad}; "
                         f"it wraps {sorted(expected)}")


def held_tensors(manager, lora_int_id: int) -> dict:
    """The adapter as vLLM's layers compute with it, read from the LoRA slot it is active in.

    {"slot": i, "tensors": {name: base64 bytes}, "dtypes": {...}, "shapes": {...}}, names in PEFT form
    (``base_model.model.<vLLM module>.lora_A.weight``; packed layers such as qkv_proj are split back into
    their parts). lora_B is stored with the adapter's scaling (alpha / r) folded in, as vLLM keeps it; on a
    tensor-parallel worker these are that rank's slices. Linear layers only (no embedding LoRA)."""
    adapters = manager._adapter_manager
    slot, lora = _slot(adapters, lora_int_id), adapters.get_adapter(lora_int_id)
    if slot is None or lora is None:
        raise ValueError(f"LoRA {lora_int_id} is not active in a slot of this worker "
                         f"(slots hold {adapters.lora_index_to_id})")
    held = {}
    for module_name, module in adapters.modules.items():
        weights = lora.get_lora(module_name)
        if weights is None:
            continue
        parts = adapters.packed_modules.get(module_name, [module_name])
        a_parts = weights.lora_a if isinstance(weights.lora_a, list) else [weights.lora_a]
        b_parts = weights.lora_b if isinstance(weights.lora_b, list) else [weights.lora_b]
        for i, (part, a, b) in enumerate(zip(parts, a_parts, b_parts)):
            if a is None:
                continue
            # the slot is max_lora_rank wide: the adapter's rows (A) and columns (B) of it
            held[f"base_model.model.{part}.lora_A.weight"] = module.lora_a_stacked[i][slot, 0, :a.shape[0], :a.shape[1]]
            held[f"base_model.model.{part}.lora_B.weight"] = module.lora_b_stacked[i][slot, 0, :b.shape[0], :b.shape[1]]
    return {"slot": slot, **encode(held)}


def encode(tensors: dict) -> dict:
    """{"tensors": {name: base64 of the bytes}, "dtypes": ..., "shapes": ...}: JSON for collective_rpc and HTTP."""
    import torch

    out = {"tensors": {}, "dtypes": {}, "shapes": {}}
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        out["tensors"][name] = base64.b64encode(t.view(-1).view(torch.uint8).numpy().tobytes()).decode()
        out["dtypes"][name], out["shapes"][name] = str(t.dtype).removeprefix("torch."), list(t.shape)
    return out


def _slot(adapters, lora_int_id: int) -> int | None:
    ids = list(adapters.lora_index_to_id)
    return ids.index(lora_int_id) if lora_int_id in ids else None
