"""A real (emulated) WAN between two network namespaces, for tests and benchmarks.

    with WanLink(rate_mbit=200, rtt_ms=40, loss=0.005) as wan:
        wan.python("b", "-m", "wsync_bench.wan_roles", "recv", ...)   # a process in namespace b
        wan.ip_a, wan.ip_b, wan.ns_a, wan.ns_b

Topology (every name unique per WanLink, so parallel uses never collide)::

    ns_a: eth0 10.77.1.1 --veth-- va [tbf] (ns_m, forwarding) vb [tbf] --veth-- eth0 10.77.2.1 :ns_b
                                       \\__ wd0 (TUN) <-> wan_delay.py __/

Packets are real IP packets of the kernel's TCP. What is emulated, and how:

* **rate**: ``tbf`` on both egress ports of the middle namespace (a router's
  bottleneck queue), holding about one bandwidth-delay product, tail drop;
* **delay and loss**: this kernel has no ``netem``, so policy routing in the
  middle namespace sends every forwarded packet (both directions) through a
  TUN device where ``wan_delay.py`` holds it for rtt/2 and drops it with
  probability ``loss`` (independent, seeded), then hands it back to the kernel.
  All packets get the same delay (no jitter, no reordering). The delay line is
  a Python process, so at high packet rates it adds CPU load of its own;
* **cuts**: ``cut()`` kills the TCP connections of both ends (``ss -K``) and
  ``path(False)`` takes the link down, so packets vanish until ``path(True)``.

Needs root, ``ip``, ``tc``, ``ss`` and /dev/net/tun; otherwise entering raises
``BackendUnavailable`` with the reason (tests turn it into a skip).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass

from wsync.errors import BackendUnavailable

PREFIX = "wsyncwan"


@dataclass(kw_only=True)
class WanConfig:
    rate_mbit: float | None = 200.0  # bottleneck rate each way (None: no limit)
    rtt_ms: float = 40.0  # added round-trip time, split evenly over the two directions
    loss: float = 0.0  # probability that any one packet (either direction) is dropped
    queue_ms: float | None = None  # bottleneck queue in ms of the rate (None: one RTT, at least 5 ms)
    seed: int = 0  # loss pattern


class WanLink:
    def __init__(self, **cfg):
        self.cfg = WanConfig(**cfg)
        tag = f"{PREFIX}{os.getpid()}x{secrets.token_hex(2)}"
        self.ns_a, self.ns_m, self.ns_b = f"{tag}a", f"{tag}m", f"{tag}b"
        self.ip_a, self.ip_b = "10.77.1.1", "10.77.2.1"
        self._procs: list[subprocess.Popen] = []
        self._delay: subprocess.Popen | None = None
        self.delay_stats: dict = {}  # what the delay line did, filled at exit

    # -- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> "WanLink":
        why = unavailable()
        if why:
            raise BackendUnavailable(f"cannot build a WAN link here: {why}")
        _reap_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        if self._delay is not None and self._delay.poll() is None:
            self._delay.terminate()
            try:
                out, _ = self._delay.communicate(timeout=5)
                self.delay_stats = json.loads(out.strip().splitlines()[-1])
            except (subprocess.TimeoutExpired, ValueError, IndexError):
                self._delay.kill()
                self._delay.wait()
        for ns in (self.ns_a, self.ns_m, self.ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def _build(self) -> None:
        a, m, b, c = self.ns_a, self.ns_m, self.ns_b, self.cfg
        for ns in (a, m, b):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        for port, ns, net in (("va", a, 1), ("vb", b, 2)):
            _ip("-n", m, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", ns, "addr", "add", f"10.77.{net}.1/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "route", "add", "default", "via", f"10.77.{net}.254")
            _ip("-n", m, "addr", "add", f"10.77.{net}.254/24", "dev", port)
            _ip("-n", m, "link", "set", port, "up")
        _ip("-n", m, "tuntap", "add", "dev", "wd0", "mode", "tun")
        self._start_delay_line()
        _ip("-n", m, "link", "set", "wd0", "up")
        self.exec("m", "sysctl", "-qw", "net.ipv4.ip_forward=1", *(
            f"net.ipv4.conf.{d}.rp_filter=0" for d in ("all", "default", "va", "vb", "wd0")))
        # everything arriving from either side detours through the delay line; what it writes back
        # arrives on wd0 and takes the main table to its destination
        _ip("-n", m, "route", "add", "default", "dev", "wd0", "table", "100")
        _ip("-n", m, "rule", "add", "iif", "va", "lookup", "100", "pref", "100")
        _ip("-n", m, "rule", "add", "iif", "vb", "lookup", "100", "pref", "101")
        if c.rate_mbit:
            rate = c.rate_mbit * 1e6 / 8  # bytes/s
            queue_s = (c.queue_ms if c.queue_ms is not None else max(c.rtt_ms, 5.0)) / 1000
            burst = max(32 << 10, int(rate / 250))
            limit = max(64 << 10, int(rate * queue_s))
            for port in ("va", "vb"):
                self.exec("m", "tc", "qdisc", "add", "dev", port, "root", "tbf", "rate", f"{c.rate_mbit}mbit",
                          "burst", str(burst), "limit", str(limit))

    def _start_delay_line(self) -> None:
        from . import wan_delay

        c = self.cfg
        self._delay = subprocess.Popen(
            ["ip", "netns", "exec", self.ns_m, sys.executable, wan_delay.__file__, "--tun", "wd0",
             "--delay-ms", str(c.rtt_ms / 2), "--loss", str(c.loss), "--seed", str(c.seed)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self._delay.stdout.readline()
        if line.strip() != "ready":
            raise BackendUnavailable(f"the WAN delay line did not start: {line} {self._delay.stderr.read()}")

    # -- running things inside ------------------------------------------------------------------

    def delay_cpu(self) -> float:
        """CPU seconds (user + system) the delay line has used so far; 0.0 once it has ended."""
        try:
            with open(f"/proc/{self._delay.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, AttributeError):
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def ns(self, side: str) -> str:
        return {"a": self.ns_a, "b": self.ns_b, "m": self.ns_m}[side]

    def exec(self, side: str, *argv: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        """Run argv inside namespace side ("a", "b" or "m") and wait for it."""
        r = subprocess.run(["ip", "netns", "exec", self.ns(side), *argv], capture_output=True, text=True,
                           timeout=timeout)
        if check and r.returncode:
            raise RuntimeError(f"{' '.join(argv)} in {side} failed ({r.returncode}): {r.stderr.strip()}")
        return r

    def python(self, side: str, *args: str, **popen) -> subprocess.Popen:
        """Start `python args...` inside namespace side (stdin/stdout pipes, text); killed at exit."""
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(os.path.abspath(p or ".") for p in sys.path))
        opts = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True,
                "env": env, **popen}
        p = subprocess.Popen(["ip", "netns", "exec", self.ns(side), sys.executable, *args], **opts)
        self._procs.append(p)
        return p

    def received(self, side: str) -> int:
        """Bytes that side's end of the link (its eth0) has received so far: how far a transfer has come."""
        return int(self.exec(side, "cat", "/sys/class/net/eth0/statistics/rx_bytes").stdout)

    def cut(self) -> int:
        """Kill every TCP connection between the two ends, on both ends; returns how many sockets died."""
        killed = 0
        for side, peer in (("a", self.ip_b), ("b", self.ip_a)):
            r = self.exec(side, "ss", "-K", "-t", "-n", "dst", peer, check=False)
            killed += sum(1 for ln in r.stdout.splitlines()[1:] if ln.strip())
        return killed

    def path(self, up: bool) -> None:
        """Take the middle's port towards a down (packets vanish) or bring it back."""
        _ip("-n", self.ns_m, "link", "set", "va", "up" if up else "down")


def unavailable() -> str | None:
    """Why namespaces cannot be built here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc)"
    for tool in ("ip", "tc", "ss", "sysctl"):
        if shutil.which(tool) is None:
            return f"the {tool!r} tool is not installed"
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing (no TUN support for the delay line)"
    probe = f"{PREFIX}probe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*argv: str) -> None:
    r = subprocess.run(["ip", *argv], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"ip {' '.join(argv)} failed: {r.stderr.strip()}")


def _reap_stale() -> None:
    """Delete namespaces left by WanLinks of processes that died without cleaning up."""
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(PREFIX) or "x" not in name[len(PREFIX):]:
            continue
        pid = name[len(PREFIX):].split("x")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
