"""Pieces every integration shares: version numbering, host copies of a framework's tensors, tokens.

Frameworks count weight updates their own way (verl's ``global_steps``, slime's
``weight_version``, prime-rl's ``step``, or nothing at all). wsync versions
must increase strictly, and both ends must agree on the number without talking,
so ``next_version`` turns any framework count into one deterministic rule that
trainer and engine apply to the same sequence of calls.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class SyncConfig:
    address: str = "tcp://0.0.0.0:0"  # where the trainer's Publisher listens (tcp://, ucx://, local://, gloo://?world_size=N)
    advertise: str | None = None  # host engines dial when address binds 0.0.0.0 (None: this host's name)
    token: str | None = None  # shared secret, hex (both ends); None only on a trusted network
    codec: str = "delta"  # "delta" (raw keyframes every keyframe_every) or "raw"
    tier: str = "packed"  # delta tier: "packed" (zstd, WAN/TCP) or "sparse" (fast links)
    keyframe_every: int = 50  # a raw version every K versions
    timeout_s: float = 600.0  # how long an engine waits for a version before raising TimeoutError
    publisher_opts: dict = field(default_factory=dict)  # extra PublisherConfig fields (bucket_bytes, backend, ...)

    def token_bytes(self) -> bytes | None:
        return bytes.fromhex(self.token) if self.token else None

    def publisher(self):
        from ..sync import Publisher

        return Publisher(self.address, token=self.token_bytes(), codec=self.codec, tier=self.tier,
                         keyframe_every=self.keyframe_every, **self.publisher_opts)

    def dial_address(self, pub) -> str:
        """The address an engine on another host dials to reach `pub`."""
        return advertised(pub.address, self.advertise)


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
