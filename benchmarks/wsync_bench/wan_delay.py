"""A packet-level delay line with random loss, for the WAN harness (the kernel here has no netem).

Runs inside the middle namespace of a ``WanLink``, attached to a TUN device
that policy routing sends every forwarded IP packet through (both directions).
Each packet read from the TUN is dropped with probability ``loss`` or held for
``delay`` seconds and then written back into the TUN, from where the kernel
forwards it on towards its destination. All packets get the same delay, so
order is kept (a FIFO suffices); the queue is bounded, and packets beyond it
are dropped as a full router would. On SIGTERM it prints what it did as JSON.

    python wan_delay.py --tun wd0 --delay-ms 20 --loss 0.005 --seed 1

Standalone on purpose (imports nothing from wsync): it runs under ``ip netns exec``.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import select
import signal
import struct
import sys
import time
from collections import deque

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
MAX_PACKET = 65536


def open_tun(name: str) -> int:
    """Attach to TUN device name (created beforehand with `ip tuntap add`), non-blocking."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


class DelayLine:
    def __init__(self, fd: int, delay: float, loss: float, seed: int, max_queue: int):
        self.fd, self.delay, self.loss, self.max_queue = fd, delay, loss, max_queue
        self.rng = random.Random(seed)
        self.queue: deque[tuple[float, bytes]] = deque()  # (due time, packet), due times ascending
        self.stats = {"forwarded": 0, "lost": 0, "overflow": 0, "bytes": 0}

    def run(self) -> None:
        ep = select.epoll()
        ep.register(self.fd, select.EPOLLIN)
        while True:
            wait = max(0.0, self.queue[0][0] - time.monotonic()) if self.queue else 1.0
            if ep.poll(wait):
                self._take(time.monotonic())
            self._release(time.monotonic())

    def _take(self, now: float) -> None:
        for _ in range(512):  # a batch per wakeup; the rest waits for the next poll
            try:
                pkt = os.read(self.fd, MAX_PACKET)
            except BlockingIOError:
                return
            if self.loss and self.rng.random() < self.loss:
                self.stats["lost"] += 1
            elif len(self.queue) >= self.max_queue:
                self.stats["overflow"] += 1
            else:
                self.queue.append((now + self.delay, pkt))

    def _release(self, now: float) -> None:
        q = self.queue
        while q and q[0][0] <= now:
            pkt = q.popleft()[1]
            try:
                os.write(self.fd, pkt)
            except OSError:
                self.stats["overflow"] += 1
                continue
            self.stats["forwarded"] += 1
            self.stats["bytes"] += len(pkt)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tun", required=True)
    ap.add_argument("--delay-ms", type=float, default=20.0, help="one-way delay (RTT = twice this)")
    ap.add_argument("--loss", type=float, default=0.0, help="probability of dropping each packet")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-queue", type=int, default=100_000, help="packets held at most")
    a = ap.parse_args()
    line = DelayLine(open_tun(a.tun), a.delay_ms / 1000, a.loss, a.seed, a.max_queue)

    def stop(*_):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    print("ready", flush=True)
    try:
        line.run()
    finally:
        print(json.dumps(line.stats), flush=True)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
