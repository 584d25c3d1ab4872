"""Close what is still open when the interpreter exits, before it starts to stop threads.

Publishers and subscribers run daemon threads that spend most of their time in torch and torch.distributed
calls with the GIL released. CPython ends a daemon thread that asks for the GIL back once finalization has
begun, with pthread_exit; unwinding through those C++ frames aborts the process (SIGABRT, "terminate called
without an active exception"), after its work was done and its results reported. atexit handlers run before
that point, while every thread can still run, so what registers here is closed, and its threads joined, then.
"""
from __future__ import annotations

import atexit
import logging
import threading
import weakref

log = logging.getLogger("wsync")
_OPEN: weakref.WeakSet = weakref.WeakSet()
_LOCK = threading.Lock()
_HOOKED = False


def close_at_exit(obj) -> None:
    """Call obj.close() at interpreter exit if obj is still alive then; close() must be idempotent."""
    global _HOOKED
    with _LOCK:
        _OPEN.add(obj)
        if not _HOOKED:
            atexit.register(_close_open)
            _HOOKED = True


def _close_open() -> None:
    with _LOCK:
        items = list(_OPEN)
    for obj in items:
        try:
            obj.close()
        except Exception as e:  # one that fails to close must not keep the others open
            log.warning("closing %s at exit failed: %s", type(obj).__name__, e)
