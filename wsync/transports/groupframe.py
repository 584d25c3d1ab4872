"""How one message crosses a collective group: a JSON header, pieces of payload, a trailer of digests.

Broadcast and point-to-point transports (torch.distributed today) cannot stream
bytes; they move whole tensors. So a message is cut into **pieces** of at most
``chunk`` bytes, each moved by one operation, with a few pieces in flight so the
wire stays busy while the CPU hashes the piece before. The checksums travel
*after* the payload (a trailer of xxh3-64 per piece), which lets the sender hash
piece k while piece k is on the wire instead of hashing the whole message first.

A large blob is split into chunk-sized slices moved straight from/into its own
memory; consecutive small blobs share one piece through a staging copy, so a
message of many tiny blobs costs a few operations, not one per blob.

A blob may also be a torch CUDA tensor (a **device blob**). Its pieces are slices
of the tensor itself, handed to the wire as they are: on an NCCL group whose
device holds the tensor they go on the wire with no host copy, no staging and no
host hash, and the receiver gets them in a device buffer (one it was handed, or
one it allocates on the group's device). Device blobs never share a piece with
other blobs, and the header lists them (``"device": [blob indices]``, left out
when there are none, so a host-only message is what it always was). The trailer
holds digests of host pieces only: hashing device memory on the host would need
the very copy this path avoids. What checks a device blob's bytes instead is the
sync layer's digest of the version once applied; under it, the links NCCL runs
over check their own frames (link-level CRC on NVLink, PCIe and InfiniBand,
TCP's checksum on sockets).

A message's header is envelope.py's, with the ``chunk`` and ``device`` fields.
The functions take ``post(tensor) -> Work`` callables so the same code drives a
broadcast (publisher -> all) and a point-to-point send (subscriber -> publisher).
"""
from __future__ import annotations

from collections import deque

import numpy as np
import xxhash

from ..errors import ChecksumError
from . import envelope
from .base import Message

WINDOW = 2  # pieces in flight: one on the wire while the CPU hashes or copies the other


def plan_pieces(sizes: list[int], chunk: int, device=()) -> list[list[tuple[int, int, int]]]:
    """Cut blobs of these sizes into pieces; each piece is [(blob, offset, length), ...], never empty.

    A piece with a single entry is moved in place; a piece of several entries
    (small blobs packed together) goes through a staging buffer. Blobs whose index
    is in ``device`` are always moved in place: packing them would need a copy.
    """
    device = set(device)
    pieces, group, used = [], [], 0
    for i, n in enumerate(sizes):
        if n == 0:
            continue
        if group and (used + n > chunk or i in device):
            pieces.append(group)
            group, used = [], 0
        if n >= chunk or i in device:
            pieces.extend([(i, off, min(chunk, n - off))] for off in range(0, n, chunk))
            continue
        group.append((i, 0, n))
        used += n
    if group:
        pieces.append(group)
    return pieces


def pack_head(msg: Message, chunk: int) -> tuple[bytes, list[int]]:
    """The message header (kind, meta, sizes, chunk, and device when any blob is one) and the blob sizes."""
    sizes = [nbytes(b) for b in msg.blobs]
    return envelope.pack(msg.kind, msg.meta, sizes, chunk=chunk, device=device_blobs(msg.blobs)), sizes


def parse_head(raw: bytes) -> envelope.Header:
    """The header of a message on a group: envelope.parse with the fields pack_head sends."""
    return envelope.parse(raw, need=("chunk",), may=("device",))


def as_u8(buf):
    """A buffer as a flat uint8 tensor sharing its memory (no copy)."""
    import warnings

    import torch

    arr = np.frombuffer(buf, dtype=np.uint8)
    if arr.flags.writeable:
        return torch.from_numpy(arr)
    # Only senders pass read-only buffers (bytes) and collectives never write to a
    # source tensor; torch's warning is about the possibility, not a real write.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


# -- device blobs -------------------------------------------------------------------------


def is_device(b) -> bool:
    """A torch CUDA tensor: moved as a tensor, never read on the host here."""
    return getattr(b, "is_cuda", False) is True


def device_blobs(blobs) -> list[int]:
    return [i for i, b in enumerate(blobs) if is_device(b)]


def nbytes(b) -> int:
    return b.numel() * b.element_size() if is_device(b) else memoryview(b).nbytes


def flat(b):
    """What pieces are cut from: a flat uint8 view of a device blob (a copy only if it is not contiguous), or a
    byte memoryview of a host blob."""
    if not is_device(b):
        return memoryview(b).cast("B")
    import torch

    t = b.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def choose_device(option=None, current: int | None = None, tensors=()):
    """The CUDA device (a torch.device) that a link, or one operation of it, works on; None: host memory only.

    In order: the device of the CUDA ``tensors`` the operation hands to CUDA (a thread works on the device of
    the tensors it handles; they must agree); else the ``device=`` option (``"cuda:1"``, ``"1"``, 1, a
    torch.device; ``"cuda"`` alone means ``current``, or 0 where none was captured); else ``current``, the
    device index that the thread creating the link had current, captured there (never evaluated later on one
    of our threads, which start on device 0). Pure: it reads no CUDA state.
    """
    found = {_tensor_device(t) for t in tensors if _is_cuda_object(t)} - {None}
    if not found and (option is None or option == "") and current is None:
        return None  # host only: and torch need not be installed
    import torch

    if len(found) > 1:
        raise ValueError(f"one operation's CUDA tensors are on several devices: {sorted(map(str, found))}")
    if found:
        return found.pop()
    if option is not None and option != "":
        if isinstance(option, int) or (isinstance(option, str) and option.strip().isdigit()):
            return torch.device("cuda", int(option))
        try:
            d = torch.device(option)
        except (RuntimeError, TypeError):
            raise ValueError(f"device={option!r}: expected a CUDA device such as cuda:0") from None
        if d.type != "cuda":
            raise ValueError(f"device={option!r}: expected a CUDA device such as cuda:0")
        if d.index is None:
            return torch.device("cuda", current if current is not None else 0)
        return d
    return torch.device("cuda", current)


def _is_cuda_object(t) -> bool:
    return is_device(t) or hasattr(t, "__cuda_array_interface__")


def _tensor_device(t):
    import torch

    d = getattr(t, "device", None)
    if isinstance(d, torch.device):
        return d if d.type == "cuda" else None
    ordinal = getattr(d, "id", None)  # cupy and numba arrays name theirs by ordinal
    return torch.device("cuda", ordinal) if type(ordinal) is int else None


# -- moving pieces ------------------------------------------------------------------------


def host_pieces(pieces, device=()) -> int:
    """How many pieces are host pieces (the ones the digest trailer covers)."""
    device = set(device)
    return sum(1 for p in pieces if p[0][0] not in device)


def send_pieces(views: list, pieces, post, wire, wait, device=()) -> list[int]:
    """Move every piece with post(); returns the xxh3-64 digests of the host pieces (hashed while on the wire).

    views: from flat(); the blobs whose index is in device are moved as the tensors they are."""
    device = set(device)
    digests, inflight, keep = [], deque(), deque()
    for k, piece in enumerate(pieces):
        if piece[0][0] in device:
            src = _slice(views, piece[0])
            inflight.append(post(wire.outgoing(src, k % WINDOW)))
            keep.append(src)
        else:
            host = _gather(views, piece)
            inflight.append(post(wire.outgoing(as_u8(host), k % WINDOW)))
            keep.append(host)  # a staging copy must outlive its operation
            digests.append(xxhash.xxh3_64_intdigest(host))
        if len(inflight) >= WINDOW:
            wait(inflight.popleft())
            keep.popleft()
    while inflight:
        wait(inflight.popleft())
    return digests


def recv_pieces(blobs: list, pieces, post, wire, wait, device=()) -> list[int]:
    """Receive every piece into blobs (in place where possible); returns the digests of the host pieces that arrived.

    blobs: bytearrays for host blobs; flat uint8 tensors (CUDA ones, on the wire's device, take no copy) for the
    blobs whose index is in device."""
    device = set(device)
    views = [b if i in device else memoryview(b) for i, b in enumerate(blobs)]
    on_device = [p[0][0] in device for p in pieces]
    targets = [memoryview(bytearray(sum(n for _, _, n in p))) if len(p) > 1 else _slice(views, p[0]) for p in pieces]
    inflight = deque()

    def tensor(k):
        return targets[k] if on_device[k] else as_u8(targets[k])

    def start(k):
        inflight.append((k, post(wire.incoming(tensor(k), k % WINDOW))))

    for k in range(min(WINDOW, len(pieces))):
        start(k)
    digests = []
    while inflight:
        k, work = inflight.popleft()
        wait(work)
        wire.landed(tensor(k), k % WINDOW)
        if k + WINDOW < len(pieces):
            start(k + WINDOW)
        if on_device[k]:
            continue
        digests.append(xxhash.xxh3_64_intdigest(targets[k]))
        if len(pieces[k]) > 1:
            _scatter(views, pieces[k], targets[k])
    return digests


def verify(got: list[int], expected: np.ndarray) -> None:
    for k, (a, b) in enumerate(zip(got, expected.tolist())):
        if a != b:
            raise ChecksumError(f"message piece {k} of {len(got)} failed its checksum (corrupt in transit)")


def _slice(views, entry):
    i, off, n = entry
    return views[i][off:off + n]


def _gather(views, piece):
    if len(piece) == 1:
        return _slice(views, piece[0])
    out = bytearray(sum(n for _, _, n in piece))
    pos = 0
    for i, off, n in piece:
        out[pos:pos + n] = views[i][off:off + n]
        pos += n
    return memoryview(out)


def _scatter(views, piece, staged):
    pos = 0
    for i, off, n in piece:
        views[i][off:off + n] = staged[pos:pos + n]
        pos += n


# -- wires: what a group's collectives can move -------------------------------------------


class HostWire:
    """gloo moves host memory: host pieces go as they are, on either side. A piece of a real CUDA tensor is
    copied to or from host memory around its operation (gloo's send and recv take host pointers only)."""

    @property
    def device(self):
        import torch

        return torch.device("cpu")

    def outgoing(self, t, slot):
        return t if t.device.type == "cpu" else t.to("cpu")

    def incoming(self, t, slot):
        if t.device.type == "cpu":
            return t
        import torch

        staged = self.__dict__.setdefault("_staged", {})
        staged[slot] = torch.empty(t.numel(), dtype=torch.uint8)
        return staged[slot]

    def landed(self, t, slot):
        if t.device.type != "cpu":
            t.copy_(self.__dict__["_staged"].pop(slot))


class CudaWire:
    """nccl moves memory on the group's device: a piece already there (a device blob on this device, or a device
    buffer to receive into) goes as it is; any other piece (host memory, another GPU) is staged through one of
    WINDOW reusable buffers on the device, allocated when first needed."""

    def __init__(self, device, chunk: int):
        import torch

        self.device, self.chunk = torch.device(device), chunk
        self._bufs = None

    def _buf(self, slot, n):
        if self._bufs is None:
            import torch

            self._bufs = [torch.empty(self.chunk, dtype=torch.uint8, device=self.device) for _ in range(WINDOW)]
        return self._bufs[slot][:n]

    def outgoing(self, t, slot):
        if t.device == self.device:
            return t
        dev = self._buf(slot, t.numel())
        dev.copy_(t)
        return dev

    def incoming(self, t, slot):
        return t if t.device == self.device else self._buf(slot, t.numel())

    def landed(self, t, slot):
        if t.device != self.device:
            t.copy_(self._buf(slot, t.numel()))
