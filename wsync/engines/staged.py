"""Engines whose live weights we cannot address in place (vLLM, SGLang): a host copy plus a push.

A serving framework owns its weights: fused, sharded over tensor-parallel
ranks, maybe quantized, on GPUs in other processes. What it offers is a verb
that takes (name, tensor) pairs in checkpoint names and loads them
(``model.load_weights``, ``update_weights_from_tensor``, a LoRA loader). So
these engines keep a host copy of the newest version in the publisher's names
(read-only to the Subscriber, which then decodes into a copy and calls
``load`` with the tensors that changed), and push those tensors through the
framework's verb. The digest is of that host copy: it proves what was handed
to the framework, not what the GPU holds after the framework's own loader ran
(for an unsharded, unquantized model, ``engines.HF`` with ``fused=`` on the
framework's module checks the live weights themselves).

If a push fails, the Subscriber calls ``load`` again with the old values, so
the framework and the host copy return to the previous version together.
"""
from __future__ import annotations

import threading

from ..errors import EngineError, WsyncError
from ..snapshot import State, TensorBits, as_state, to_torch
from ..shadow import Shadow


class Staged:
    lock: threading.RLock

    def __init__(self):
        self.version: int | None = None  # the version served; the Subscriber sets it on commit
        self.shadow = Shadow()
        self.lock = threading.RLock()  # held around each push

    def tensors(self) -> State:
        return {n: TensorBits(tb.dtype, tb.shape, _read_only(tb.bits)) for n, tb in self.shadow.state.items()}

    def digest(self) -> str:
        return self.shadow.digest()

    def load(self, named: dict) -> None:
        state = as_state(named)
        self.shadow.load(state)
        self._push({n: to_torch(tb) for n, tb in state.items()}, whole=False)

    def replace(self, state: State) -> None:
        """A keyframe: every tensor, names possibly new (the framework checks them against its model)."""
        self._push({n: to_torch(tb) for n, tb in state.items()}, whole=True)
        self.shadow.replace(state)

    def _push(self, named: dict, *, whole: bool) -> None:
        # a framework's own exception would end the Subscriber's thread; as a WsyncError it rolls the version back
        with self.lock:
            try:
                self.push(named, whole=whole)
            except WsyncError:
                raise
            except Exception as e:
                raise EngineError(f"{type(self).__name__} could not load {len(named)} tensors: "
                                  f"{type(e).__name__}: {e}") from e

    def push(self, named: dict, *, whole: bool) -> None:
        """Hand these (CPU) tensors to the framework. whole: they are the entire state."""
        raise NotImplementedError


def _read_only(bits):
    v = bits.view()
    v.flags.writeable = False
    return v


def current_tensors(engine: Staged, named: dict, whole: bool) -> dict:
    """The whole adapter after this push (load() has already put the changed tensors in the host copy)."""
    return named if whole else {n: to_torch(tb) for n, tb in engine.shadow.state.items()}
