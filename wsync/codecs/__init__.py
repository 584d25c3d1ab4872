"""Codecs: how a tensor's new contents become bytes, given (or not) its base."""
from __future__ import annotations

from . import delta, raw

CODECS = {"raw": raw, "delta": delta}
