"""Prometheus metrics of the sync, scraped over HTTP on loopback after real publishes and commits."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

import numpy as np
import pytest

from wsync.shadow import Shadow
from wsync.errors import EngineError
from wsync.subscriber import Subscriber
from wsync.sync import Publisher

from helpers import TOKEN, settle

parser = pytest.importorskip("prometheus_client.parser")

ADDR = "tcp://127.0.0.1:0"


def scrape(url: str) -> dict:
    """{(sample name, frozenset of labels): value} from a /metrics endpoint."""
    assert url.startswith("http://127.0.0.1:")
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in parser.text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def _states(rng, n):
    out = [{"w": rng.integers(0, 1 << 16, 20_000, dtype=np.uint16), "b": rng.standard_normal(64).astype(np.float32)}]
    for _ in range(n - 1):
        w = out[-1]["w"].copy()
        w[rng.choice(w.size, 200, replace=False)] += 1
        out.append({"w": w, "b": out[-1]["b"] + np.float32(1)})
    return out


def test_publish_and_commit_are_counted(rng):
    states = _states(rng, 4)
    with Publisher(ADDR, token=TOKEN, keyframe_every=10, metrics_port=0) as pub, \
            Subscriber(pub.address, engine=Shadow(), token=TOKEN, metrics_port=0) as sub:
        assert pub.metrics.address[0] == "127.0.0.1" and sub.metrics.address[0] == "127.0.0.1"
        for v, st in enumerate(states):
            pub.publish(st, version=v)
            sub.wait_for(v, timeout=30)
        pub.flush(timeout=30)
        p, s = scrape(pub.metrics.url), scrape(sub.metrics.url)
    assert value(p, "wsync_versions_published_total") == 4
    assert value(p, "wsync_newest_version") == 3
    assert value(p, "wsync_encoded_bytes_total", codec="raw") > 0
    assert value(p, "wsync_encoded_bytes_total", codec="delta") > 0
    assert value(p, "wsync_encode_seconds_count") == 4
    assert value(s, "wsync_versions_committed_total") == 4
    assert value(s, "wsync_engine_version") == 3
    assert value(s, "wsync_lag_versions") == 0
    assert value(s, "wsync_apply_seconds_count") == 4
    assert value(s, "wsync_publish_to_live_seconds_count") == 4
    # every committed version was observed, in a bucket, with a real duration (value() is 0.0 for a missing sample)
    assert value(s, "wsync_publish_to_live_seconds_bucket", le="+Inf") == 4
    assert value(s, "wsync_publish_to_live_seconds_sum") > 0
    assert value(s, "wsync_received_bytes_total", codec="raw") > 0
    assert value(s, "wsync_received_bytes_total", codec="delta") > 0
    assert value(s, "wsync_reconnects_total") == 0


class Flaky(Shadow):
    """Refuses its first keyframe, as an engine that runs out of memory mid-load would."""

    def __init__(self):
        super().__init__()
        self.refused = 0

    def replace(self, state):
        if not self.refused:
            self.refused += 1
            raise EngineError("out of memory while loading")
        super().replace(state)


def test_failures_by_type_and_reconnects(rng):
    st = _states(rng, 1)[0]
    with Publisher(ADDR, token=TOKEN, metrics_port=0) as pub, \
            Subscriber(pub.address, engine=Flaky(), token=TOKEN, metrics_port=0, retry_s=0.05) as sub:
        pub.publish(st, version=0)
        sub.wait_for(0, timeout=30)  # the refused keyframe was asked for again
        pub.wait_for_subscribers(1, timeout=30)
        with pub._cv:
            peers = list(pub._peers)
        for peer in peers:  # the publisher drops the link: the subscriber redials
            peer.link.close()
        deadline = time.monotonic() + 30
        while value(scrape(sub.metrics.url), "wsync_reconnects_total") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        s = scrape(sub.metrics.url)
    assert value(s, "wsync_failures_total", error="EngineError") == 1
    assert value(s, "wsync_versions_committed_total") == 1
    assert value(s, "wsync_reconnects_total") >= 1
    assert sub.stats.reconnects >= 1 and sub.stats.failures == 1


def test_instances_in_one_process_keep_their_own_numbers(rng):
    st = _states(rng, 1)[0]
    with Publisher(ADDR, token=TOKEN, metrics_port=0) as a, Publisher(ADDR, token=TOKEN, metrics_port=0) as b:
        a.publish(st, version=0)
        a.publish(st, version=1)
        b.publish(st, version=5)
        a.flush(timeout=30)
        b.flush(timeout=30)
        assert a.metrics.address != b.metrics.address
        assert value(scrape(a.metrics.url), "wsync_versions_published_total") == 2
        assert value(scrape(b.metrics.url), "wsync_versions_published_total") == 1


def test_serve_metrics_port(tmp_path, rng):
    from wsync.checkpoint import Checkpoint, write_checkpoint
    from wsync.serve import serve
    from wsync.snapshot import as_state

    for i, st in enumerate(_states(rng, 2)):
        write_checkpoint(tmp_path / f"step_{i}", Checkpoint(as_state(st), None, {}))
    settle(tmp_path)
    lines, stop = [], threading.Event()
    t = threading.Thread(target=serve, args=(tmp_path, ADDR), daemon=True,
                         kwargs=dict(token=TOKEN, stop=stop.is_set, poll_s=0.1, settle_s=0.5, log=lines.append,
                                     metrics_port=0))
    t.start()
    try:
        deadline = time.monotonic() + 30
        while not any("published version 1" in x for x in lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        url = next(x.split(" at ")[1] for x in lines if x.startswith("metrics at"))
        assert value(scrape(url), "wsync_versions_published_total") == 2
    finally:
        stop.set()
        t.join(30)


def test_serve_cli_metrics_port():
    from wsync.cli import parser as cli

    assert cli().parse_args(["serve", "x", "--listen", "127.0.0.1:0", "--metrics-port", "9400"]).metrics_port == 9400


def test_wsync_works_without_prometheus_client():
    code = textwrap.dedent("""
        import sys
        sys.modules["prometheus_client"] = None  # not installed
        import numpy as np
        import wsync
        from wsync.errors import BackendUnavailable
        with wsync.Publisher("tcp://127.0.0.1:0", token=b"metrics-token-other") as pub:
            pub.publish({"w": np.zeros(8, np.float32)}, version=0)
        try:
            wsync.Publisher("tcp://127.0.0.1:0", token=b"metrics-token-other", metrics_port=0)
        except BackendUnavailable as e:
            assert "wsync[metrics]" in str(e), e
        else:
            raise SystemExit("metrics_port without prometheus_client should say what to install")
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
