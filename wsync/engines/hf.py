"""Any torch nn.Module (a transformers model included) as a wsync engine.

Weights are written into the live parameters and buffers in place, never
reallocated, so code holding references to them (a generation loop, a CUDA
graph, an optimizer) keeps working across updates. Tied weights (one storage
under two names, like embed_tokens and lm_head) travel once, under the first
name in state_dict order; the Publisher drops the same aliases on its side.
``rename`` maps the publisher's names to this model's (e.g. a trainer that
wraps the model in a module with a prefix).
"""
from __future__ import annotations

from collections.abc import Callable

from ..snapshot import as_state, digest


def unique_tensors(named: dict) -> dict:
    """Drop later names that alias an earlier tensor's memory (tied weights)."""
    seen, out = set(), {}
    for name, t in named.items():
        key = _storage_key(t)
        if key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


def _storage_key(t):
    if hasattr(t, "untyped_storage"):
        return (t.device.type, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
    return id(t)


class HF:
    def __init__(self, model, *, rename: Callable[[str], str] | None = None):
        self.model = model
        self.version: int | None = None
        self.rename = rename

    def tensors(self) -> dict:
        named = unique_tensors(self.model.state_dict(keep_vars=True))
        return {self._name(n): t.detach() for n, t in named.items()}

    def _name(self, n: str) -> str:
        return self.rename(n) if self.rename else n

    def load(self, named: dict) -> None:
        import torch

        live = self.tensors()
        unknown = sorted(set(named) - set(live))
        if unknown:
            from ..errors import MismatchError

            raise MismatchError(f"the model has no tensors named {unknown[:5]} ({len(unknown)} unknown)")
        with torch.no_grad():
            for name, src in named.items():
                live[name].copy_(src if isinstance(src, torch.Tensor) else torch.as_tensor(src))

    def digest(self) -> str:
        return digest(as_state(self.tensors()))
