"""The sending half of a tcp:// link: message numbering, striping into frames, retention for resume.

``send`` numbers a message, queues its HEAD (on stream 0) and its frames (on a
queue every stream's writer thread takes from, so a faster stream simply
carries more frames), and waits until every byte is in a kernel socket buffer.
The message stays *retained* (by reference, never copied) until the peer
acknowledges it complete; after a reconnect the peer says which frames it holds
and only the others are queued again. Frame checksums are computed once, on the
first write, and reused on a resend, so a buffer changed by the caller before
the peer acknowledged it shows up as a ChecksumError, never as silent damage.
"""
from __future__ import annotations

import threading
from collections import OrderedDict, deque

import xxhash

from .. import envelope
from . import frames as tf

MISSING = object()  # the peer holds nothing of this message, not even its HEAD
FRAMES_PER_STREAM = 16  # with several streams, cut a message into at least this many frames per stream...
MIN_SPLIT = 256 << 10  # ...but no frame smaller than this (or than frame_bytes, if that is smaller)
WHOLE = 1 << 20  # a message this small travels whole on one stream, the lowest-numbered free one (see take)
LANE_STREAMS = 3  # with this many streams or more, stream 0 carries no frames of large messages (see take)...
LANE_WARMUP = 1 << 20  # ...but for this many bytes of them at the start of each epoch


def frame_size(nbytes: int, streams: int, frame_bytes: int) -> int:
    """The frame size for one message of nbytes over `streams` streams.

    Frames are dealt to streams as they free up, so a message ends when the
    last stream finishes its last frame; the others sit idle meanwhile, and on
    a WAN the busy one cannot take over their share of the link at once.
    Smaller frames shrink that tail; large messages keep frame_bytes, so fast
    links keep their few, cheap, large frames (each frame costs Python work).
    """
    if streams <= 1 or frame_bytes <= MIN_SPLIT:
        return frame_bytes
    want = -(-nbytes // (streams * FRAMES_PER_STREAM))
    want = -(-want // (64 << 10)) * (64 << 10)  # whole 64 KiB units
    return min(frame_bytes, max(MIN_SPLIT, want))


class OutMsg:
    __slots__ = ("seq", "head", "head_body", "views", "frame", "sums", "pending")

    def __init__(self, seq: int, kind: str, meta: dict, views: list[memoryview], frame: int):
        body = envelope.pack(kind, meta, [len(v) for v in views], frame=frame)
        rec = tf.Record(tf.HEAD, seq, length=len(body), body_sum=xxhash.xxh3_64_intdigest(body))
        self.seq, self.views, self.frame = seq, views, frame
        self.head, self.head_body = tf.pack(rec), body
        self.sums: dict[tuple[int, int], int] = {}  # (blob, frame) -> xxh3 of its first transmission
        self.pending = 0  # HEAD + frames queued but not yet written in this epoch

    def frame_bytes(self, b: int, i: int) -> int:
        return min(self.frame, len(self.views[b]) - i * self.frame)

    def all_frames(self):
        for b, v in enumerate(self.views):
            for i in range(tf.frame_count(len(v), self.frame)):
                yield b, i


def as_views(blobs) -> list[memoryview]:
    out = []
    for i, b in enumerate(blobs):
        try:
            out.append(memoryview(b).cast("B"))
        except (TypeError, ValueError) as e:
            raise ValueError(f"blob {i} ({type(b).__name__}) must be a C-contiguous buffer: {e}; "
                             "pass bytes, bytearray, memoryview or a contiguous numpy array") from None
    return out


class Outbox:
    """Queues shared by the writer threads; every method runs under the session's condition ``cv``."""

    def __init__(self, cv: threading.Condition, frame: int, streams: int):
        self.cv, self.frame = cv, frame  # frame: the largest frame size (frame_bytes)
        self.streams = streams  # writer streams of the current epoch (the dialling side decides how many)
        self.next_seq = 0
        self.retained: OrderedDict[int, OutMsg] = OrderedDict()  # sent, not yet acknowledged
        self.control: deque = deque()  # HEAD/CLOSE jobs, written on stream 0 first
        self.frames: deque = deque()  # ("frames", msg, [(blob, frame), ...], spread) jobs (see take)
        self.ack: int | None = None  # newest cumulative ACK still to write
        self.free: set[int] = set()  # writers waiting in take(), or writing a control record (back at once)
        self.warmup = 0  # bytes of large messages stream 0 may still take in this epoch (see take)

    def start(self, streams: int) -> None:
        """A new epoch of `streams` fresh connections."""
        self.streams, self.warmup = streams, LANE_WARMUP

    def add(self, kind: str, meta: dict, views: list[memoryview]) -> OutMsg:
        frame = frame_size(sum(len(v) for v in views), self.streams, self.frame)
        om = OutMsg(self.next_seq, kind, meta, views, frame)
        self.next_seq += 1
        self.retained[om.seq] = om
        return om

    def queue(self, om: OutMsg, held=MISSING) -> None:
        """Queue what the peer lacks of om: everything, or the frames not in held (per-blob sets)."""
        if held is None:  # the peer has it complete
            om.pending = 0
            return
        if held is MISSING:
            self.control.append(("head", om))
            jobs = list(om.all_frames())
        else:
            if len(held) != len(om.views):
                raise ValueError(f"peer's resume state lists {len(held)} blobs for a {len(om.views)}-blob message")
            jobs = [(b, i) for b, i in om.all_frames() if i not in held[b]]
        om.pending = (held is MISSING) + len(jobs)
        if sum(len(v) for v in om.views) <= WHOLE:
            self.frames.append(("frames", om, jobs, False))  # whole, on one stream
        else:
            self.frames.extend(("frames", om, [job], True) for job in jobs)  # one frame each, on any stream

    def resume(self, nxt: int, partial: dict) -> None:
        """New epoch: drop what the peer completed and queue again everything it lacks."""
        self.control.clear()
        self.frames.clear()
        self.acked(nxt)
        for seq, om in self.retained.items():
            self.queue(om, partial.get(seq, MISSING))

    def acked(self, nxt: int) -> None:
        while self.retained and next(iter(self.retained)) < nxt:
            self.retained.popitem(last=False)[1].pending = 0
        self.cv.notify_all()

    def take(self, k: int, live) -> tuple | None:
        """Next job for the writer of stream k, waiting for one; None once the epoch is over.

        Frames of a large message go to whichever writer is free, so the load
        spreads over every stream at once. A small message goes whole to the
        lowest-numbered free writer, so a light load (a delta bucket now and
        then) stays on stream 0 and keeps that connection's congestion window
        open, where dealt round-robin every stream would idle and its window
        shrink. When stream 0 falls behind (its sendall blocks), the next
        message goes to stream 1, and so on.

        With LANE_STREAMS or more streams, the frames of large messages skip
        stream 0: it stays a lane for small messages that no bulk transfer
        shares, so a keyframe does not cut the rate its congestion control
        learned from the deltas, while large messages still fill the link over
        the other streams. A fresh connection starts from TCP's initial
        window, though, so each epoch stream 0 does take the first LANE_WARMUP
        bytes of large messages (the keyframe a new subscriber gets first): its
        slow start happens there rather than in the first delta, and the
        warmup is kept small enough not to teach it a fair share of the link.
        """
        self.free.add(k)
        try:
            while live():
                if k == 0 and self.ack is not None:  # before a CLOSE, so the peer's flush() sees it
                    n, self.ack = self.ack, None
                    return ("ack", n)
                if k == 0 and self.control:
                    return self.control.popleft()
                if self.frames and ((k or self.streams < LANE_STREAMS or self.warmup > 0) if self.frames[0][3]
                                     else k == min(self.free)):
                    job = self.frames.popleft()
                    if k == 0 and job[3]:
                        self.warmup -= job[1].frame_bytes(*job[2][0])
                    self.free.discard(k)
                    return job
                self.cv.wait()
            self.free.discard(k)
            return None
        finally:
            if self.frames:
                self.cv.notify_all()  # another writer may be the one for what is left

    def written(self, job: tuple) -> None:
        if job[0] in ("head", "frames") and job[1].pending > 0:
            # pending may already be 0: the peer can acknowledge the whole message (acked() zeroes it)
            # before this writer gets here from its sendall; going below 0 would strand send() forever
            job[1].pending = max(0, job[1].pending - (len(job[2]) if job[0] == "frames" else 1))
            if job[1].pending == 0:
                self.cv.notify_all()


def write(sock, job: tuple, mac=None) -> None:
    """Put one job's records on sock (outside the lock); frame sums are computed on first use and kept,
    record MACs (with a token) on every transmission, as they cover the connection's record count."""
    what = job[0]
    if what == "head":
        send_record(sock, job[1].head, job[1].head_body, mac)
    elif what == "ack":
        send_record(sock, tf.pack(tf.Record(tf.ACK, job[1])), b"", mac)
    elif what == "close":
        send_record(sock, tf.pack(tf.Record(tf.CLOSE)), b"", mac)
    else:
        om = job[1]
        for b, i in job[2]:
            off = i * om.frame
            view = om.views[b][off: off + om.frame]
            s = om.sums.get((b, i))
            if s is None:
                s = om.sums[(b, i)] = xxhash.xxh3_64_intdigest(view)
            send_record(sock, tf.pack(tf.Record(tf.FRAME, om.seq, b, off, len(view), s)), view, mac)


# a body is tagged piece by piece just before each piece is sent, while it is in cache, in pieces large enough
# for BLAKE3's SIMD to hash many 1 KiB chunks at once
MAC_PIECE = 1 << 20


def send_record(sock, header: bytes, body, mac) -> None:
    if mac is None:
        if len(body) < 256 << 10:  # one syscall for small records
            sock.sendall(header + bytes(body))
        else:
            sock.sendall(header)
            sock.sendall(body)
        return
    sock.sendall(header + mac.head(header))
    if len(body):
        h = mac.body(header)
        for off in range(0, len(body), MAC_PIECE):
            piece = body[off: off + MAC_PIECE]
            h.update(piece)
            sock.sendall(piece)
        sock.sendall(h.digest())
    mac.next()
