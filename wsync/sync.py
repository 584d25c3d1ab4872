"""Publisher (trainer side): versions out to any number of subscribers, over any transport.

    pub = wsync.Publisher("tcp://0.0.0.0:7070", codec="delta", keyframe_every=50, token=...)
    pub.publish(model.state_dict(), version=step)   # reads the state once, returns; packing and sending run behind

publish() reads the trainer's tensors one of two ways. Host-memory tensors,
when a delta is due, are measured against the Mirror (mirror.py: the
publisher's own copy of the previous version, which takes each delta's
changes), so each byte is read once and nothing else is copied. Otherwise
(keyframes, GPU tensors, a raw codec, the mirror not ready) the state is
copied bucket by bucket (snapshot.Copying) and the encoder works on the copy.

The protocol, in messages (see transports/base.py for how they travel):

    subscriber -> publisher  hello  {version, checksum}      what it holds (None: nothing)
    publisher -> subscriber  welcome {newest}                the newest version it has (point-to-point only)
    publisher -> subscriber  bucket {version, base_version, index, count, checksum} + [payload head, payload body]
    subscriber -> publisher  ack    {version, served, need_keyframe}   once per version received
    subscriber -> publisher  need   {served}                 an apply failed: send a keyframe (point-to-point only)
    publisher -> subscriber  bye    {}                        the publisher is closing

Each version is cut into buckets of about ``bucket_bytes`` of model bytes, each
a self-contained payload; a sender streams bucket k while the encoder works on
k+1. On broadcast groups (gloo/nccl) every message reaches all members and the
acks come back as one gather per version, so that path runs in lockstep.
"""
from __future__ import annotations

import ipaddress
import sys
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

from . import api, backends, quant
from .errors import SnapshotError, VersionError, WsyncError
from .exiting import close_at_exit
from .history import EncodedVersion, History, Keyframe, keyframe_due
from .staging import check_note
from .sender import Sender
from .checksum import state_digest
from .layout import Bound, Layout, bind, layout_of
from .mirror import LiveDelta, Mirror
from .device import DeviceSource, DeviceState, on_one_device
from .snapshot import Copying, State, as_state, blank_like, off_host, plan_buckets, unique_tensors, wait_copied
from .transports import Message, listen, parse_address
from .transports.base import with_token

log = logging.getLogger("wsync.sync")


@dataclass(kw_only=True)
class PublisherConfig:
    codec: str = "delta"  # "delta" between keyframes, or "raw" for every version
    tier: str = "packed"  # delta tier: "packed" (zstd stage, for TCP/WAN) or "sparse" (fixed width, for fast links)
    keyframe_every: int = 50  # a keyframe every K versions; 0: only the first (later ones on demand)
    bucket_bytes: int = 64 << 20  # model bytes per bucket: the unit of encode/send overlap
    level: int = 1  # zstd level of the packed tier
    backend: str | None = None  # codec backend (None: WSYNC_BACKEND or auto)
    max_queued: int = 2  # versions waiting to be encoded before publish() blocks (bounds memory)
    hello_timeout: float = 30.0  # seconds a new subscriber has to say hello
    live: bool = True  # host-memory states: publish() measures each delta against a mirror instead of copying
    # encoded versions kept for catch-up, in bytes (raw versions are whole models); older ones are dropped and a
    # subscriber that needed them gets a keyframe of the newest state instead. The newest version is always kept.
    # None: twice the model's bytes (a chain of deltas bigger than that costs more than the keyframe it
    # replaces), and at least MIN_HISTORY_BYTES
    history_bytes: int | None = None
    metrics_port: int | None = None  # serve Prometheus metrics on this port (0: any free one); None: no metrics
    metrics_host: str = "127.0.0.1"  # where the metrics endpoint listens: loopback unless asked otherwise


MIN_HISTORY_BYTES = 256 << 20
DEVICE_BODY_SCHEMES = ("local", "nccl")  # links that move CUDA tensors as they are (IPC handles, NCCL)


def _warn_if_open(address: str, token) -> None:
    """Without a token anyone who reaches a tcp port can subscribe and take the weights: fine on loopback,
    worth a warning anywhere else (0.0.0.0 included), since nothing else would say so."""
    a = parse_address(address)
    if a.scheme != "tcp" or token is not None:
        return
    try:
        loopback = ipaddress.ip_address(a.host).is_loopback
    except ValueError:
        loopback = a.host == "localhost"
    if not loopback:
        log.warning("publisher at %s listens beyond this machine without a token: anyone who reaches the port "
                    "can subscribe and read the weights; pass token=wsync.tokens.load() (WSYNC_TOKEN), or "
                    "wsync serve --token-file PATH", address)


@dataclass(frozen=True, kw_only=True)
class PublisherStats:
    """A copy of the publisher's counters at one moment (Publisher.stats); per-version maps hold the newest 1000.

    versions: versions encoded. bytes: version -> bytes of its encoded buckets (None: a keyframe of a frozen
    state, encoded afresh for each subscriber that needs one). encode_s: version -> seconds its encoding took.
    send_s: version -> seconds from publish() until every live subscriber's link had all of its buckets (a
    version no subscriber was sent has none). history_bytes: bytes the catch-up history holds.
    """

    versions: int
    bytes: dict[int, int | None]
    encode_s: dict[int, float]
    send_s: dict[int, float]
    history_bytes: int


KEPT_PER_VERSION = 1000  # entries of each per-version map in the stats (and publish times awaiting their send)


class FlushTimeout(WsyncError, TimeoutError):
    """flush() ran out of time; the message names each subscriber left behind and the version it holds."""


class Publisher:
    def __init__(self, address: str, *, token=None, listen_opts: dict | None = None, quantize=None, **config):
        """quantize: send what the engine's quantized checkpoint holds instead of the trainer's weights (a
        wsync.quant.Quantizer, or a quantized model's config for wsync.quant.from_config): each version's
        targeted weights become their codes and scales before the snapshot; deltas, digests and catch-up are
        then of the quantized state."""
        self.config = PublisherConfig(**config)
        if self.config.codec not in ("delta", "raw"):
            raise ValueError(f"codec must be 'delta' or 'raw', got {self.config.codec!r}")
        cap = self.config.history_bytes
        if cap is not None and (not isinstance(cap, int) or cap <= 0):
            raise ValueError(f"history_bytes must be a positive number of bytes, got {self.config.history_bytes!r}")
        self._quantize = quant.as_quantizer(quantize, backend=self.config.backend)
        self._listener = listen(address, **with_token(listen_opts, token))
        self.address = self._listener.address
        # a device state's payloads stay on the device where the link carries device memory and the tier
        # needs no host stage (zstd, v2): raw and sparse
        self._device_bodies = parse_address(address).scheme in DEVICE_BODY_SCHEMES \
            and (self.config.codec == "raw" or self.config.tier == "sparse")
        _warn_if_open(address, token)
        self._history = History()
        self._model_bytes = 0  # bytes of the newest layout's tensors (for the default history_bytes)
        self._cv = threading.Condition()
        self._state: State | None = None  # newest state handed to the encoder
        self._on_demand: Keyframe | None = None  # keyframe of the newest state, for subscribers that lost their way
        self._spare: State | None = None  # an old state's arrays, reused by the next snapshot (no fresh pages)
        self._spare_wanted = False  # the last publish() copied host memory, so a spare would be used
        # states that became keyframes are never recycled: a sender may still be encoding one after history moved on
        self._keyframe_states: deque[int] = deque(maxlen=64)
        # the newest version, for publish() to measure host-memory states against (mirror.py)
        self._mirror = Mirror(backends.kernels(self.config.backend))
        self._published = 0  # versions accepted by publish()
        self._published_at: dict[int, float] = {}  # version -> wall clock of publish(), sent for publish->live latency
        self._notes: dict[int, dict | None] = {}  # version -> publish()'s note, sent with each of its buckets
        self._unsent: dict[int, float] = {}  # version -> perf_counter at publish(), until it is on every link (_cv)
        self._send_s: dict[int, float] = {}  # version -> seconds from publish() to on every live link (_cv)
        self._since_keyframe = 0
        self._last: int | None = None
        self._last_layout: tuple | None = None  # the last version's bucket layouts (hashes)
        self._host_trainer = False  # the last publish() was handed a state it could bind (not a path)
        self._bind = _Binder()
        self._device_pending = False  # a device snapshot is queued or being encoded
        self._peers: list[Sender] = []
        self._taken: dict[int, int] = {}  # version -> acknowledgements of it, from subscribers gone since too
        self._error: BaseException | None = None
        self._closed = False
        self._queue: queue.Queue = queue.Queue(self.config.max_queued)
        # written by the encoder thread, read by the trainer's: only under _stats_lock, read as a copy (stats)
        self._stats_lock = threading.Lock()
        self._encoded = 0
        self._bytes: dict[int, int | None] = {}
        self._encode_s: dict[int, float] = {}
        self.metrics = self._start_metrics()
        self._threads = [threading.Thread(target=self._encode_loop, name="wsync-encode", daemon=True),
                         threading.Thread(target=self._accept_loop, name="wsync-accept", daemon=True)]
        for t in self._threads:
            t.start()
        close_at_exit(self)

    def _start_metrics(self):
        if self.config.metrics_port is None:
            return None
        from .metrics import PublisherMetrics

        try:
            return PublisherMetrics(self.config.metrics_port, self.config.metrics_host)
        except BaseException:
            self._listener.close()  # no half-built publisher left listening
            raise

    # -- trainer-facing ----------------------------------------------------------------------

    def publish(self, state, version: int, *, frozen: bool = False, note: dict | None = None) -> None:
        """Snapshot `state` (a state_dict, dict of arrays, or checkpoint path) as `version` and send it behind.

        note: a small JSON object (at most NOTE_BYTES as JSON) that travels with the version and is what a
        subscriber's ``note`` says once it serves it: what the version is, beyond its number (a channel's
        release names the trained version it holds, see wsync.channels).
        frozen: the caller promises the state's memory never changes while the publisher may read it (a
        read-only mapping of a settled file, as `wsync serve` has). It is then encoded where it lies, never
        copied, never made the mirror; a keyframe of it is encoded anew for each subscriber that needs one,
        a bucket at a time, and not kept: the publisher holds no copy of the model, encoded or not."""
        self._raise_pending()
        if self._closed:
            raise WsyncError("publisher is closed")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"version must be a non-negative int, got {version!r}")
        if self._last is not None and version <= self._last:
            raise VersionError(f"versions must increase: got {version} after {self._last}")
        note = check_note(note)
        if self._quantize is not None:
            if frozen or not isinstance(state, dict):
                raise TypeError("a quantizing publisher takes the trainer's state dict (not a path, not frozen): "
                                "it quantizes every version it is handed")
            state = self._quantize(state)
        # a frozen state is read where it lies: binding would copy what it may not write (a read-only mapping)
        live = None if frozen else self._bind(state, self.config.bucket_bytes)
        on_device = isinstance(live, DeviceSource)
        with self._cv:
            self._host_trainer = live is not None and not on_device  # worth keeping a host mirror for (not frozen)
            self._published_at[version] = time.time()  # before the encoder can start on it
            self._unsent[version] = time.perf_counter()
            self._notes[version] = note
            for d in (self._published_at, self._unsent, self._notes):
                _keep_newest(d)
        make_kf = self._publish_device(version, live) if on_device \
            else self._publish_host(version, state, live, frozen=frozen)
        with self._cv:  # the encoder thread reads _last
            self._last = version
        self._published += 1
        self._since_keyframe = 1 if make_kf else self._since_keyframe + 1
        if self.metrics is not None:
            self.metrics.published(version)

    def _keyframe_due(self, layout: tuple | None) -> bool:
        return keyframe_due(self._published, self._since_keyframe, self.config.keyframe_every) \
            or layout is None or layout != self._last_layout

    def _publish_host(self, version: int, state, live: Bound | None, *, frozen: bool = False) -> bool:
        """Measure `live` against the mirror, or copy it (or a path's state) for the encoder; True: a keyframe.

        frozen: hand the state itself to the encoder (see publish)."""
        if frozen:
            if isinstance(state, dict) and any(off_host(t) for t in state.values()):
                raise ValueError("publish(frozen=True) is for host memory that never changes (a mapped file); "
                                 "device tensors are snapshotted: publish them without frozen")
            snap = _Frozen(as_state(state))
            make_kf = self._keyframe_due(self._layout(snap))
            with self._cv:
                self._spare_wanted = False
            self._queue.put((version, snap, make_kf))
            self._last_layout = self._layout(snap)
            return make_kf
        layout = self._layout(live) if live is not None else None
        make_kf = self._keyframe_due(layout)
        if live is None or make_kf or not self._publish_live(version, live):
            snap = Copying(live if live is not None else state, into=self._take_spare())
            with self._cv:
                self._spare_wanted = snap.on_host  # else a spare would never be used
            self._queue.put((version, snap, make_kf))
            snap.run([m.names for m in self._buckets(snap)])  # bucket by bucket: the encoder starts on each
            self._last_layout = self._layout(snap) if layout is None else layout
        return make_kf

    def _publish_device(self, version: int, src: DeviceSource) -> bool:
        """Snapshot a device state on the GPU (queued on the caller's stream) and hand it to the encoder."""
        make_kf = self._keyframe_due(src.key)
        with self._cv:
            # one device snapshot waits for the encoder at most: each is a copy of the model on the trainer's GPU,
            # and the encoder keeps the previous one as its base
            while self._device_pending and not self._closed and self._error is None:
                self._cv.wait(1.0)
        self._raise_pending()
        with self._cv:
            self._device_pending = True
        try:
            snap = src.snapshot(self._take_spare(device=True))
        except BaseException:
            with self._cv:
                self._device_pending = False
            raise
        with self._cv:
            self._spare_wanted = False  # the encoder recycles device states itself; host spares would not fit
        self._queue.put((version, snap, make_kf))
        self._last_layout = src.key
        return make_kf

    def _publish_live(self, version: int, live: State) -> bool:
        """The delta from the mirror to `live`, measured here (see mirror.py); False if the mirror is not ready."""
        m = self._mirror
        if not self.config.live or self.config.codec != "delta" or m.version is None or m.version != self._last:
            return False  # the encoder has not made the previous version the mirror (yet); its layout is the last
        job = LiveDelta(m, live, self._buckets(live), tier=self.config.tier, kernels=m.kernels)
        with self._cv:
            self._spare_wanted = False
        self._queue.put((version, job, False))
        with m.lock:
            try:
                job.run()  # the encoder packs and sends each group while this measures the next
            except BaseException as e:
                m.invalidate()  # half written: the next version is a keyframe
                self._last_layout = None
                raise SnapshotError(f"publishing version {version} failed while reading the state: {e!r}") from e
            m.version = version
        return True

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every version so far is encoded and acknowledged by every connected subscriber.

        With a timeout, raises FlushTimeout naming each subscriber still behind (a frozen one would
        otherwise hold the caller forever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._queue.join()
        with self._cv:
            while not self._flushed():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise FlushTimeout(f"flush: after {timeout:g}s, subscribers still behind version "
                                       f"{self._history.newest}: {', '.join(self._behind())}")
                self._cv.wait(left if left is not None else 1.0)
        self._raise_pending()

    def _flushed(self) -> bool:
        newest = self._history.newest
        return all(p.dead or p.acked == newest for p in self._peers)

    def behind(self) -> list[str]:
        """Each live subscriber not yet at the newest version: its address and the version it acknowledged."""
        with self._cv:
            return self._behind()

    def _behind(self) -> list[str]:
        newest = self._history.newest
        return [f"{p.link.peer} (holds {'nothing' if p.acked is None else f'version {p.acked}'})"
                for p in self._peers if not p.dead and p.acked != newest]

    @property
    def stats(self) -> PublisherStats:
        """A consistent copy of the counters (see PublisherStats), safe from any thread; the caller may keep it.

        A version is counted once its encoding ends, which can be after a subscriber has committed it
        (pieces stream while they are packed): flush() first to read a version just published."""
        with self._stats_lock:
            versions, nbytes, encode_s = self._encoded, dict(self._bytes), dict(self._encode_s)
        with self._cv:
            return PublisherStats(versions=versions, bytes=nbytes, encode_s=encode_s, send_s=dict(self._send_s),
                                  history_bytes=self._history.held_bytes())

    @property
    def newest(self) -> int | None:
        """The newest version published (None before the first)."""
        return self._last

    @property
    def subscribers(self) -> int:
        """Subscribers connected and greeted (a broadcast group counts each member)."""
        with self._cv:
            return sum(p.fanout for p in self._peers if not p.dead and p.greeted)

    def wait_for_subscribers(self, n: int, timeout: float | None = None) -> int:
        """Block until at least n subscribers are connected; returns how many are."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (have := self.subscribers) < n:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{have} of {n} subscribers connected")
            with self._cv:
                self._cv.wait(0.2)
        return have

    def wait_taken(self, timeout: float | None = None) -> int:
        """Block until a subscriber has acknowledged the newest version, or timeout seconds pass; returns how
        many acknowledgements of it arrived (0: nobody took it), counting subscribers that have left since."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while not self._taken.get(self._history.newest, 0):
                left = None if deadline is None else deadline - time.monotonic()
                if self._closed or (left is not None and left <= 0):
                    break
                self._cv.wait(min(left, 1.0) if left is not None else 1.0)
            return self._taken.get(self._history.newest, 0)

    def _took(self, version, n: int) -> None:
        """n subscribers acknowledged version. Holds _cv."""
        if isinstance(version, int):
            self._taken[version] = self._taken.get(version, 0) + n
            _keep_newest(self._taken)

    def close(self) -> None:
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
            peers = list(self._peers)
        self._queue.put(None)
        self._listener.close()
        for p in peers:
            p.stop()
        deadline = time.monotonic() + 10  # for every thread together: a stuck link must not cost 10 s each
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        for p in peers:
            p.join(deadline)
        if self.metrics is not None:
            self.metrics.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _raise_pending(self) -> None:
        with self._cv:  # the encoder thread sets it
            err, self._error = self._error, None
        if err is not None:
            raise err

    # -- encoding ------------------------------------------------------------------------------

    def _encode_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                version, job, make_kf = item
                if isinstance(job, LiveDelta):
                    self._encode_live(version, job)
                else:
                    self._encode_version(version, job, make_kf)
            except SnapshotError:
                pass  # publish() failed while reading the state, and raised that to its caller: no such version
            except BaseException as e:  # surfaces at the next publish()/flush()
                log.exception("encoding a version failed")
                with self._cv:
                    self._error = e
                if self.metrics is not None:
                    self.metrics.failed(e)
            finally:
                if item is not None and isinstance(item[1], DeviceState):
                    with self._cv:
                        self._device_pending = False
                        self._cv.notify_all()
                self._queue.task_done()

    def _encode_version(self, version: int, state: State, make_kf: bool) -> None:
        """A version publish() copied: a keyframe, or a delta against the state before it."""
        cfg, prev = self.config, self._state
        t0 = time.perf_counter()
        checksum = None  # the state's digest, known once its buckets are encoded (from their checksums)
        same_layout = prev is not None and isinstance(prev, DeviceState) == isinstance(state, DeviceState) \
            and self._layout(prev) == self._layout(state)
        make_kf = make_kf or not same_layout
        if not same_layout:  # once per layout, off the trainer's path
            size = sum(tb.nbytes for _, tb in state.items())
            with self._cv:
                self._model_bytes = size
        if make_kf:
            wait_copied(state, state)  # a keyframe stays in the history: never register one half copied
        delta = None
        if same_layout:
            delta = EncodedVersion(version, self._history.newest, checksum, len(self._buckets(state)))
        with self._cv:
            if make_kf:
                self._history.add_keyframe(version, state, checksum, delta)
                if not isinstance(state, DeviceState):
                    self._keyframe_states.append(id(state))
            else:
                self._history.add_delta(delta)
            kf = self._history.keyframe
            self._state = state
            self._cv.notify_all()
        sums = None  # each tensor's checksum, from the encoding (a mirror made of this state needs them)
        if delta is not None:
            try:
                sums = self._fill(delta, self._encoder(delta, prev, state))
            except BaseException:
                with self._cv:
                    if self._state is state:  # the version failed: the next one is a delta against prev
                        self._state = prev
                raise
        if make_kf and isinstance(state, DeviceState):
            self._keyframe_to_host(kf)
        with self._cv:
            self._recycle(prev)  # only now: _fill read prev as the delta's base
            adopt = cfg.live and cfg.codec == "delta" and self._host_trainer and self._last == version
        if adopt:
            self._adopt(version, state, sums)
        self._record(version, t0, delta)
        self._prepare_spare(state)

    def _keyframe_to_host(self, kf: Keyframe) -> None:
        """A device keyframe is encoded now, to host bytes, and its device state let go: the history would
        otherwise hold a model-sized device buffer for as long as the keyframe stays the newest."""
        try:
            self._keyframe_buckets(kf, host=True)
        finally:
            kf.state = None

    def _adopt(self, version: int, state: State, sums: dict[str, str] | None) -> None:
        """Make a copied version the mirror, so the next publish() measures against it (see mirror.py).

        A state the history keeps as a keyframe must not change, so the mirror
        gets a copy of it (here, behind publish()); any other becomes the
        mirror itself, decided under _cv so a sender never takes it for an
        on-demand keyframe at the same moment.
        """
        with self._cv:
            copy = id(state) in self._keyframe_states
            if not copy:
                bound = state if isinstance(state, Bound) else Bound(state)  # one object: the mirror is the state
                if self._state is state:
                    self._state = bound
                self._recycle(self._mirror.adopt(version, bound, copy=False, sums=sums))
        if copy:
            self._mirror.adopt(version, state, copy=True)  # into the old mirror's arrays

    def _encode_live(self, version: int, job: LiveDelta) -> None:
        """A version publish() is measuring against the mirror: pack each group as it comes."""
        cfg, prev = self.config, self._state
        t0 = time.perf_counter()
        enc = EncodedVersion(version, job.base_version, None, job.count)
        with self._cv:
            self._history.add_delta(enc)
            self._state = self._mirror.state
            self._cv.notify_all()

        def payload(i):
            return api.encode_measured(job.wait(i), job.groups[i], tier=cfg.tier, version=version,
                                       base_version=job.base_version, level=cfg.level, backend=cfg.backend)
        try:
            self._fill(enc, payload)
        except SnapshotError:
            with self._cv:
                if self._state is self._mirror.state:
                    self._state = None  # half written: the next version is a keyframe
            raise
        with self._cv:
            self._recycle(prev)
        self._record(version, t0, enc)

    def _record(self, version: int, t0: float, enc: EncodedVersion | None) -> None:
        seconds = time.perf_counter() - t0
        with self._stats_lock:
            self._encoded += 1
            self._encode_s[version] = seconds
            self._bytes[version] = enc.nbytes if enc else None
            _keep_newest(self._encode_s)
            _keep_newest(self._bytes)
        if self.metrics is not None:
            self.metrics.encoded(version, seconds)

    def _prepare_spare(self, state: State) -> None:
        """While nothing waits to be encoded, fault in a spare for the next publish() if none was recycled.

        A keyframe's state stays in the history, so the publish() after one
        (and the one after that, whose base it is) would find no spare and copy
        into fresh pages, faulting each in on the trainer's critical path; done
        now, that costs the encoder's idle time instead.
        """
        with self._cv:
            if self._spare is not None or not self._spare_wanted or not self._queue.empty() or self._closed \
                    or isinstance(state, DeviceState):
                return
        spare = blank_like(state)
        with self._cv:
            if self._spare is None:
                self._spare = spare

    def _history_cap(self) -> int:
        """Bytes of encoded versions the history may hold (see PublisherConfig.history_bytes). Holds _cv."""
        if self._device_bodies and isinstance(self._state, DeviceState):  # bodies in device memory: the newest alone
            return 1
        if self.config.history_bytes is not None:
            return self.config.history_bytes
        return max(2 * self._model_bytes, MIN_HISTORY_BYTES)

    def _buckets(self, state: State) -> list[Layout]:
        """The layout of each bucket of state (computed once per Bound, and for a plain state each time)."""
        if isinstance(state, DeviceState):
            return state.buckets

        def make():
            return [layout_of(state, names) for names in
                    plan_buckets([(n, tb.nbytes) for n, tb in state.items()], self.config.bucket_bytes)]
        if isinstance(state, (Bound, Copying, _Frozen)):
            return state.cached(("buckets", self.config.bucket_bytes), make)
        return make()

    def _layout(self, state: State) -> tuple:
        return tuple(m.hash for m in self._buckets(state))

    def _fill(self, enc: EncodedVersion, payload) -> dict[str, str]:
        """Encode a version bucket by bucket (payload(i) makes bucket i of enc.count), waking senders after each.

        Returns each segment's checksum (as its manifest gives it)."""
        sums = []  # (key, dtype, (numel,), checksum) of every segment: the version digest, without another pass
        try:
            for i in range(enc.count):
                p = payload(i)
                msg = self._message(enc, i, p, sums)
                last = i == enc.count - 1
                meta = msg.meta
                with self._cv:
                    if last:
                        enc.checksum = meta["checksum"]
                        self._history.known(enc.version, enc.checksum)
                    enc.buckets.append(msg)
                    enc.nbytes += msg.nbytes
                    self._history.trim(self._history_cap())
                    self._cv.notify_all()
                if self.metrics is not None:
                    self.metrics.sent_bytes(p.manifest.codec, msg.nbytes)
            return {name: csum for name, _, _, csum in sums}
        except BaseException as e:
            with self._cv:
                enc.error = e
                self._history.drop(enc.version)
                self._cv.notify_all()
            raise

    def _message(self, enc: EncodedVersion, i: int, p, sums: list) -> Message:
        """Bucket i of enc as a message; sums collects each segment's checksum record, in order."""
        with self._cv:
            at = self._published_at.get(enc.version)  # publish()'s wall clock: subscribers measure latency from it
            note = self._notes.get(enc.version)
        sums += [(t.name, t.dtype, (t.numel,), t.checksum) for t in p.manifest.tensors]
        last = i == enc.count - 1
        # the digest of the whole version rides on its last bucket, the one the subscriber applies after
        meta = {"version": enc.version, "base_version": enc.base_version, "index": i, "count": enc.count,
                "checksum": state_digest(sums) if last else None, "published_at": at}
        if note is not None:
            meta["note"] = note
        return Message("bucket", meta, [p.header(), p.body])

    def _encoder(self, enc: EncodedVersion, base: State | None, state: State, host: bool = False):
        """payload(i) for _fill: bucket i of state, as a delta against base (raw if base is None).

        A device state's payloads keep their bodies on the device where the link carries device memory
        (unless host: a keyframe kept in the history)."""
        cfg, groups = self.config, self._buckets(state)
        codec = "raw" if base is None else cfg.codec

        backend = cfg.backend
        if isinstance(state, DeviceState):
            backend = "device-body" if self._device_bodies and not host else "device"

        def payload(i):
            wait_copied(state, groups[i].names)  # publish() may still be copying this bucket
            # a keyframe carries its layout; deltas name it by hash
            return api.encode(base if codec == "delta" else None, state, codec=codec, tier=cfg.tier,
                              version=enc.version, base_version=enc.base_version, level=cfg.level,
                              backend=backend, members=groups[i], inline=codec == "raw")
        return payload

    def _keyframe_buckets(self, kf: Keyframe, host: bool = False) -> EncodedVersion:
        """The raw encoding of a keyframe, made once on first use (by whichever sender needs it).

        The history's keyframe is encoded to host bytes (host): it stays for many versions, and a device
        body would hold a model's worth of device memory all that time."""
        if isinstance(kf.state, _Frozen):
            return self._streamed_keyframe(kf)
        with self._cv:
            host = host or kf is self._history.keyframe
        with kf.lock:
            if kf.encoded is None:
                enc = EncodedVersion(kf.version, None, kf.checksum, len(self._buckets(kf.state)))
                self._fill(enc, self._encoder(enc, None, kf.state, host=host))
                kf.checksum, kf.encoded = enc.checksum, enc
            return kf.encoded

    def _streamed_keyframe(self, kf: Keyframe) -> EncodedVersion:
        """A keyframe of a frozen state for one sender: each bucket encoded as it asks for it, and let go
        once sent, so serving any number of subscribers holds one bucket per sender, never the model."""
        enc = EncodedVersion(kf.version, None, kf.checksum, len(self._buckets(kf.state)))
        payload, sums = self._encoder(enc, None, kf.state), []

        def make(i: int) -> Message:
            msg = self._message(enc, i, payload(i), sums)
            if i == enc.count - 1:
                with self._cv:
                    enc.checksum = kf.checksum = msg.meta["checksum"]
                    self._history.known(enc.version, enc.checksum)
            if self.metrics is not None:
                self.metrics.sent_bytes("raw", msg.nbytes)
            return msg
        enc.make = make
        return enc

    def _recycle(self, old: State | None) -> None:
        """Keep a state no one needs any more, so the next publish() copies into warm memory. Holds _cv."""
        if old is not None and old is not self._state and old is not self._mirror.state \
                and id(old) not in self._keyframe_states and not isinstance(old, _Frozen):
            self._spare = old

    def _take_spare(self, device: bool = False) -> State | None:
        """The spare, if it is of the kind asked for (host arrays, or a device state's buffers)."""
        with self._cv:
            if isinstance(self._spare, DeviceState) != device:
                return None
            spare, self._spare = self._spare, None
            return spare

    def _on_links(self) -> None:
        """Under _cv, when a sender has sent a version or gone: each version published that every live
        subscriber's link now has whole gets its send time."""
        live = [p for p in self._peers if p.greeted and not p.dead]
        if not live or not self._unsent:
            return
        sent = min(-1 if p.sent is None else p.sent for p in live)
        now = time.perf_counter()
        for v in [v for v in self._unsent if v <= sent]:
            self._send_s[v] = now - self._unsent.pop(v)
        _keep_newest(self._send_s)

    # -- serving subscribers ---------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                link = self._listener.accept(timeout=0.5)
            except WsyncError as e:
                if self._closed:
                    return
                log.warning("accept failed: %s", e)
                continue
            except OSError:
                if self._closed:
                    return
                raise
            if link is None:
                continue
            peer = Sender(self, link)
            with self._cv:
                self._peers = [p for p in self._peers if not p.dead] + [peer]
            peer.start()

    def _next_for(self, peer: "Sender") -> tuple[Keyframe | None, list[EncodedVersion]] | None:
        """Block until the peer is behind the newest version (or closing); return what to send."""
        with self._cv:
            while True:
                if self._closed or peer.dead:
                    return None
                newest = self._history.newest
                if newest is not None and (peer.need_keyframe or peer.sent != newest):
                    if peer.need_keyframe:
                        kf, deltas = self._fresh_keyframe(), []
                    else:
                        kf, deltas = self._history.catch_up(peer.sent, peer.sent_checksum)
                        if kf is not None and (peer.sent is not None and kf.version <= peer.sent
                                               or not self._history.keyframe_chain_kept()):
                            # it holds something numbered at or past the stored keyframe that we cannot vouch
                            # for, or versions after the keyframe were dropped to bound memory: a keyframe of
                            # the newest state moves it forward instead
                            kf, deltas = self._fresh_keyframe(), []
                    if kf is not None or deltas:
                        peer.need_keyframe = False
                        return kf, deltas
                self._cv.wait(1.0)  # nothing to send yet, or no keyframe of the newest state to be had yet

    def _fresh_keyframe(self) -> Keyframe | None:
        """A keyframe of the newest state (shared by every peer that needs one at this version). Holds _cv.

        None when the newest state cannot be had right now: publish() has
        already written a later version into the mirror, and the encoder will
        register it shortly (or the mirror was lost, and the next version is a
        keyframe anyway).
        """
        h = self._history
        if h.keyframe.version == h.newest:
            return h.keyframe
        if self._on_demand is None or self._on_demand.version != h.newest:
            state = self._state
            if state is not None and state is self._mirror.state:
                state = self._mirror.freeze(h.newest)  # publish() writes into the mirror: keep a copy
            if state is None:
                return None
            self._on_demand = Keyframe(h.newest, state, h.checksums[h.newest])
            self._keyframe_states.append(id(state))
        return self._on_demand

    def _wait_bucket(self, enc: EncodedVersion, i: int):
        if enc.make is not None:  # encoded now, for this sender alone
            try:
                return enc.make(i)
            except WsyncError as e:
                log.error("encoding bucket %d of version %s failed: %s", i, enc.version, e)
                return None
        with self._cv:
            while len(enc.buckets) <= i and enc.error is None and not self._closed:
                self._cv.wait(1.0)
            if enc.error is not None or self._closed:
                return None
            return enc.buckets[i]


def _keep_newest(d: dict) -> None:
    """Drop a per-version map's oldest entries (insertion order is version order) past KEPT_PER_VERSION."""
    while len(d) > KEPT_PER_VERSION:
        d.pop(next(iter(d)))


class _Frozen(dict):
    """A state publish() was promised never changes (publish(frozen=True)): encoded where it lies."""

    def __init__(self, state: State):
        super().__init__(state)
        self._cached: dict = {}

    def cached(self, key, make):
        """A value computed once per key for this state (its bucket layouts)."""
        if key not in self._cached:
            self._cached[key] = make()
        return self._cached[key]


class _Binder:
    """The Bound of the state publish() was handed, built once and found again by identity.

    Trainers call publish(model.state_dict()) every version: a fresh dict of
    the same tensors, in the same order. Its names and the tensors' addresses
    are compared with the last ones (a few C-level calls, no Python per
    tensor); when they match, the Bound built then still views or copies the
    same memory, and its layout and segment tables are reused.
    """

    def __init__(self):
        self._key: tuple | None = None
        self._bound: Bound | DeviceSource | None = None

    def __call__(self, state, bucket_bytes: int) -> Bound | DeviceSource | None:
        """What to read `state` from: its tensors on one GPU (a DeviceSource, where the GPU kernels load),
        else a Bound, read afresh; None for what is no dict (a path)."""
        if isinstance(state, Bound):
            bound = state
            if state.sources and len(state.sources) == len(state):  # it had to copy every tensor: a device state?
                bound = state.cached(("device", bucket_bytes), lambda: _device_source(state.sources, bucket_bytes)) \
                    or state
        elif isinstance(state, dict):
            key = _identity(state)
            if key is None or key != self._key or self._bound.bucket_bytes != bucket_bytes:
                named = unique_tensors(state)
                self._bound, self._key = _device_source(named, bucket_bytes) or bind(named), key
                self._bound.bucket_bytes = bucket_bytes
            bound = self._bound
        else:
            return None
        if isinstance(bound, DeviceSource):
            return bound
        bound.refresh()  # a Bound never means a snapshot: what it had to copy is read again
        return bound


def _device_source(named: dict, bucket_bytes: int) -> DeviceSource | None:
    k = on_one_device(named)
    return DeviceSource(named, k, bucket_bytes) if k is not None else None


def _identity(state: dict) -> tuple | None:
    """The names, addresses and sizes of a state's tensors, or None if they are not all torch tensors.

    Addresses are unique across host and GPUs (CUDA's unified addressing), so they name the memory; the
    element counts catch a tensor of another size that landed at a freed one's address. (Shapes cost a Python
    tuple per tensor to read, and a tensor reshaped in place keeps its bytes.)"""
    torch = sys.modules.get("torch")  # no torch imported: no torch tensors to find (numpy states bind each time)
    if torch is None:
        return None
    values = list(state.values())
    try:
        ptrs = list(map(torch.Tensor.data_ptr, values))
        sizes = list(map(torch.Tensor.numel, values))
    except TypeError:
        return None
    return tuple(state), ptrs, sizes

