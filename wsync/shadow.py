"""An engine that is only host memory: for relays, `wsync pull`, and tests.

It holds the newest version as numpy bit patterns. A relay forwards from it,
`wsync pull` writes it to disk, and a test can compare it byte for byte.
"""
from __future__ import annotations

from .snapshot import State, TensorBits, as_state, digest


class Shadow:
    def __init__(self, state=None):
        self.version: int | None = None
        self.state: State = as_state(state) if state is not None else {}

    def tensors(self) -> State:
        return self.state

    def load(self, named) -> None:
        new = as_state(named)
        for name, tb in new.items():
            cur = self.state.get(name)
            if cur is not None and (cur.dtype, cur.shape) == (tb.dtype, tb.shape) and cur.bits.flags.writeable:
                cur.bits[:] = tb.bits
            else:
                self.state[name] = TensorBits(tb.dtype, tb.shape, tb.bits.copy())

    def replace(self, state: State) -> None:
        """Take a whole new state (a keyframe): names may differ from the current one."""
        self.state = {n: TensorBits(tb.dtype, tb.shape, tb.bits.copy()) for n, tb in state.items()}

    def digest(self) -> str:
        return digest(self.state)
