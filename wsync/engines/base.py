"""What the sync protocol needs from an engine: its tensors, a way to load, a digest, a version.

An engine adapter wraps whatever serves the model (a plain nn.Module, a PEFT
model, a vLLM or SGLang worker) behind three verbs. The Subscriber uses
``tensors()`` as the base a delta applies to: when those are writable,
contiguous CPU tensors, the update is written into them in place and
``load`` is never called; otherwise the Subscriber works on a host copy and
hands the changed tensors to ``load``. ``digest()`` is computed from what the
engine really holds, after loading, so a load that silently went wrong is
caught before the version is committed.

Optional, used when present:

- ``replace(state)``: take a whole keyframe at once (names may differ from
  ``tensors()``); the Subscriber calls it for all-raw versions after checking
  their digest (Shadow, the staged framework engines, LossyLowRank).
- ``lock``: a re-entrant lock held while the engine's weights are written
  (``guarded=True`` HF/PEFT and the framework engines); a generating thread
  holds it around forward passes so none sees half a version.
"""
from __future__ import annotations

from typing import Any, Protocol


class Engine(Protocol):
    version: int | None  # the version this engine serves; set by the Subscriber on commit

    def tensors(self) -> dict[str, Any]:
        """Named tensors the engine serves (torch tensors or numpy arrays), in a stable order."""

    def load(self, named: dict[str, Any]) -> None:
        """Copy these tensors (CPU, same names/shapes/dtypes as tensors()) into the live weights."""

    def digest(self) -> str:
        """wsync.snapshot.digest of the weights as the engine holds them now."""
