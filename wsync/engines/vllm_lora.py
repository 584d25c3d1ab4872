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
it from the tensors held here, the newest committed version; any other path goes
to vLLM's loader unchanged.

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

vLLM has no public verb for an adapter from memory, so this leans on the worker
manager's internals as vLLM 0.32 has them (``vllm/lora/worker_manager.py``:
``_load_adapter``, ``_adapter_manager``, ``_lora_model_cls``; the adapter
manager's ``modules``, ``packed_modules``, ``lora_index_to_id``; the layers'
``lora_a_stacked`` / ``lora_b_stacked``). They are not in signatures.json (a
0.33.0 wheel's public calls); tests/test_vllm_lora_real.py runs them for real.
"""
from __future__ import annotations

import base64

from .staged import Staged, current_tensors

SCHEME = "wsync://"  # the lora_path of an adapter served from memory


def lora_request(lora_name: str, lora_int_id: int, version: int | None = None):
    """The LoRARequest for generate(): an adapter from memory, at `version` (kept in the path for the prefix
    cache's keys; the worker serves the newest version it committed)."""
    from vllm.lora.request import LoRARequest

    path = f"{SCHEME}{lora_name}" + ("" if version is None else f"@{version}")
    return LoRARequest(lora_name=lora_name, lora_int_id=lora_int_id, lora_path=path)


class VLLMLoRA(Staged):
    """One adapter in one vLLM worker's LoRA manager, exact: each version replaces the last under its id.

    manager: the worker's ``WorkerLoRAManager`` (``worker.model_runner.lora_manager``).
    config: the adapter's LoraConfig as JSON values (r, lora_alpha, target_modules, ...).
    The digest is of the host copy (what was handed to vLLM); ``held_tensors`` reads back what vLLM's
    layers compute with.
    """

    def __init__(self, manager, *, lora_name: str, lora_int_id: int, config: dict):
        super().__init__()
        if lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1 (vLLM's rule), got {lora_int_id}")
        self.manager, self.lora_name, self.lora_int_id, self.config = manager, lora_name, lora_int_id, dict(config)
        self._pending = None  # the version being pushed, which _load_adapter builds while push runs
        install(manager)
        manager._wsync_adapters[lora_int_id] = self

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

    def request(self, *, load_inplace: bool = False):
        from vllm.lora.request import LoRARequest

        return LoRARequest(lora_name=self.lora_name, lora_int_id=self.lora_int_id, lora_path=SCHEME + self.lora_name,
                           load_inplace=load_inplace)

    def build(self):
        """A fresh LoRAModel of the adapter as held now (or as being pushed), as vLLM's _load_adapter builds one."""
        from ..snapshot import to_torch

        pending = self._pending
        tensors = pending if pending is not None else {n: to_torch(tb) for n, tb in self.shadow.state.items()}
        if not tensors:
            raise RuntimeError(f"wsync adapter {self.lora_name!r} (id {self.lora_int_id}) has no version yet: "
                               f"call wsync_lora_update first")
        # clones: vLLM folds the scaling into lora_b in place (LoRALayerWeights.optimize), and tensors of the
        # right dtype and device are not copied on the way in; the host copy must keep the published bytes
        return build_lora_model(self.manager, self.lora_int_id, {n: t.clone() for n, t in tensors.items()},
                                self.config)

    def status(self) -> dict:
        adapters = self.manager._adapter_manager
        return {"loaded": self.lora_int_id in self.manager.list_adapters(),
                "slot": _slot(adapters, self.lora_int_id)}


def install(manager) -> None:
    """Wrap this worker manager's _load_adapter: wsync:// paths are built from memory (idempotent)."""
    if hasattr(manager, "_wsync_adapters"):
        return
    manager._wsync_adapters = {}
    original = manager._load_adapter

    def _load_adapter(lora_request):
        if not lora_request.lora_path.startswith(SCHEME):
            return original(lora_request)
        engine = manager._wsync_adapters.get(lora_request.lora_int_id)
        if engine is None:
            raise ValueError(f"no wsync adapter with lora_int_id {lora_request.lora_int_id} in this worker "
                             f"(have {sorted(manager._wsync_adapters)}); call wsync_lora_subscribe first")
        return engine.build()

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
