"""Option plumbing shared by the transports: sizes like ``64M``, and address params merged with keywords.

An address carries options as query params (``gloo://h:p?world_size=3&chunk=16M``)
and callers may pass the same options as keywords; keywords win. Values from the
query are strings, so every option goes through one typed conversion that says
which option was bad and what it expected.
"""
from __future__ import annotations

import dataclasses
import re

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text) -> int:
    """'256M' -> 268435456; accepts ints, plain digits, and K/M/G/T (binary) with an optional 'iB'/'B'."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"a size cannot be negative, got {text}")
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", str(text), flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"bad size {text!r}: expected bytes like 1048576, 64M or 1G")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _convert(name: str, value, kind):
    if kind is bool and isinstance(value, str):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"option {name}={value!r}: expected true/false")
    if kind == "size":
        return parse_size(value)
    if value is None or kind is str:
        return value
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"option {name}={value!r}: expected {kind.__name__}") from None


def build(config_cls, params: dict, opts: dict, kinds: dict):
    """config_cls(**merged) where query params and keywords are converted by kinds[name]; unknown names are refused."""
    fields = {f.name for f in dataclasses.fields(config_cls)}
    merged = {**params, **opts}
    unknown = sorted(set(merged) - fields)
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}")
    return config_cls(**{k: _convert(k, v, kinds.get(k, str)) for k, v in merged.items()})
