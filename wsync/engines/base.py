"""What the sync protocol needs from an engine: its tensors, a way to load, a version.

An engine adapter wraps whatever serves the model (a plain nn.Module, a PEFT
model, a vLLM or SGLang worker) behind these. The Subscriber uses
``tensors()`` as the base a delta applies to: when those are writable,
contiguous CPU tensors, the update is written into them in place and
``load`` is never called; otherwise the Subscriber works on a host copy and
hands the changed tensors to ``load``.

What the commit check verifies: before a version is committed, the version
digest of what the engine holds (subscriber.version_digest: the checksums of
the version's segments, see checksum.state_digest) must equal the digest the
publisher sent. After a ``load`` it is recomputed from ``tensors()``, so a
load that left ``tensors()`` different from what was sent is caught; written
in place, each segment is checked where it was written. It proves what
``tensors()`` returns, no more: an engine whose ``tensors()`` is a host copy
of weights that live elsewhere is trusted to have loaded them.

Optional, used when present:

- ``replace(state)``: take a whole keyframe at once (names may differ from
  ``tensors()``); the Subscriber calls it for all-raw versions after checking
  their digest (Shadow, the staged framework engines, LossyLowRank).
- ``lock``: a re-entrant lock held while the engine's weights are written
  (``guarded=True`` HF/PEFT and the framework engines); a generating thread
  holds it around forward passes so none sees half a version.

The adapters wsync ships also have ``digest()``: snapshot.digest of the
weights they hold, one entry per tensor, for comparing an engine with a
trainer whatever the layout; the protocol never calls it.
"""
from __future__ import annotations

from typing import Any, Protocol


class Engine(Protocol):
    version: int | None  # the version this engine serves; set by the Subscriber on commit

    def tensors(self) -> dict[str, Any]:
        """Named tensors the engine serves (torch tensors or numpy arrays), in a stable order."""

    def load(self, named: dict[str, Any]) -> None:
        """Copy these tensors (CPU, same names/shapes/dtypes as tensors()) into the live weights."""

