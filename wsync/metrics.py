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
"""
from __future__ import annotations

from .errors import BackendUnavailable

# seconds: from a few ms (a delta on loopback) to minutes (a keyframe over a WAN)
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _client():
    try:
        import prometheus_client
    except ImportError as e:
        raise BackendUnavailable("metrics_port needs prometheus_client (pip install 'wsync[metrics]')") from e
    return prometheus_client


class _Endpoint:
    """A private registry and the HTTP server that exposes it."""

    def __init__(self, port: int, host: str):
        pc = _client()
        self.pc = pc
        self.registry = pc.CollectorRegistry()
        self._server, self._thread = pc.start_http_server(port, addr=host, registry=self.registry)
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


class PublisherMetrics(_Endpoint):
    def __init__(self, port: int, host: str = "127.0.0.1"):
        super().__init__(port, host)
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
    def __init__(self, port: int, host: str = "127.0.0.1"):
        super().__init__(port, host)
        self.versions = self._counter("wsync_versions_committed", "versions the engine committed")
        self.version = self._gauge("wsync_engine_version", "the version the engine serves")
        self.bytes = self._counter("wsync_received_bytes", "bytes of committed versions, by codec", ["codec"])
        self.apply = self._histogram("wsync_apply_seconds", "applying one version to the engine (the transaction)")
        self.latency = self._histogram("wsync_publish_to_live_seconds",
                                       "publish() on the trainer to the version live in the engine")
        self.lag = self._gauge("wsync_lag_versions", "newest version announced minus the version served")
        self.failures = self._counter("wsync_failures", "applies refused, by error type", ["error"])
        self.reconnects = self._counter("wsync_reconnects", "links to the publisher redialled after a loss")

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
