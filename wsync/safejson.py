"""JSON from a peer or a file, parsed only after its size and nesting are known to be sane.

Python's json recurses once per nested array or object, so a few kilobytes of
``[[[[...`` raise RecursionError (or, deep enough in a thread, worse), and a
digit string longer than Python's int limit raises a bare ValueError: neither
is a wsync error, so the CLI printed a traceback and a subscriber's receive
thread died. Every JSON document that crosses a trust boundary (a payload's
manifest, handshake and message headers, layouts kept in replica metadata,
safetensors headers) goes through ``loads`` here, which measures bracket depth
outside strings first, at C speed, and turns every way parsing can fail into
one ``JSONError``. No document wsync writes nests deeper than a handful of levels.
"""
from __future__ import annotations

import json
import re

import numpy as np

from .errors import JSONError

MAX_DEPTH = 64  # arrays and objects inside each other; wsync's own documents nest 2-6 deep
MAX_BYTES = 256 << 20  # a backstop: each caller holds its input to its own, tighter bound before reading it

# A string literal, or an unterminated one running to the end; possessive, so the scan stays linear.
_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_STEP = np.zeros(256, np.int8)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1
_BLOCK = 1 << 20  # brackets scanned per numpy pass, so the scan's memory stays small


def loads(data, *, what: str = "JSON", max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH):
    """json.loads, after checking size and nesting; any failure raises JSONError saying what was refused.

    data: str, bytes, bytearray or memoryview. what: names the document in the message.
    """
    raw = _as_bytes(data, what)
    if len(raw) > max_bytes:
        raise JSONError(f"{what}: {len(raw)} bytes of JSON, more than the {max_bytes}-byte limit")
    check_depth(raw, what, max_depth)
    try:
        return json.loads(raw)
    except RecursionError:  # only when the caller's own stack is already deep
        raise JSONError(f"{what}: JSON nests too deep to parse here") from None
    except (ValueError, TypeError) as e:  # JSONDecodeError, bad UTF-8, an int past Python's digit limit
        raise JSONError(f"{what}: not valid JSON: {str(e):.200}") from None


def check_depth(raw: bytes, what: str, max_depth: int) -> None:
    """Raise JSONError if arrays/objects nest deeper than max_depth (brackets inside strings do not count)."""
    brackets = raw.translate(None, _NOT_BRACKETS)
    if len(brackets) <= max_depth or _depth(brackets) <= max_depth:
        return  # even counting brackets inside strings, it is shallow enough: the usual case, one C pass
    if _depth(_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)) > max_depth:
        raise JSONError(f"{what}: JSON nests deeper than {max_depth} levels")


def _depth(brackets: bytes) -> int:
    """Deepest nesting of a string of bracket bytes (unbalanced closers only lower it)."""
    b = np.frombuffer(brackets, np.uint8)
    deepest = level = 0
    for i in range(0, len(b), _BLOCK):
        run = np.cumsum(_STEP[b[i : i + _BLOCK]], dtype=np.int64) + level
        deepest, level = max(deepest, int(run.max())), int(run[-1])
    return deepest


def _as_bytes(data, what: str) -> bytes:
    if isinstance(data, str):
        return data.encode("utf-8", "surrogatepass")
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise JSONError(f"{what}: expected JSON text, got {type(data).__name__}")
