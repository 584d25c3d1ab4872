"""A state dict in, the engine's quantized checkpoint state out: what ``Publisher(quantize=...)`` sends.

A Quantizer holds rules (which modules, which scheme) and an ignore list, as a quantized checkpoint's config
does (``config.py`` reads one). Called with a trainer's state dict, it returns a dict in which every targeted
``<module>.weight`` is replaced by its scheme's tensors (``schemes.py``) and everything else is the trainer's
own tensor, untouched. Its output tensors are kept from one call to the next and written in place, so the
Publisher sees the same memory every version, as it does a trainer's parameters, and measures the next
version's delta against it without a copy.

Where the quantizing runs follows the tensor: a CUDA tensor on the GPU's kernels (the codes and scales never
leave the device), a host tensor on the host backend's (C++ where built, else the numpy reference). Every
backend makes the reference's bytes (``ref.py``); the tests hold each one to it.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from .. import dtypes
from ..bits import TensorBits
from ..snapshot import to_bits
from .ref import QuantizeError
from .schemes import SUFFIX, Output, Scheme


@dataclass(frozen=True)
class Rule:
    """Modules a scheme applies to. targets: compressed-tensors' spelling, each a module class name
    ("Linear"), an exact module name, or "re:" and a regular expression matched from the start of the name."""

    targets: tuple[str, ...]
    scheme: Scheme


def matches(target: str, module: str, classes: dict[str, str] | None) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    if target == module:
        return True
    if classes is not None:
        return classes.get(module) == target
    # no model to ask: a "Linear" is any module whose weight is a matrix, but embeddings and routers (see Quantizer)
    return target == "Linear" and not _not_linear(module)


def _not_linear(module: str) -> bool:
    last = module.rsplit(".", 1)[-1]
    return "embed" in last or last in ("wte", "wpe", "shared", "gate", "router")


class Quantizer:
    """rules: (targets, scheme) in order, the first match wins. ignore: module names, "re:" patterns or class
    names never quantized (they win over every rule). model: the nn.Module the state comes from, so class
    targets such as "Linear" mean exactly its Linear modules; without one, "Linear" means every module whose
    weight has two or more dimensions except embeddings (a name containing "embed", or wte/wpe/shared) and MoE
    routers (a module named gate or router: DeepSeek's and Kimi's are no Linear, and vLLM never quantizes one).
    backend: the host kernels' backend (None: WSYNC_BACKEND or auto); CUDA tensors use the GPU's."""

    def __init__(self, rules: Iterable[Rule | tuple], ignore: Iterable[str] = (), *, model=None,
                 backend: str | None = None):
        self.rules = [r if isinstance(r, Rule) else Rule(tuple(r[0]) if not isinstance(r[0], str) else (r[0],), r[1])
                      for r in rules]
        if not self.rules:
            raise ValueError("a Quantizer needs at least one rule: (targets, scheme)")
        self.ignore = tuple(ignore)
        self.backend = backend
        self._classes = None if model is None else {n: type(m).__name__ for n, m in model.named_modules()}
        self._plan: dict[tuple, Scheme | None] = {}  # (name, shape, dtype) -> scheme, decided once
        self._out: dict[str, tuple] = {}  # name -> ((device, outputs), buffers): reused while both stay

    def scheme_for(self, name: str, shape: tuple[int, ...], dtype: str) -> Scheme | None:
        """The scheme `name` is quantized with, or None: it travels as it is."""
        key = (name, tuple(shape), dtype)
        if key not in self._plan:
            self._plan[key] = self._decide(name, tuple(shape), dtype)
        return self._plan[key]

    def _decide(self, name: str, shape: tuple[int, ...], dtype: str) -> Scheme | None:
        module, dot, suffix = name.rpartition(".")
        if not dot or suffix != SUFFIX or len(shape) < 2:
            return None
        if any(matches(t, module, self._classes) for t in self.ignore):
            return None
        for rule in self.rules:
            if any(matches(t, module, self._classes) for t in rule.targets):
                rule.scheme.check(shape, dtype, name)
                return rule.scheme
        return None

    def layout(self, shapes: dict[str, tuple[tuple[int, ...], str]]) -> dict[str, tuple[tuple[int, ...], str]]:
        """{name: (shape, dtype)} of the quantized state for a state of these shapes and dtypes."""
        out = {}
        for name, (shape, dtype) in shapes.items():
            scheme = self.scheme_for(name, shape, dtype)
            if scheme is None:
                out[name] = (tuple(shape), dtype)
                continue
            for o in scheme.outputs(tuple(shape), dtype):
                out[o.name(name)] = (o.shape, o.dtype)
        return out

    def __call__(self, state: dict) -> dict:
        """The quantized state (see the module's docstring). Raises QuantizeError, naming the tensor and the
        element, for a weight that is not finite or that its scheme cannot hold."""
        if not isinstance(state, dict):
            raise TypeError(f"a Quantizer takes a dict of tensors (a state dict), got {type(state).__name__}")
        out = {}
        for name, t in state.items():
            dtype, shape = _describe(t)
            scheme = self.scheme_for(name, shape, dtype)
            if scheme is None:
                out[name] = t
                continue
            outputs = scheme.outputs(shape, dtype)
            bufs = self._buffers(name, t, outputs)
            _quantize_into(scheme, t, dtype, bufs, name, self.backend)
            out.update({o.name(name): b for o, b in zip(outputs, bufs)})
        return out

    def _buffers(self, name: str, t, outputs: list[Output]) -> list:
        key = (_device(t), outputs)
        kept = self._out.get(name)
        if kept is None or kept[0] != key:
            kept = self._out[name] = (key, [_empty(o, t) for o in outputs])
        return kept[1]


def _describe(t) -> tuple[str, tuple[int, ...]]:
    if isinstance(t, TensorBits):
        return t.dtype.name, tuple(t.shape)
    if isinstance(t, np.ndarray):
        return dtypes.from_numpy(t.dtype).name, tuple(t.shape)
    return dtypes.from_torch(t.dtype).name, tuple(t.shape)


def _device(t) -> str:
    return "host" if isinstance(t, (TensorBits, np.ndarray)) else str(t.device)


def _empty(o: Output, like):
    if isinstance(like, (TensorBits, np.ndarray)):
        dt = dtypes.DTYPES[o.dtype]
        return TensorBits(dt, o.shape, np.empty(int(np.prod(o.shape, dtype=np.int64)), dt.bits_dtype))
    import torch

    return torch.empty(o.shape, dtype=getattr(torch, dtypes.DTYPES[o.dtype].torch_name), device=like.device)


def _quantize_into(scheme: Scheme, t, dtype: str, bufs: list, name: str, backend: str | None) -> None:
    from .. import backends

    if _device(t).startswith("cuda"):
        backends.device_kernels().quantize(scheme, t, dtype, bufs, name)
        return
    # host memory: bit-pattern views of the weight and of the buffers (a copy only of a non-contiguous weight)
    views = [to_bits(x) for x in (t, *bufs)]
    backends.kernels(backend).quantize(scheme, views[0].bits.reshape(views[0].shape), dtype,
                                       [v.bits.reshape(v.shape) for v in views[1:]], name)


__all__ = ["Quantizer", "Rule", "QuantizeError"]
