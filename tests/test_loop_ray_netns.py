"""The Ray loop across a real network link: Ray nodes in network namespaces joined by a veth pair.

tests/test_loop_ray.py runs every "node" on this machine's loopback, so the weights never cross a network
interface. Here each Ray node runs in a network namespace of its own: the head (the trainer's ranks, and
the driver) and two sampler nodes, each on a veth into a bridge in a fourth "switch" namespace, with private
addresses 10.231.N.1-3 that this test creates (no other address is ever a target). The loop runs on them as
`trainer.run(..., ray=RayConfig(address="HEAD:PORT"))` from the head's namespace, and the weights travel
over wsync tcp from the trainer's namespace to the samplers', across the veths and the bridge. Two runs:
a clean one (the publisher on the trainer node's address, bit-identical weights at every version), and one
where a sampler node's link goes down mid-run (packets vanish: no RST) and the trainer steps on.

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

from ray_helpers import require_ray

require_ray()

PREFIX = f"wsx{os.getpid() % 100000}"
SUBNET = f"10.231.{os.getpid() % 200 + 20}"  # lives only inside this test's namespaces
NODES = {"h": f"{SUBNET}.1", "s1": f"{SUBNET}.2", "s2": f"{SUBNET}.3"}
HEAD_IP, RAY_PORT = NODES["h"], 46379
ETA = 2


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
    """A namespace per node (head h, samplers s1 s2), each on a veth whose other end is in a bridge in a
    switch namespace (w): a small LAN that touches nothing outside it. Removed by close()."""

    def __init__(self, nodes: dict[str, str]):
        self.switch = f"{PREFIX}w"
        self.ns = {name: f"{PREFIX}{name}" for name in nodes}
        self.dev = {name: f"{PREFIX}{name}n" for name in nodes}  # the node's end of its veth
        self.made: list[str] = []
        for ns in (self.switch, *self.ns.values()):
            _ip("netns", "add", ns)
            self.made.append(ns)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for name, addr in nodes.items():
            ns, dev, port = self.ns[name], self.dev[name], f"{PREFIX}{name}w"
            _ip("link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")  # gloo and Ray's local sockets use loopback

    def exec(self, ns: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", ns, *argv]

    def close(self) -> None:
        for ns in self.made:  # deleting a namespace deletes the veth ends in it, and so the pairs
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
        net = Netns(NODES)
        nodes.append(RayNode(net, net.ns["h"], ["--head", "--node-ip-address", HEAD_IP, "--port", str(RAY_PORT),
                                                "--num-cpus", "1", "--resources", '{"wsync_trainer": 2}',
                                                "--include-dashboard", "false", "--temp-dir", str(tmp / "h")],
                             env, tmp / "h.log"))
        try:
            _wait_listening(net, net.ns["s1"], HEAD_IP, RAY_PORT, env, 60)  # the GCS, seen across the bridge
        except TimeoutError as e:
            raise TimeoutError(f"{e}; the head's log ends:\n{(tmp / 'h.log').read_text()[-3000:]}") from None
        for name in ("s1", "s2"):
            nodes.append(RayNode(net, net.ns[name], ["--address", f"{HEAD_IP}:{RAY_PORT}", "--node-ip-address",
                                                     NODES[name], "--num-cpus", "1", "--resources",
                                                     '{"wsync_sampler": 1}', "--temp-dir", str(tmp / name)],
                                 env, tmp / f"{name}.log"))
        yield net, env, tmp, nodes
    finally:
        for n in reversed(nodes):
            n.stop()
        if net is not None:
            net.close()


DRIVER = r"""
import json, subprocess, sys, time
import ray
from trainer.decode import DecodeConfig
from trainer.loop import LoopConfig
from trainer.ray_loop import RayConfig, run_on_ray
from trainer.task import TaskConfig

address, out, fault, ns, dev = sys.argv[1:6]
ray.init(address=address, include_dashboard=False)
for _ in range(120):  # the sampler nodes join while the head starts
    if len([n for n in ray.nodes() if n["Alive"]]) >= 3:
        break
    time.sleep(0.5)
else:
    raise SystemExit("the sampler nodes did not join the cluster within a minute")
at = {}


cfg = LoopConfig(mode="async", max_staleness=2, steps=12 if fault == "none" else 200, seed=0, samplers=2,
                 group_size=4, batch_groups=2, progress=False, report_digests=True, keep_samples=True,
                 stall_timeout=120.0, task=TaskConfig(min_digits=2, max_digits=2), decode=DecodeConfig(slots=8))
placed = []


def cut(d):  # on_step: take the s2 node off the network (its link down: no goodbye, no RST)
    if not placed:
        placed.extend({"worker": w, **ray.get(h.node.remote())} for w, h in enumerate(d.samplers))
    if fault == "cut" and "down" not in at and d.version == 3:
        subprocess.run(["ip", "-n", ns, "link", "set", dev, "down"], check=True)
        at["down"] = d.version


r = run_on_ray(cfg, RayConfig(address=address, placement="resources", lost_after=5.0), on_step=cut)
nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
json.dump({"summary": r.summary, "digests": {str(k): v for k, v in r.digests.items()}, "synced": r.synced,
           "staleness": [s["staleness"] for s in r.samples], "nodes": nodes, "at": at,
           "placed": placed}, open(out, "w"), default=str)
ray.shutdown()
"""


def _drive(cluster, fault: str) -> dict:
    net, env, tmp, _ = cluster
    out = tmp / f"run-{fault}.json"
    argv = [sys.executable, "-c", DRIVER, f"{HEAD_IP}:{RAY_PORT}", str(out), fault, net.ns["s2"], net.dev["s2"]]
    p = subprocess.run(net.exec(net.ns["h"], argv), env=env, capture_output=True, text=True, timeout=300)
    logs = "".join(f"\n--- {n}.log\n" + (tmp / f"{n}.log").read_text()[-1500:] for n in NODES)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:] + logs
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def ran(cluster):
    return _drive(cluster, "none")


@pytest.fixture(scope="module")
def cut(cluster, ran):  # after the clean run: this one takes a node off the network for good
    return _drive(cluster, "cut")


def test_weights_cross_the_network_to_other_nodes(ran):
    s, nodes = ran["summary"], ran["nodes"]
    assert s["steps"] == 12 and s["ray"]["placement"] == "resources"
    pub = s["ray"]["publisher"]
    assert pub["address"].startswith(f"tcp://{HEAD_IP}:"), pub  # the trainer node's namespace address, not loopback
    assert nodes[pub["node"]] == HEAD_IP
    # each sampler on a node of its own, in another namespace: it dialled the publisher across the bridge
    assert sorted(nodes[r["node_id"]] for r in s["ray"]["serving"]) == [NODES["s1"], NODES["s2"]]


def test_sampler_weights_are_the_trainers_versions(ran):
    digests = ran["digests"]
    assert {r["worker"] for r in ran["synced"]} == {0, 1}
    for rep in ran["synced"]:
        assert rep["digest"] == digests[str(rep["version"])], rep
    assert len({r["version"] for r in ran["synced"]}) > 3  # followed the trainer, not just version 0
    for srv in ran["summary"]["ray"]["serving"]:
        assert srv["digest"] == digests[str(srv["version"])], srv
    versions = {v["version"]: v for v in ran["summary"]["ray"]["versions"]}
    assert set(versions) == set(range(13))
    assert all(a["bytes"] > 0 for v in versions.values() for a in v["applied"])


def test_a_node_cut_off_the_network_does_not_stall_the_trainer(cut):
    """The s2 node's link goes down at version 3 (its packets vanish: no RST, no FIN). The driver writes its
    sampler off after lost_after, the trainer steps on with the other within the staleness bound (a step here
    is ~50 ms: 200 steps outlast lost_after), and the other sampler still follows bit for bit."""
    s, at, nodes = cut["summary"], cut["at"], cut["nodes"]
    assert at.get("down") == 3 and s["steps"] == 200
    placed = {a["worker"]: nodes[a["node_id"]] for a in cut["placed"]}
    gone, left = (w for ip in (NODES["s2"], NODES["s1"]) for w, a in placed.items() if a == ip)
    lost = [x for x in s["ray"]["lost"] if x["worker"] == gone]
    assert lost and 3 <= lost[0]["version"] < 200, s["ray"]["lost"]  # written off, and the trainer went on
    assert all(x["worker"] == gone for x in s["ray"]["lost"])
    assert cut["staleness"] and all(0 <= st <= ETA for st in cut["staleness"])
    assert len(cut["staleness"]) == 200 * 2 * 4
    late = [r for r in cut["synced"] if r["worker"] == left and r["version"] > lost[0]["version"]]
    assert late, "the sampler left stopped following after the cut"
    for rep in cut["synced"]:
        assert rep["digest"] == cut["digests"][str(rep["version"])], rep
