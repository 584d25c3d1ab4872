"""vLLM stand-in for OpenRLHF's rollout actor on a CPU machine (see ../README.md).

What is real around it: OpenRLHF's ``RolloutRayActor`` builds ``AsyncEngineArgs`` and
``AsyncLLMEngine`` from it and calls ``collective_rpc``; the worker is OpenRLHF's
``WorkerWrap`` mixed into a worker class as vLLM does with ``worker_extension_cls``; the
plugins are this environment's ``vllm.general_plugins`` entry points (wsync's among them).
"""
from __future__ import annotations

import importlib
import logging
from importlib.metadata import entry_points

import torch

__version__ = "0.33.0"
log = logging.getLogger(__name__)


class SamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class AsyncEngineArgs:
    def __init__(self, model: str, worker_extension_cls: str = "", dtype: str = "bfloat16", **kwargs):
        self.model, self.worker_extension_cls, self.dtype, self.extra = model, worker_extension_cls, dtype, kwargs


def load_general_plugins() -> None:
    """As vLLM does in every worker: call each ``vllm.general_plugins`` entry point; a failing one is logged."""
    for ep in entry_points(group="vllm.general_plugins"):
        try:
            ep.load()()
        except Exception as e:  # vLLM logs and goes on
            log.warning("plugin %s failed to load: %s", ep.name, e)


class _Served(torch.nn.Module):
    """The served model: a Hugging Face causal LM with vLLM's ``load_weights((name, tensor), ...)``."""

    def __init__(self, path: str, dtype: torch.dtype):
        super().__init__()
        import transformers

        self.hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()

    def load_weights(self, weights):
        params = dict(self.hf.named_parameters())
        for name, t in weights:
            params[name].data.copy_(t)
        return set(params)


class _Worker:
    def __init__(self, args: AsyncEngineArgs):
        from types import SimpleNamespace

        dtype = getattr(torch, args.dtype)
        self.device = torch.device("cpu")
        self.model_config = SimpleNamespace(dtype=dtype, model=args.model)
        self.model_runner = SimpleNamespace(model=_Served(args.model, dtype))


class AsyncLLMEngine:
    def __init__(self, args: AsyncEngineArgs):
        load_general_plugins()
        bases = (_Worker,)
        if args.worker_extension_cls:
            module, _, name = args.worker_extension_cls.rpartition(".")
            bases = (getattr(importlib.import_module(module), name),) + bases
        self.worker = type("Worker", bases, {})(args)

    @classmethod
    def from_engine_args(cls, args: AsyncEngineArgs) -> "AsyncLLMEngine":
        return cls(args)

    async def is_sleeping(self) -> bool:
        return False

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    async def reset_prefix_cache(self) -> None:
        return None
