"""vLLM as a wsync engine: a weight-transfer backend, a worker extension, runtime LoRA and the sharded sync.

Nothing here imports vLLM until it is used. The ways in:

1. **Weight-transfer backend** (vLLM >= 0.12's ``WeightTransferEngineFactory``;
   checked against 0.33.0). Start vLLM with
   ``weight_transfer_config={"backend": "wsync"}``; ``register()`` runs in every
   vLLM process through the ``vllm.general_plugins`` entry point. The bytes
   travel over a wsync transport and codec (tcp/ucx/..., delta or raw); vLLM's
   control plane only says which version to apply::

       # token_id(TOKEN) is the token's fingerprint; each vLLM process reads the token
       # itself from WSYNC_TOKEN / WSYNC_TOKEN_FILE (request bodies and RPC arguments get logged)
       client.init_weight_transfer_engine({"address": "tcp://trainer:7070", "token_id": token_id(TOKEN)})
       pub.publish(model.state_dict(), version=v)           # trainer, as usual
       client.start_weight_update(); client.update_weights({"version": v}); client.finish_weight_update()

2. **Worker extension** for the ``collective_rpc`` path (also the way in for 3 and 4)::

       llm = LLM(model, worker_extension_cls="wsync.engines.vllm.WsyncWorkerExtension")
       llm.collective_rpc("wsync_subscribe", args=("tcp://trainer:7070", token_id(TOKEN)))
       llm.collective_rpc("wsync_update", args=(v,))       # between generate() calls

3. **LoRA adapters from memory** (vllm_lora.py): the worker extension's
   ``wsync_lora_subscribe`` / ``wsync_lora_update`` receive a PEFT adapter's
   versions in each worker and put each into vLLM's LoRA manager under the
   same ``lora_int_id``, built from the received tensors (no adapter folder)::

       llm = LLM(model, enable_lora=True, worker_extension_cls="wsync.engines.vllm.WsyncWorkerExtension")
       llm.collective_rpc("wsync_lora_subscribe", args=(address, token_id(TOKEN), "policy", 1, config))
       llm.collective_rpc("wsync_lora_update", args=(v,))
       llm.generate(prompts, params, lora_request=vllm_lora.lora_request("policy", 1, v))

4. **Sharded sync** (vllm_shard.py): each tensor-parallel worker is an engine rank of a routing plan and
   takes only its own slices from the trainer ranks that hold them (``wsync_shard_subscribe``), serving a
   version only when ``vllm_shard.update(llm, v)`` says so, on every worker at once.

In 1 and 2 each worker receives the checkpoint-named state and hands the
changed tensors to ``model.load_weights``, which does the fusing and the
tensor-parallel slicing (see staged.py for what the digest then proves).
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager

from ..errors import BackendUnavailable, WsyncError
from .staged import Staged, current_tensors

BACKEND = "wsync"  # the name registered with vLLM's WeightTransferEngineFactory

# Every vLLM call made here, as (module, qualified name, positional args, keyword names): checked against
# vLLM's published source by tests/test_engines_signatures.py (snapshot in signatures.json).
CALLS = [
    ("vllm.distributed.weight_transfer.factory", "WeightTransferEngineFactory.register_engine", 3, ()),
    ("vllm.distributed.weight_transfer.base", "WeightTransferEngine.__init__", 4, ()),
    ("vllm.v1.worker.gpu_worker", "Worker.get_model", 0, ()),
    ("vllm.lora.request", "LoRARequest", 0, ("lora_name", "lora_int_id", "lora_path", "load_inplace")),
    ("vllm.entrypoints.llm", "LLM.collective_rpc", 1, ("args",)),
    # the driver's side of the weight-transfer round, as docs/engines.md shows it
    ("vllm.entrypoints.rl.offline", "RLOfflineMixin.init_weight_transfer_engine", 1, ()),
    ("vllm.entrypoints.rl.offline", "RLOfflineMixin.start_weight_update", 0, ()),
    ("vllm.entrypoints.rl.offline", "RLOfflineMixin.update_weights", 1, ()),
    ("vllm.entrypoints.rl.offline", "RLOfflineMixin.finish_weight_update", 0, ()),
    # wrapped by onednn_scales_kept: the call vLLM's CPU INT8 layers make passes through it with all five
    ("vllm._custom_ops", "create_onednn_scaled_mm", 5, ()),
]
# Methods of vLLM's base class that the backend overrides, with the parameters vLLM calls them with.
OVERRIDES = [
    ("vllm.distributed.weight_transfer.base", "WeightTransferEngine.init_transfer_engine"),
    ("vllm.distributed.weight_transfer.base", "WeightTransferEngine.start_weight_update"),
    ("vllm.distributed.weight_transfer.base", "WeightTransferEngine.finish_weight_update"),
    ("vllm.distributed.weight_transfer.base", "WeightTransferEngine.receive_weights"),
    ("vllm.distributed.weight_transfer.base", "WeightTransferEngine.shutdown"),
]


def _vllm(what: str):
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise BackendUnavailable(f"{what} needs vLLM: pip install vllm (on a machine with a GPU)") from e


def register() -> None:
    """Register the "wsync" weight-transfer backend with vLLM (idempotent; the plugin entry point)."""
    _vllm("the wsync weight-transfer backend")
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, "wsync.engines.vllm_backend", "WsyncWeightTransferEngine")
    except ValueError:  # already registered in this process
        pass


class LoadWeights(Staged):
    """A wsync engine over any module with vLLM's ``load_weights(iterable of (name, tensor))``.

    layerwise: True: every push is one of vLLM's layerwise reloads (the model's layers restored to
    checkpoint format on ``meta``, fed the whole version, re-processed into kernel format: quantization,
    repacking); False: only the changed tensors, written in place through ``load_weights``; "auto": in
    place unless the model keeps its weights in a kernel format ``load_weights`` cannot write into (vLLM's
    CPU backend prepacks every linear weight for oneDNN and empties the parameter), then layerwise.
    device: where the model's weights live (vLLM's worker device). Never read from the model itself:
    during a layerwise reload its parameters sit on ``meta``.
    model_config: a callable returning vLLM's ModelConfig for the reload's last step (attention layers);
    None: the current vLLM config's.
    """

    def __init__(self, get_model, *, whole: bool = False, layerwise: bool | str = "auto", device=None,
                 model_config=None):
        super().__init__()
        if layerwise not in (True, False, "auto"):
            raise ValueError(f"layerwise must be True, False or 'auto', got {layerwise!r}")
        self.whole = whole  # push every tensor each version (for loaders that need whole layers)
        self.layerwise, self.device, self._model_config = layerwise, device, model_config
        self._get_model = get_model if callable(get_model) and not hasattr(get_model, "load_weights") \
            else (lambda: get_model)

    def push(self, named: dict, *, whole: bool) -> None:
        model = self._get_model()
        device = self.device if self.device is not None else _device_of(model)
        layerwise = self.layerwise if self.layerwise != "auto" else kernel_format(model)
        if layerwise or self.whole:
            named = current_tensors(self, named, whole)  # a layer is re-processed once all of it arrived
        # one tensor on the device at a time: vLLM's loader takes an iterable, and the whole version at once
        # would need a model's worth of free device memory beside the model
        weights = ((n, t.to(device)) for n, t in named.items())
        if not layerwise:
            model.load_weights(weights)
            return
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        # one whole reload per version, as vLLM's own reload_weights does: a second version applied in the
        # same start/finish window would otherwise be dropped as "excessive loading", and so would a rollback
        with onednn_scales_kept():
            initialize_layerwise_reload(model)
            try:
                model.load_weights(weights)
            finally:
                finalize_layerwise_reload(model, self.model_config())

    def model_config(self):
        if self._model_config is not None:
            return self._model_config()
        from vllm.config import get_current_vllm_config

        return get_current_vllm_config().model_config


@contextmanager
def onednn_scales_kept():
    """Inside: every oneDNN INT8 GEMM handler vLLM's CPU backend makes keeps the weight-scale tensor it reads.

    The handler (W8A8 INT8 layers, ``create_onednn_scaled_mm``) reads the scales through a pointer into the
    tensor it was made with. A layerwise reload makes it from the reloaded layer's own scale tensor, copies the
    values into the tensor the layer held before and drops the new one: the handler would then read freed
    memory. Wrap any layerwise reload of a quantized model on vLLM's CPU backend in this."""
    try:
        from vllm import _custom_ops as ops
    except ImportError:
        ops = None
    make = getattr(ops, "create_onednn_scaled_mm", None)
    if make is None:
        yield
        return

    def keeping(weight, weight_scales, *args, **kwargs):
        handler = make(weight, weight_scales, *args, **kwargs)
        handler.wsync_weight_scales = weight_scales
        return handler

    ops.create_onednn_scaled_mm = keeping
    try:
        yield
    finally:
        ops.create_onednn_scaled_mm = make


def kernel_format(model) -> bool:
    """True when some layer computes with a prepacked copy of its weight that load_weights cannot reach: vLLM's
    CPU GEMM dispatch gives a layer ``cpu_linear`` (a oneDNN/packed weight) and empties the parameter, and its
    quantized CPU kernels (W8A8 INT8's oneDNN handler) keep the weight in the kernel and set the parameter to
    None. A model quantized on every Linear has no ``cpu_linear`` at all: the released weight tells (a bias
    registered as None is only a layer without one)."""
    return any(getattr(m, "cpu_linear", None) is not None or ("weight" in m._parameters and m.weight is None)
               for m in model.modules())


def _device_of(model):
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return "cpu"


class WsyncWorkerExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``); methods are called by ``collective_rpc``."""

    def wsync_subscribe(self, address: str, token_id: str | None = None, layerwise: bool | str = "auto") -> None:
        """token_id: the token's fingerprint (wsync.integrations.common.token_id); RPC arguments get logged,
        so the token itself comes from WSYNC_TOKEN / WSYNC_TOKEN_FILE in each worker's environment.
        layerwise: as LoadWeights (on vLLM's CPU backend "auto" reloads layerwise)."""
        from ..tokens import engine_token
        from ..subscriber import Subscriber

        self.wsync_engine = LoadWeights(self.get_model, layerwise=layerwise, device=getattr(self, "device", None),
                                        model_config=lambda: self.vllm_config.model_config)
        self.wsync_sub = Subscriber(address, engine=self.wsync_engine, token=engine_token(token_id),
                                    apply="poll")  # applied only inside wsync_update, between generate() calls

    def wsync_update(self, version: int, timeout: float | None = 600.0) -> int:
        with _vllm_config(self):  # vLLM's loaders and layer post-processing read the current config
            return self.wsync_sub.wait_for(version, timeout=timeout)

    def wsync_status(self) -> dict:
        """This worker's wsync state: through this extension, else through the "wsync" transfer backend."""
        sub, engine = getattr(self, "wsync_sub", None), getattr(self, "wsync_engine", None)
        if sub is None:  # the weight-transfer backend, if that is what this worker runs
            backend = getattr(self, "weight_transfer_engine", None)
            sub, engine = getattr(backend, "sub", None), getattr(backend, "engine", None)
        if sub is None:
            return {"version": None, "digest": None, "failures": 0}
        return {"version": sub.version, "digest": engine.digest(), "failures": sub.stats.failures}

    def wsync_close(self) -> None:
        self.wsync_sub.close()

    # The sharded sync (vllm_shard.py): this worker is engine rank tp_rank of a routing plan it computes itself.

    def wsync_shard_subscribe(self, coordinator: str, token_id: str | None, trainer: dict, params: dict,
                              vllm_opts: dict | None = None) -> str:
        """trainer: {"ranks": M, "placements": "fsdp" | {...}}; params: trainer name -> [shape, dtype].
        Returns the plan's hash (the trainer ranks' must be the same)."""
        from vllm.distributed import parallel_state as ps

        from ..tokens import engine_token
        from . import vllm_shard

        if ps.get_pp_group().world_size != 1:
            raise WsyncError("the sharded sync takes tensor parallelism only (pipeline_parallel_size must be 1)")
        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        if getattr(self, "wsync_shard", None) is not None:  # subscribing again replaces the last one
            self.wsync_shard.close()
            self.wsync_shard = None
        plan = vllm_shard.build_plan(params, trainer, self.vllm_config.model_config.hf_config.to_dict(), tp,
                                     **(vllm_opts or {}))
        self.wsync_shard = vllm_shard.ShardedWorker(self.get_model(), plan, rank, coordinator=coordinator,
                                                    token=engine_token(token_id), device=getattr(self, "device", None))
        return plan.hash

    def wsync_shard_update(self, version: int, timeout: float | None = 600.0) -> int:
        with _vllm_config(self):  # the layers' re-processing reads the current config
            return self.wsync_shard.update(version, timeout)

    def wsync_shard_status(self) -> dict:
        return self.wsync_shard.status()

    def wsync_shard_digests(self) -> dict:
        return self.wsync_shard.digests()

    def wsync_shard_close(self) -> None:
        self.wsync_shard.close()

    # LoRA adapters from memory (vllm_lora.py): one Subscriber and one adapter per lora_int_id.
    # Over the dev-mode HTTP route /collective_rpc arguments arrive as strings: config may be JSON text.

    def wsync_lora_subscribe(self, address: str, token_id: str | None = None, lora_name: str = "wsync",
                             lora_int_id: int = 1, config: dict | str | None = None, keep: int = 1) -> None:
        """Follow a Publisher of one PEFT adapter's versions (``engines.peft.adapter_state``).
        config: its LoraConfig as JSON values (``engines.peft.config_dict``): r, lora_alpha, target_modules.
        keep: how many of the newest committed versions pinned requests can name (vllm_lora.pinned_requests)."""
        from ..tokens import engine_token
        from ..subscriber import Subscriber
        from .vllm_lora import VLLMLoRA

        manager = getattr(getattr(self, "model_runner", None), "lora_manager", None)
        if manager is None:
            raise RuntimeError("this vLLM worker has no LoRA manager: start vLLM with enable_lora=True "
                               "(--enable-lora) and a max_lora_rank of at least the adapter's r")
        if config is None:
            raise ValueError("wsync_lora_subscribe needs the adapter's config (wsync.engines.peft.config_dict)")
        config = json.loads(config) if isinstance(config, str) else config
        engine = VLLMLoRA(manager, lora_name=lora_name, lora_int_id=int(lora_int_id), config=config, keep=int(keep))
        sub = Subscriber(address, engine=engine, token=engine_token(token_id), apply="poll")
        loras = self.__dict__.setdefault("wsync_loras", {})
        if int(lora_int_id) in loras:
            loras[int(lora_int_id)][0].close()
        loras[int(lora_int_id)] = (sub, engine)

    def wsync_lora_update(self, version: int, timeout: float | None = 600.0, lora_int_id: int | None = None) -> int:
        """Apply `version` of the adapter (or a newer one already received); returns the version now served."""
        sub, _ = self._wsync_lora(lora_int_id)
        return sub.wait_for(int(version), timeout=None if timeout is None else float(timeout))

    def wsync_lora_status(self, lora_int_id: int | None = None) -> dict:
        sub, engine = self._wsync_lora(lora_int_id)
        return {"version": sub.version, "digest": engine.digest(), "failures": sub.stats.failures,
                **engine.status()}

    def wsync_lora_tensors(self, lora_int_id: int | None = None) -> dict:
        """An active adapter as vLLM's layers hold it (vllm_lora.held_tensors: base64 bytes per tensor); None:
        the wsync one. Any adapter in a slot can be read, one loaded from a folder too."""
        from .vllm_lora import held_tensors

        if lora_int_id is None:
            lora_int_id = self._wsync_lora(None)[1].lora_int_id
        return held_tensors(self.model_runner.lora_manager, int(lora_int_id))

    def wsync_lora_close(self, lora_int_id: int | None = None) -> None:
        sub, engine = self._wsync_lora(lora_int_id)
        sub.close()
        del self.wsync_loras[engine.lora_int_id]

    def _wsync_lora(self, lora_int_id):
        loras = getattr(self, "wsync_loras", {})
        if lora_int_id is None and len(loras) == 1:
            return next(iter(loras.values()))
        if lora_int_id is None or int(lora_int_id) not in loras:
            raise ValueError(f"no wsync adapter {lora_int_id!r} in this worker (have {sorted(loras)}); "
                             f"wsync_lora_subscribe first, and name lora_int_id when there are several")
        return loras[int(lora_int_id)]


def _vllm_config(worker):
    from contextlib import nullcontext

    config = getattr(worker, "vllm_config", None)
    if config is None:
        return nullcontext()
    from vllm.config import set_current_vllm_config

    return set_current_vllm_config(config)


def __getattr__(name: str):
    if name in ("VLLMLoRA", "lora_request"):  # the in-memory LoRA engine (vllm_lora.py) replaced the folder-based one
        from . import vllm_lora

        return getattr(vllm_lora, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def write_adapter(directory: str, tensors: dict, config: dict) -> None:
    """A PEFT-format adapter folder (safetensors + JSON; never pickle), each file replaced atomically, for
    loaders that read adapters from disk (vLLM's are put in from memory: vllm_lora.py)."""
    from safetensors.torch import save

    from ..fsutil import atomic_write

    os.makedirs(directory, exist_ok=True)
    with atomic_write(os.path.join(directory, "adapter_model.safetensors")) as f:
        f.write(save({n: t.contiguous() for n, t in tensors.items()}))
    with atomic_write(os.path.join(directory, "adapter_config.json")) as f:
        f.write(json.dumps(config).encode())
