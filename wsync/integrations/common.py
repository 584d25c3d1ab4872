"""Pieces every integration shares: version numbering, host copies of a framework's tensors, tokens.

Frameworks count weight updates their own way (verl's ``global_steps``, slime's
``weight_version``, prime-rl's ``step``, or nothing at all). wsync versions
must increase strictly, and both ends must agree on the number without talking,
so ``next_version`` turns any framework count into one deterministic rule that
trainer and engine apply to the same sequence of calls.

Tokens: a Publisher listens on loopback unless told otherwise, and refuses to
listen anywhere else over tcp without a token (anyone who reaches it could
otherwise push weights). The token itself never crosses a framework's control
plane (HTTP bodies, RPC arguments, group names), which frameworks log: each end
reads it from its own config or from ``WSYNC_TOKEN`` / ``WSYNC_TOKEN_FILE``,
and the control plane carries only ``token_id``, a fingerprint that lets the
engine say "wrong token" without learning it.
"""
from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field

from ..tokens import TOKEN_ENV, TOKEN_FILE_ENV, engine_token, load as load_token, token_id

__all__ = ["SyncConfig", "TOKEN_ENV", "TOKEN_FILE_ENV", "advertised", "check_exposure", "engine_token", "env_config",
           "host_state", "load_token", "next_version", "token_id"]


@dataclass(kw_only=True)
class SyncConfig:
    # where the trainer's Publisher listens (tcp://, ucx://, local://, gloo://?world_size=N); another host's
    # engines need a reachable address (tcp://0.0.0.0:7070), and then a token
    address: str = "tcp://127.0.0.1:0"
    advertise: str | None = None  # host engines dial when address binds 0.0.0.0 (None: this host's name)
    # shared secret, hex (both ends); None: WSYNC_TOKEN / WSYNC_TOKEN_FILE, else none (loopback only over tcp).
    # Kept out of repr: configs get logged
    token: str | None = field(default=None, repr=False)
    codec: str = "delta"  # "delta" (raw keyframes every keyframe_every) or "raw"
    tier: str = "packed"  # delta tier: "packed" (zstd, WAN/TCP) or "sparse" (fast links)
    keyframe_every: int = 50  # a raw version every K versions
    timeout_s: float = 600.0  # how long an engine waits for a version before raising TimeoutError
    publisher_opts: dict = field(default_factory=dict)  # extra PublisherConfig fields (bucket_bytes, backend, ...)

    def token_bytes(self) -> bytes | None:
        return load_token(self.token)

    def token_id(self) -> str | None:
        """What the control plane may carry instead of the token."""
        return token_id(self.token_bytes())

    def publisher(self):
        from ..sync import Publisher

        token = self.token_bytes()
        check_exposure(self.address, token)
        return Publisher(self.address, token=token, codec=self.codec, tier=self.tier,
                         keyframe_every=self.keyframe_every, **self.publisher_opts)

    def dial_address(self, pub) -> str:
        """The address an engine on another host dials to reach `pub`."""
        return advertised(pub.address, self.advertise)


def check_exposure(address: str, token: bytes | None) -> None:
    """Refuse a tcp listener beyond loopback without a token: anyone who reaches it could push weights."""
    scheme, _, rest = address.partition("://")
    if scheme != "tcp" or token is not None:
        return
    host = rest.partition("?")[0].rpartition(":")[0].strip("[]")
    if not _loopback(host):
        raise ValueError(f"{address} listens beyond this host without a token, so anyone who can reach it could "
                         f"push weights: set token= (or {TOKEN_ENV}) on both ends, or listen on tcp://127.0.0.1")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def advertised(address: str, host: str | None = None) -> str:
    """Swap a wildcard bind host (0.0.0.0, ::) for one other machines can reach."""
    import socket

    scheme, rest = address.split("://", 1)
    hostport, sep, query = rest.partition("?")
    bind, _, port = hostport.rpartition(":")
    if bind in ("0.0.0.0", "[::]", "::", ""):
        bind = host or socket.gethostname()
    elif host:
        bind = host
    return f"{scheme}://{bind}:{port}{sep}{query}"


def next_version(framework_count, last: int | None) -> int:
    """The wsync version for this update: the framework's count when it increases, else last + 1."""
    floor = 0 if last is None else last + 1
    if isinstance(framework_count, int) and not isinstance(framework_count, bool) and framework_count >= floor:
        return framework_count
    return floor


def host_state(named) -> dict:
    """{name: contiguous CPU tensor} owned by us, from any iterable of (name, tensor) (GPU, DTensor, views)."""
    out = {}
    for name, t in named:
        if hasattr(t, "full_tensor"):  # a DTensor: every rank must take part, the caller walks on all ranks
            t = t.full_tensor()
        out[name] = t.detach().to("cpu", copy=True).contiguous()
    return out


def env_config(name: str, extra: tuple = ()) -> tuple[SyncConfig, dict]:
    """SyncConfig (and `extra` fields) from the JSON in environment variable `name`, for a framework's own processes.

    Frameworks start their trainers themselves (Ray actors, torchrun): a config made in the launcher never
    reaches them, an environment variable does. The token is never in it (WSYNC_TOKEN / WSYNC_TOKEN_FILE).
    """
    import json

    raw = os.environ.get(name)
    try:
        fields = json.loads(raw) if raw else {}
        if not isinstance(fields, dict):
            raise ValueError("not a JSON object")
        if fields.get("token"):
            raise ValueError("the token goes in WSYNC_TOKEN or WSYNC_TOKEN_FILE, not here")
        rest = {k: fields.pop(k) for k in extra if k in fields}
        return SyncConfig(**fields), rest
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name} must be a JSON object of SyncConfig fields{' and ' + ', '.join(extra) if extra else ''}"
                         f" (e.g. '{{\"address\": \"tcp://0.0.0.0:7070\"}}'), got {raw!r}: {e}") from None
