"""An engine fed LOSSY low-rank updates (wsync.lowrank): merges factors into the live weights, checked.

Wraps any engines.HF-style engine (names, fused layouts and the lock all come
from it). Updates travel through an ordinary Publisher with ``codec="raw"``
(each update is self-contained factors, so nothing is gained by a delta), and
reach ``replace`` after their own checksums passed. ``replace`` then checks
that the weights it holds are the ones the update was made against, merges,
and checks the result against the trainer's mirror, so the engine always holds
exactly what the trainer believes it holds, even though that differs from the
trainer's own weights (see ``wsync.lowrank``).

    engine = wsync.engines.LossyLowRank(wsync.engines.HF(model))
    sub = wsync.Subscriber(addr, engine=engine, token=...)
"""
from __future__ import annotations

from ..errors import FormatError
from ..snapshot import State, TensorBits, digest, to_torch


class LossyLowRank:
    lossy = True  # this engine follows the trainer approximately: see wsync.lowrank

    def __init__(self, inner):
        if not hasattr(inner, "live"):
            from .hf import HF

            inner = HF(inner)  # a bare nn.Module
        self.inner = inner
        self.lock = inner.lock
        self.version: int | None = None
        self._update: State = {}  # the last update applied: what the sync layer checks and resumes from

    def tensors(self) -> State:
        return {n: TensorBits(tb.dtype, tb.shape, _read_only(tb.bits)) for n, tb in self._update.items()}

    def digest(self) -> str:
        return digest(self._update)

    def load(self, named) -> None:
        raise FormatError("lossy low-rank updates must travel whole: publish them with Publisher(codec='raw')")

    def replace(self, state: State) -> None:
        from ..lowrank import apply_update

        with self.lock:
            apply_update(self.inner.live(), {n: to_torch(tb) for n, tb in state.items()})
        self._update = {n: TensorBits(tb.dtype, tb.shape, tb.bits.copy()) for n, tb in state.items()}

    def weights_digest(self) -> str:
        """Digest of the merged weights the engine serves (equals the trainer mirror's)."""
        return self.inner.digest()


def _read_only(bits):
    v = bits.view()
    v.flags.writeable = False
    return v
