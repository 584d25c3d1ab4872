"""wsync: move a trainer's weights into rollout engines, fast, bit-exact and versioned.

This module is the public API. It imports nothing heavy: torch, cupy, ucxx and
the engines load only when a function that needs them runs.
"""
from .api import apply, apply_state, apply_to_checkpoint, encode, inspect
from .backends import backend
from .errors import (
    BackendUnavailable,
    ChecksumError,
    EngineError,
    FormatError,
    MismatchError,
    TransportError,
    VersionError,
    WsyncError,
)
from .layout import Bound, Layout, bind
from .manifest import Manifest, TensorSpec
from .payload import Payload
from . import engines, quant
from .subscriber import Subscriber
from .sync import Publisher

__version__ = "0.2.0"

__all__ = [
    "Publisher", "Subscriber", "engines", "quant", "encode", "apply", "apply_state", "apply_to_checkpoint", "inspect", "backend", "Payload", "Manifest", "TensorSpec",
    "bind", "Bound", "Layout",
    "WsyncError", "FormatError", "ChecksumError", "EngineError", "VersionError", "MismatchError", "TransportError",
    "BackendUnavailable", "__version__",
]
