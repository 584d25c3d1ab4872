"""Engine adapters: what a Subscriber loads weights into (see base.py).

HF and Shadow import nothing heavy; PEFT, vLLM and SGLang import their
frameworks only when used (``from wsync.engines.peft import PEFT`` or the
lazy attributes below). LoraSlots and TwoInstances (slots.py) serve several
versions at once, each request pinned to one.
"""
from .base import Engine
from .hf import HF, Fused, qkv_gate_up
from ..shadow import Shadow

_LAZY = {"PEFT": ".peft", "LossyLowRank": ".lowrank", "VLLM": ".vllm", "SGLang": ".sglang",
         "LoraSlots": ".slots", "TwoInstances": ".slots", "Pinning": ".slots"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'wsync.engines' has no attribute {name!r}")


__all__ = ["Engine", "HF", "Fused", "qkv_gate_up", "Shadow", "PEFT", "LossyLowRank", "VLLM", "SGLang",
           "LoraSlots", "TwoInstances", "Pinning"]
