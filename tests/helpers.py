"""Constants and small helpers that many test modules share (fixtures are in conftest.py).

Light on purpose: the vLLM and verl stages import it from venvs of their own, and spawned worker processes
import it again, so it needs only numpy and the standard library.
"""
from __future__ import annotations

import importlib
import os
import socket

import numpy as np

TOKEN_HEX = "5e1fc07a93b2d46e8a0f2c4b6d8e1a3c"  # 16 bytes, in hex as the command line and WSYNC_TOKEN take it
TOKEN = bytes.fromhex(TOKEN_HEX)  # the same token as the Python API takes it


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (the socket that found it is closed again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_of(address: str) -> int:
    """The port of a listener's address, "tcp://127.0.0.1:PORT"."""
    return int(address.rsplit(":", 1)[1])


def random_bytes(seed: int, n: int) -> np.ndarray:
    """n random bytes as a uint8 array, the same for the same seed."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def blob(n: int, seed: int = 0) -> bytes:
    """n random bytes, the same for the same seed."""
    return random_bytes(seed, n).tobytes()


def clone(state: dict) -> dict:
    """A copy of every tensor or array of a state, so an in-place apply cannot touch the original."""
    return {k: v.clone() if hasattr(v, "clone") else v.copy() for k, v in state.items()}


def import_or_skip(*names: str, required_by: str = "WSYNC_REQUIRE_VLLM") -> list:
    """The modules named, imported; where one does not import, the calling test module is skipped, or fails
    where the environment variable `required_by` is 1 (a CI stage that installed them)."""
    import pytest

    try:
        return [importlib.import_module(n) for n in names]
    except Exception as e:  # ImportError, or an install whose torchvision does not load against CPU torch
        what = " or ".join(names)
        if os.environ.get(required_by) == "1":
            raise RuntimeError(f"{required_by}=1 but {what} does not import: {type(e).__name__}: {e}") from e
        pytest.skip(f"{what} does not import here: {type(e).__name__}: {e}", allow_module_level=True)


def examples(full: int) -> int:
    """max_examples for a property test that names its own: `full` under the "full" hypothesis profile
    (WSYNC_HYPOTHESIS=full, CI's slow tier), as much less under the default profile as that profile draws."""
    from hypothesis import settings

    return max(1, full * settings.default.max_examples // settings.get_profile("full").max_examples)


def settle(root) -> None:
    """Age root and everything under it (links themselves, not what they point to) a minute into the past: serve
    takes only checkpoints that have stopped changing."""
    import time
    from pathlib import Path

    root = Path(root)
    old = time.time() - 60
    for f in [root, *(root.rglob("*") if root.is_dir() else [])]:
        os.utime(f, (old, old), follow_symlinks=False)
