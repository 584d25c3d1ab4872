"""Prometheus metrics of the sync, one endpoint per Publisher or Subscriber.

    pub = wsync.Publisher("tcp://0.0.0.0:7070", token=..., metrics_port=9400)   # http://127.0.0.1:9400/metrics
    sub = wsync.Subscriber(addr, engine=..., token=..., metrics_port=9401)

prometheus_client is optional (``pip install wsync[metrics]``) and imported only
when a port is given. Each instance has its own CollectorRegistry, never the
process-global one, so a trainer, a relay and a few subscribers in one process
each serve their own numbers without clashing. The endpoint listens on
127.0.0.1 unless told otherwise: metrics name peers and versions, which is
nobody else's business by default.

Publish -> live latency is measured by the subscriber against the publisher's
wall clock (sent with each version), so across hosts it includes their clock
offset; keep the clocks synchronised (NTP) for it to mean anything.

The endpoint holds at most ``max_connections`` connections (default 16), each
served by its own thread, so the threads it runs stay at that number plus one
that accepts, whatever connects. When one more arrives, the connection that has
been open longest is closed to make room: holding connections open cannot shut
out a scraper that connects and asks at once; only opening ``max_connections``
new ones within the milliseconds its scrape takes could.
Each connection has ``deadline_s`` seconds (default 5) from its accept for the
whole exchange: a client that sends nothing, trickles its request a byte at a
time, or does not read the reply is dropped when they run out.
"""
from __future__ import annotations

import io
import socket
import threading
import time
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from .errors import BackendUnavailable

# seconds: from a few ms (a delta on loopback) to minutes (a keyframe over a WAN)
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _client():
    try:
        import prometheus_client
    except ImportError as e:
        raise BackendUnavailable("metrics_port needs prometheus_client (pip install 'wsync[metrics]')") from e
    return prometheus_client


class _DeadlineSocket(io.RawIOBase):
    """A connection's reads and writes, each given only the time its deadline has left.

    A timeout per recv would let a client that trickles a byte just inside it hold
    the connection for ever; one deadline for the whole exchange cannot be stretched.
    """

    def __init__(self, sock: socket.socket, deadline: float):
        self._sock, self._deadline = sock, deadline

    def _arm(self) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("metrics connection ran past its deadline")
        self._sock.settimeout(left)

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        self._arm()
        return self._sock.recv_into(buf)

    def write(self, data) -> int:
        self._arm()
        self._sock.sendall(data)
        return len(data)


class _Handler(WSGIRequestHandler):
    def setup(self):
        self.connection = self.request
        raw = _DeadlineSocket(self.request, time.monotonic() + self.server.deadline_s)
        self.rfile, self.wfile = io.BufferedReader(raw), raw

    def log_message(self, format, *args):
        """A scrape is not worth a line on stderr."""


class _CappedServer(WSGIServer):
    """HTTP on a bounded set of connections, each with a deadline (see the module docstring)."""

    request_queue_size = 128  # a burst of connects waits in the kernel, not refused there
    block_on_close = False

    def __init__(self, address, max_connections: int, deadline_s: float):
        if max_connections < 1 or not deadline_s > 0:
            raise ValueError(f"metrics endpoint needs max_connections >= 1 and deadline_s > 0, "
                             f"got {max_connections} and {deadline_s}")
        self.address_family = socket.getaddrinfo(address[0], address[1], type=socket.SOCK_STREAM,
                                                 flags=socket.AI_PASSIVE)[0][0]
        self.max_connections, self.deadline_s = max_connections, deadline_s
        self._live: dict[socket.socket, None] = {}  # insertion order: the oldest first
        self._threads: list[threading.Thread] = []  # only the accepting thread touches it
        self._lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request, client_address):
        give_up = time.monotonic() + self.deadline_s
        while True:
            # a thread counts until it has ended, not merely let go of its socket, so the bound is strict
            self._threads = [t for t in self._threads if t.is_alive()]
            if len(self._threads) < self.max_connections:
                break
            if time.monotonic() > give_up:
                self.shutdown_request(request)
                return
            with self._lock:
                if len(self._live) >= self.max_connections:
                    oldest = next(iter(self._live))
                    del self._live[oldest]
                    _drop(oldest)
            self._threads[0].join(0.01)
        with self._lock:
            self._live[request] = None
        t = threading.Thread(target=self._serve, args=(request, client_address), daemon=True,
                             name="wsync-metrics-conn")
        self._threads.append(t)
        t.start()

    def _serve(self, request, client_address):
        try:
            self.finish_request(request, client_address)
        except OSError:  # a dropped or timed-out client is routine, not worth a traceback
            pass
        except Exception:
            self.handle_error(request, client_address)
        finally:
            with self._lock:
                self._live.pop(request, None)
            self.shutdown_request(request)

    def close_all(self) -> None:
        with self._lock:
            for sock in list(self._live):
                _drop(sock)


def _drop(sock: socket.socket) -> None:
    """Unblock whichever thread serves sock; that thread closes it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Endpoint:
    """A private registry and the HTTP server that exposes it."""

    def __init__(self, port: int, host: str, max_connections: int = 16, deadline_s: float = 5.0):
        pc = _client()
        self.pc = pc
        self.registry = pc.CollectorRegistry()
        self._server = _CappedServer((host, port), max_connections, deadline_s)
        self._server.set_app(pc.make_wsgi_app(self.registry))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="wsync-metrics")
        self._thread.start()
        self.address: tuple[str, int] = (host, self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.address[0]}:{self.address[1]}/metrics"

    def _counter(self, name, doc, labels=()):
        return self.pc.Counter(name, doc, labels, registry=self.registry)

    def _histogram(self, name, doc):
        return self.pc.Histogram(name, doc, buckets=_BUCKETS, registry=self.registry)

    def _gauge(self, name, doc):
        return self.pc.Gauge(name, doc, registry=self.registry)

    def failed(self, error: BaseException) -> None:
        self.failures.labels(type(error).__name__).inc()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._server.close_all()


class PublisherMetrics(_Endpoint):
    def __init__(self, port: int, host: str = "127.0.0.1", **limits):
        super().__init__(port, host, **limits)
        self.versions = self._counter("wsync_versions_published", "versions accepted by publish()")
        self.newest = self._gauge("wsync_newest_version", "the newest version published")
        self.bytes = self._counter("wsync_encoded_bytes", "bytes of encoded buckets, by codec", ["codec"])
        self.encode = self._histogram("wsync_encode_seconds", "encoding one version")
        self.failures = self._counter("wsync_failures", "versions that failed to encode, by error type", ["error"])

    def published(self, version: int) -> None:
        self.versions.inc()
        self.newest.set(version)

    def sent_bytes(self, codec: str, nbytes: int) -> None:
        self.bytes.labels(codec).inc(nbytes)

    def encoded(self, version: int, seconds: float) -> None:
        self.encode.observe(seconds)


class SubscriberMetrics(_Endpoint):
    def __init__(self, port: int, host: str = "127.0.0.1", **limits):
        super().__init__(port, host, **limits)
        self.versions = self._counter("wsync_versions_committed", "versions the engine committed")
        self.version = self._gauge("wsync_engine_version", "the version the engine serves")
        self.bytes = self._counter("wsync_received_bytes", "bytes of committed versions, by codec", ["codec"])
        self.apply = self._histogram("wsync_apply_seconds", "applying one version to the engine (the transaction)")
        self.latency = self._histogram("wsync_publish_to_live_seconds",
                                       "publish() on the trainer to the version live in the engine")
        self.lag = self._gauge("wsync_lag_versions", "newest version announced minus the version served")
        self.failures = self._counter("wsync_failures", "applies refused, by error type", ["error"])
        self.reconnects = self._counter("wsync_reconnects", "links to the publisher redialled after a loss")
        self.served_version = self._gauge("wsync_served_version",
                                          "the trained version the engine serves (a channel's release names it)")
        self.served_since = self._gauge("wsync_served_since_seconds",
                                        "unix time the engine started serving its version")
        self.channel = self.pc.Gauge("wsync_served_channel", "1 for the channel the engine's version came from",
                                     ["channel"], registry=self.registry)
        self._channel: str | None = None

    def served(self, version: int, note: dict | None, at: float) -> None:
        """What the engine serves now: the note's trained version and channel where a channel sent it."""
        note = note or {}
        trained = note.get("version", version)
        self.served_version.set(trained if isinstance(trained, int) else version)
        self.served_since.set(at)
        channel = note.get("channel")
        channel = channel if isinstance(channel, str) else ""
        if channel != self._channel:
            if self._channel is not None:
                self.channel.remove(self._channel)
            self.channel.labels(channel[:128]).set(1)
            self._channel = channel

    def committed(self, version: int, codec: str, nbytes: int, apply_s: float, latency_s: float | None) -> None:
        self.versions.inc()
        self.version.set(version)
        self.bytes.labels(codec).inc(nbytes)
        self.apply.observe(apply_s)
        if latency_s is not None:
            self.latency.observe(max(latency_s, 0.0))

    def behind(self, newest: int | None, served: int | None) -> None:
        if newest is not None:
            self.lag.set(newest - (served if served is not None else -1))
