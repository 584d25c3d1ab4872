"""The Ray loop across a real network link: Ray nodes in network namespaces joined by a veth pair.

tests/test_loop_ray.py runs every "node" on this machine's loopback, so the weights never cross a network
interface. Here the head node (the trainer's ranks, and the driver) runs in one network namespace and a
sampler node in another, each with its own private address (10.231.N.1 and .2 on a veth pair this test
creates; no other address is ever a target); `wsync loop --ray --address HEAD:PORT` runs on them, and the
weights travel over wsync tcp from the trainer's namespace to the sampler's, across the veth.

Needs root (CAP_NET_ADMIN: ip netns, ip link): skipped without it. Skipped without ray; WSYNC_REQUIRE_RAY=1
makes a missing ray a failure (not a missing capability). Every namespace, link and Ray process the test
started is removed at the end, whatever happened.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
try:
    import ray  # noqa: F401
except ImportError:
    if os.environ.get("WSYNC_REQUIRE_RAY") == "1":
        pytest.fail("WSYNC_REQUIRE_RAY=1 but ray is not installed (pip install ray==2.60.0)", pytrace=False)
    pytest.skip("ray is not installed (pip install ray==2.60.0)", allow_module_level=True)

PREFIX = f"wsx{os.getpid() % 100000}"
SUBNET = f"10.231.{os.getpid() % 200 + 20}"  # lives only inside this test's namespaces
HEAD_IP, SAMPLER_IP, RAY_PORT = f"{SUBNET}.1", f"{SUBNET}.2", 46379


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _can_netns() -> str | None:
    """None when this process can make namespaces and links, else why not."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "needs root (CAP_NET_ADMIN) to create network namespaces"
    probe = f"{PREFIX}p"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Netns:
    """Two namespaces, head (h) and sampler (s), joined by a veth pair; removed by close()."""

    def __init__(self):
        self.head, self.sampler = f"{PREFIX}h", f"{PREFIX}s"
        self.made: list[str] = []
        for ns in (self.head, self.sampler):
            _ip("netns", "add", ns)
            self.made.append(ns)
        self.head_if, self.sampler_if = f"{PREFIX}a", f"{PREFIX}b"
        _ip("link", "add", self.head_if, "netns", self.head, "type", "veth", "peer", "name", self.sampler_if,
            "netns", self.sampler)
        for ns, dev, addr in ((self.head, self.head_if, HEAD_IP), (self.sampler, self.sampler_if, SAMPLER_IP)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")  # gloo and Ray's local sockets use loopback

    def exec(self, ns: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", ns, *argv]

    def close(self) -> None:
        for ns in self.made:  # deleting a namespace deletes the veth end in it, and so the pair
            _ip("netns", "del", ns, check=False)


class RayNode:
    """`ray start --block` in a namespace, in a process group of its own (killed whole by stop())."""

    def __init__(self, net: Netns, ns: str, args: list[str], env: dict, log: Path):
        ray_bin = str(Path(sys.executable).parent / "ray")
        self.log = log
        self.proc = subprocess.Popen(net.exec(ns, [ray_bin, "start", "--block", "--disable-usage-stats", *args]),
                                     env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # gcs, raylet, agents and workers share its group
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)


def _wait_listening(net: Netns, ns: str, host: str, port: int, env: dict, timeout: float) -> None:
    code = f"import socket; socket.create_connection(({host!r}, {port}), timeout=2).close()"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if subprocess.run(net.exec(ns, [sys.executable, "-c", code]), env=env, capture_output=True).returncode == 0:
            return
        time.sleep(0.5)
    raise TimeoutError(f"nothing listens on {host}:{port} in {ns} after {timeout} s")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = _can_netns()
    if why:
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp(PREFIX)
    # Ray's token auth, with a token of this cluster's own (not the one in ~/.ray that others' clusters use)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    net, nodes = None, []
    try:
        net = Netns()
        nodes.append(RayNode(net, net.head, ["--head", "--node-ip-address", HEAD_IP, "--port", str(RAY_PORT),
                                             "--num-cpus", "1", "--resources", '{"wsync_trainer": 2}',
                                             "--include-dashboard", "false", "--temp-dir", str(tmp / "head")],
                             env, tmp / "head.log"))
        _wait_listening(net, net.sampler, HEAD_IP, RAY_PORT, env, 60)  # the GCS, seen across the veth
        nodes.append(RayNode(net, net.sampler, ["--address", f"{HEAD_IP}:{RAY_PORT}", "--node-ip-address",
                                                SAMPLER_IP, "--num-cpus", "1", "--resources", '{"wsync_sampler": 1}',
                                                "--temp-dir", str(tmp / "sampler")],
                             env, tmp / "sampler.log"))
        yield net, env, tmp, nodes
    finally:
        for n in reversed(nodes):
            n.stop()
        if net is not None:
            net.close()


DRIVER = r"""
import json, sys, time
import ray
from trainer.decode import DecodeConfig
from trainer.loop import LoopConfig, run
from trainer.ray_loop import RayConfig
from trainer.task import TaskConfig

address, out = sys.argv[1], sys.argv[2]
ray.init(address=address, include_dashboard=False)
for _ in range(120):  # the sampler node joins while the head starts
    if len([n for n in ray.nodes() if n["Alive"]]) >= 2:
        break
    time.sleep(0.5)
cfg = LoopConfig(mode="async", max_staleness=2, steps=12, seed=0, samplers=1, group_size=4, batch_groups=2,
                 progress=False, report_digests=True, stall_timeout=120.0,
                 task=TaskConfig(min_digits=2, max_digits=2), decode=DecodeConfig(slots=8))
r = run(cfg, ray=RayConfig(address=address, placement="resources"))
nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
json.dump({"summary": r.summary, "digests": {str(k): v for k, v in r.digests.items()}, "synced": r.synced,
           "nodes": nodes}, open(out, "w"), default=str)
ray.shutdown()
"""


@pytest.fixture(scope="module")
def ran(cluster):
    net, env, tmp, _ = cluster
    out = tmp / "run.json"
    p = subprocess.run(net.exec(net.head, [sys.executable, "-c", DRIVER, f"{HEAD_IP}:{RAY_PORT}", str(out)]),
                       env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    return json.loads(out.read_text())


def test_weights_cross_the_veth_to_another_node(ran):
    s, nodes = ran["summary"], ran["nodes"]
    assert s["steps"] == 12 and s["ray"]["placement"] == "resources"
    pub = s["ray"]["publisher"]
    assert pub["address"].startswith(f"tcp://{HEAD_IP}:"), pub  # the trainer node's namespace address, not loopback
    assert nodes[pub["node"]] == HEAD_IP
    serving = s["ray"]["serving"]
    assert [nodes[r["node_id"]] for r in serving] == [SAMPLER_IP]  # the sampler dialled it from the other namespace


def test_sampler_weights_are_the_trainers_versions(ran):
    digests = ran["digests"]
    assert ran["synced"] and {r["worker"] for r in ran["synced"]} == {0}
    for rep in ran["synced"]:
        assert rep["digest"] == digests[str(rep["version"])], rep
    assert len({r["version"] for r in ran["synced"]}) > 3  # followed the trainer, not just version 0
    for srv in ran["summary"]["ray"]["serving"]:
        assert srv["digest"] == digests[str(srv["version"])], srv
    versions = {v["version"]: v for v in ran["summary"]["ray"]["versions"]}
    assert set(versions) == set(range(13))
    assert all(a["bytes"] > 0 for v in versions.values() for a in v["applied"])
