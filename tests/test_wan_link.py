"""The emulated WAN (namespaces + veth + tbf + a TUN delay line) and tcp:// across it.

The first test checks the harness, not our code: through the link, the RTT is
clearly above that of the same topology without delay, a plain TCP stream
cannot beat the rate limit, and the delay line drops packets at about the
configured rate. Bounds are loose on purpose: they show the emulation works.
"""
from __future__ import annotations

import time

import pytest

from wsync_bench import wan as wanmod
from wsync_bench.wan_bench import measure_rate, measure_rtt, transfer

WHY = wanmod.unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no WAN emulation here: {WHY}")


def test_the_link_adds_delay_limits_rate_and_drops():
    with wanmod.WanLink(rate_mbit=None, rtt_ms=0) as fast:
        base_rtt = measure_rtt(fast)
    with wanmod.WanLink(rate_mbit=40, rtt_ms=40, loss=0.01, seed=3) as wan:
        rtt = measure_rtt(wan)
        rate = measure_rate(wan, 3 << 20)
        cpu = wan.delay_cpu()
        several = measure_rate(wan, 3 << 20, streams=3, congestion="cubic")  # the WAN bench's plain baseline
    assert base_rtt < 0.01 and 0.035 < rtt < 0.2, (base_rtt, rtt)
    assert rtt > base_rtt + 0.03
    assert 2e6 < rate < 40e6 * 1.15, rate  # limited to the link rate (loss and slow start keep it lower)
    assert 1e6 < several < 40e6 * 1.15, several  # three streams together cannot beat it either
    assert cpu > 0  # the delay line's CPU is readable while it runs
    s = wan.delay_stats
    seen = s["lost"] + s["forwarded"]
    assert seen > 1000 and 0.002 < s["lost"] / seen < 0.04, s  # ~1% of packets, either direction


@pytest.mark.slow
def test_tcp_moves_a_message_exactly_across_the_wan():
    with wanmod.WanLink(rate_mbit=100, rtt_ms=40, loss=0.005, seed=1) as wan:
        r = transfer(wan, 12 << 20, seed=11, opts={"streams": 4, "frame_bytes": 1 << 20}, timeout=120)
    assert r["exact"] is True and r["fetch_reconnects"] == 0


@pytest.mark.slow
def test_a_cut_mid_transfer_resumes_bit_exact():
    size = 24 << 20

    def cut(wan):
        start, deadline = wan.received("b"), time.monotonic() + 60
        while wan.received("b") - start < size // 4:  # a quarter through: the cut lands mid-transfer
            assert time.monotonic() < deadline, "the transfer never got a quarter of the way"
            time.sleep(0.05)
        wan.path(False)  # the path goes away...
        cut.killed = wan.cut()  # ...and every connection on both ends dies
        time.sleep(0.7)  # an outage the links must ride out, not a wait for something
        wan.path(True)

    with wanmod.WanLink(rate_mbit=50, rtt_ms=20, loss=0.0) as wan:
        r = transfer(wan, size, seed=5, opts={"streams": 3, "frame_bytes": 1 << 20, "resume_window": 30},
                     during=cut, timeout=120)
    assert cut.killed >= 6  # 2 x 3 connections on each end at least
    assert r["exact"] is True and r["reconnects"] >= 1 and r["fetch_reconnects"] >= 1, r
