"""SGLang as a wsync engine: drives a running ``sglang.Engine`` (in this process) with what wsync received.

Three verbs of SGLang's offline Engine API, chosen by ``mode``:

- ``"tensor"``: ``update_weights_from_tensor(named_tensors=[(name, tensor)])``;
- ``"distributed"``: ``update_weights_from_distributed(names, dtypes, shapes, group_name)``
  while this adapter broadcasts each tensor to SGLang's workers over a NCCL
  group it joins as rank 0 (``init_weights_update_group``);
- ``"lora"``: ``load_lora_adapter_from_tensors(lora_name, tensors, config_dict)``,
  then ``unload_lora_adapter`` of the previous version's name (load first, so
  requests never find no adapter; ``lora_name`` is the one to send requests to).

What crosses which boundary (SGLang 0.5.23, read from its source):
``update_weights_from_tensor`` and ``load_lora_adapter_from_tensors`` serialize
the tensors with SGLang's ``MultiprocessingSerializer``, which is
``multiprocessing.reduction.ForkingPickler`` with torch's tensor reductions:
the bytes are a pickle whose tensors are shared-memory handles (CPU) or CUDA
IPC handles (GPU), handed over a local ZMQ socket from SGLang's tokenizer
manager to its scheduler processes, which load it with a restricted unpickler.
That pickle never leaves the engine host, and this adapter never sends one
anywhere: the wire from the trainer carries only wsync payloads (JSON manifest
+ raw/delta bytes, checksummed), decoded here into plain tensors; in
``"distributed"`` mode SGLang gets only lists of names, dtype strings and
shapes, and the tensor bytes go over NCCL. Do not expose SGLang's HTTP
``/update_weights_from_tensor`` or ``/load_lora_adapter_from_tensors`` routes
to a network: they accept base64 pickles from whoever can reach them.
"""
from __future__ import annotations

import threading

from ..errors import BackendUnavailable, MismatchError
from .staged import Staged, current_tensors

MODES = ("tensor", "distributed", "lora")

# Every SGLang call made here (module, qualified name, positional args, keyword names), checked against the
# published source by tests/test_engines_signatures.py.
CALLS = [
    ("sglang.srt.entrypoints.engine", "Engine.update_weights_from_tensor", 0,
     ("named_tensors", "load_format", "flush_cache")),
    ("sglang.srt.entrypoints.engine", "Engine.update_weights_from_distributed", 0,
     ("names", "dtypes", "shapes", "group_name", "flush_cache")),
    ("sglang.srt.entrypoints.engine", "Engine.init_weights_update_group", 0,
     ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend")),
    ("sglang.srt.entrypoints.engine", "Engine.load_lora_adapter_from_tensors", 0,
     ("lora_name", "tensors", "config_dict")),
    ("sglang.srt.entrypoints.engine", "Engine.unload_lora_adapter", 0, ("lora_name",)),
    ("sglang.srt.utils.common", "init_custom_process_group", 0,
     ("backend", "init_method", "world_size", "rank", "group_name")),
]


class SGLang(Staged):
    def __init__(self, engine, *, mode: str = "tensor", flush_cache: bool = True, lora_name: str = "wsync",
                 lora_config: dict | None = None, group: dict | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "lora" and not lora_config:
            raise MismatchError("mode='lora' needs lora_config (the adapter's peft LoraConfig.to_dict())")
        super().__init__()
        self.engine, self.mode, self.flush_cache = engine, mode, flush_cache
        self.lora_base, self.lora_config = lora_name, lora_config
        self.lora_name: str | None = None  # the adapter name serving now (send requests with it)
        self._pushes = 0
        self._group = None
        if mode == "distributed":
            self._join(**(group or {}))

    def push(self, named: dict, *, whole: bool) -> None:
        if self.mode == "tensor":
            _ok(self.engine.update_weights_from_tensor(named_tensors=list(named.items()), load_format=None,
                                                       flush_cache=self.flush_cache), "update_weights_from_tensor")
        elif self.mode == "distributed":
            self._broadcast(named)
        else:
            self._swap_lora(current_tensors(self, named, whole))

    def _swap_lora(self, tensors: dict) -> None:
        self._pushes += 1
        name, old = f"{self.lora_base}-{self._pushes}", self.lora_name
        _ok(self.engine.load_lora_adapter_from_tensors(lora_name=name, tensors=tensors, config_dict=self.lora_config),
            "load_lora_adapter_from_tensors")
        self.lora_name = name
        if old is not None:
            _ok(self.engine.unload_lora_adapter(lora_name=old), "unload_lora_adapter")

    # -- "distributed": SGLang's workers receive by NCCL broadcast from us (rank 0) -------------------------

    def _join(self, *, master_address: str = "127.0.0.1", master_port: int = 29531, world_size: int = 2,
              group_name: str = "wsync", backend: str = "nccl") -> None:
        """Join SGLang's TP workers (ranks 1..world_size-1) in a group where this process is rank 0."""
        try:
            from sglang.srt.utils.common import init_custom_process_group
        except ImportError as e:
            raise BackendUnavailable("mode='distributed' needs sglang installed in this process") from e
        result = {}
        t = threading.Thread(target=lambda: result.update(r=self.engine.init_weights_update_group(
            master_address=master_address, master_port=master_port, rank_offset=1, world_size=world_size,
            group_name=group_name, backend=backend)))
        t.start()
        self._group = init_custom_process_group(backend=backend, init_method=f"tcp://{master_address}:{master_port}",
                                                world_size=world_size, rank=0, group_name=group_name)
        t.join()
        self._group_name = group_name

    def _broadcast(self, named: dict) -> None:
        import torch
        import torch.distributed as dist

        names = list(named)
        meta = dict(names=names, dtypes=[str(named[n].dtype).removeprefix("torch.") for n in names],
                    shapes=[list(named[n].shape) for n in names], group_name=self._group_name,
                    flush_cache=self.flush_cache)
        errors = []
        t = threading.Thread(target=lambda: _catch(errors, lambda: _ok(
            self.engine.update_weights_from_distributed(**meta), "update_weights_from_distributed")))
        t.start()
        for n in names:  # the same order as `names`: SGLang receives them one broadcast at a time
            dist.broadcast(named[n].to("cuda", non_blocking=True), src=0, group=self._group)
        torch.cuda.synchronize()
        t.join()
        if errors:
            raise errors[0]


def _catch(errors: list, fn) -> None:
    try:
        fn()
    except BaseException as e:
        errors.append(e)


def _ok(out, what: str):
    """SGLang answers (success, message) tuples or objects with .success; a refusal becomes an error here."""
    success = out[0] if isinstance(out, tuple) and out else getattr(out, "success", True)
    if success is False:
        msg = out[1] if isinstance(out, tuple) and len(out) > 1 else getattr(out, "error_message", out)
        raise MismatchError(f"SGLang refused {what}: {msg}")
    return out
