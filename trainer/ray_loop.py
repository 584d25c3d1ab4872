"""The reference loop on Ray: a sharded trainer group and sampler actors on other nodes.

    trainer.run(LoopConfig(...), ray=True)                  # a local cluster: a trainer node, a node per sampler
    trainer.run(cfg, ray=RayConfig(address="auto"))         # the cluster this machine belongs to (ray start)
    wsync loop --ray [--address auto|HOST:PORT]

    driver (this process)                 trainer ranks (actors, one node)       sampler actors (other nodes)
    ---------------------                 --------------------------------       ----------------------------
    admission control, batches  -- step(batch) -->  FSDP2 GRPO step, all-gather
                                                    rank 0: Publisher ===== wsync tcp =====> Subscriber, between
    tickets  -- give() ---------------------------------------------------------------->  decode steps
    groups   <- take() ----------------------------------------------------------------   (trainer.sampler.Worker)

The driver is the one-process loop's (``trainer.driver.Driver``: the same
admission control, staleness bound and records); what changes is where the
parts run. Samples and tickets travel as Ray calls; weights only through wsync.

Faults. A sampler killed mid-run is restarted by Ray (``max_restarts``); its
fresh model holds no version, so it rejoins with a keyframe, and the groups the
dead one held are issued again. A sampler whose node is removed, or that is
silent for ``lost_after`` seconds, is written off the same way: its groups go
to the others, and admission control (eta versions of slack) keeps the trainer
stepping meanwhile. A trainer rank that dies ends training: every rank is
stopped, each sampler keeps serving the last version it committed, and
``TrainerFailed`` reports what each serves (version, digest, a group decoded
after the trainer was gone).
"""
from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from .driver import Driver, LoopConfig, Result, SamplerFailed, sync_summary
from .ray_place import local_cluster
from .task import sample_digits

if TYPE_CHECKING:
    from wsync.sync import PublisherStats


@dataclass(kw_only=True)
class RayConfig:
    address: str | None = None  # Ray cluster ("auto", "HOST:PORT"); None: the one this process is connected
    # to (ray.init before), else a local one started for this run (ray_place.local_cluster)
    trainer_ranks: int = 2  # FSDP2 ranks of the trainer group, all on one node
    placement: str = "auto"  # "resources": nodes with wsync_trainer / wsync_sampler; "spread": trainer on the
    # driver's node, samplers pinned round-robin to the other nodes; "auto": resources when the cluster has them
    publish_host: str | None = None  # where rank 0's publisher listens; None: 127.0.0.1 when every node is this
    # machine (a local cluster), else the trainer node's address
    publish_port: int = 0  # the publisher's tcp port (0: any free one); fix it to open one port in a firewall
    max_restarts: int = 3  # times Ray restarts a dead sampler actor
    lost_after: float = 10.0  # seconds a sampler may leave a take() unanswered before its groups go to others
    probe_timeout: float = 60.0  # after the trainer died: seconds to wait for each sampler's probe group

    def __post_init__(self):
        if self.trainer_ranks < 1:
            raise ValueError(f"trainer_ranks must be >= 1, got {self.trainer_ranks}")
        if self.placement not in ("auto", "resources", "spread"):
            raise ValueError(f"placement must be 'auto', 'resources' or 'spread', got {self.placement!r}")


class TrainerFailed(RuntimeError):
    """A trainer rank died; ``serving`` says what each sampler still serves, ``result`` holds the run so far."""

    def __init__(self, message: str, *, serving: list, result: Result):
        super().__init__(message)
        self.serving, self.result = serving, result


class _TrainerDown(Exception):
    pass


class RayDriver(Driver):
    """Driver of the Ray loop: the one-process driver's admission and records, actors instead of processes."""

    def __init__(self, cfg: LoopConfig, rcfg: RayConfig, on_step=None):
        per_update = cfg.batch_groups // cfg.grpo.minibatches
        if per_update < rcfg.trainer_ranks:  # every rank takes part in FSDP's collectives with groups of its own
            raise ValueError(f"each of the {rcfg.trainer_ranks} trainer ranks needs a group per minibatch: "
                             f"batch_groups / minibatches = {per_update}")
        self.cfg, self.rcfg, self.on_step = cfg, rcfg, on_step
        self._start_records(cfg)
        self.metrics: dict = {"trainer": None, "samplers": {}}
        self.tickets = _Line()  # issued, not yet given to a sampler
        self.inbox: deque = deque()
        n = cfg.samplers
        self.held: list[dict] = [{} for _ in range(n)]  # per sampler: group id -> ticket it holds
        self.lives: list[list[str]] = [[] for _ in range(n)]  # per sampler: its incarnations, newest last
        self.down: set[int] = set()  # written off until they speak again
        self.written_off: dict[int, str | None] = {}  # sampler -> the incarnation whose groups went to others
        self.takes: dict[int, tuple] = {}  # sampler -> (take ref, when asked)
        self.retry_at = [0.0] * n
        self.gives: list = []
        self.ranks: list = []
        self.samplers: list = []
        self.cluster = self.pg = None
        self.own_ray = False
        self.report = {"restarts": 0, "lost": [], "requeued_groups": 0, "orphaned_groups": 0, "held_max": 0,
                       "applied": [], "steps": [], "step_overhead_s": 0.0, "placement": None, "publisher": None}
        # groups a sampler may hold (running, waiting in it, or finished and on their way): eta batches. As many
        # as admission control lets it run ahead, as a sampler of the one-host loop does from the shared queue; no
        # more, so a sampler lost with all it holds leaves admission room for the others to fill the next batch:
        # the trainer keeps stepping until the loss is noticed. Tickets wait in line here beyond that.
        self.cap = max(cfg.eta, 1) * cfg.batch_groups

    # -- the run -------------------------------------------------------------------------------

    def run(self) -> Result:
        try:
            self._connect()
            self._start_trainer()  # and the samplers, once the publisher listens
            while len(self.alive) < self.cfg.samplers:
                self.consume(self._next())
            self.rec.restart_clock()
            while not self.done():
                self.issue()
                self._dispatch()
                t = time.perf_counter()
                item = self._next()
                self.rec.trainer["wait_samples_s"] += time.perf_counter() - t
                self.consume(item)
                if len(self.batch) == self.cfg.batch_groups:
                    self.issue()  # refill the samplers before the step, so they decode while it runs
                    self._dispatch()
                    self.train()
                    if self.on_step is not None:
                        self.on_step(self)
            return self._finish()
        except _TrainerDown as e:
            raise self._trainer_lost(e.__cause__ or e) from None
        finally:
            self._shutdown()

    def _connect(self) -> None:
        import logging

        try:
            import ray
        except ImportError as e:
            from wsync.errors import BackendUnavailable

            raise BackendUnavailable('the loop on Ray (--ray, ray=True) needs ray: pip install -e ".[ray]"') from e

        if self.rcfg.address is None and not ray.is_initialized():
            self.cluster = local_cluster(self.cfg.samplers, self.rcfg.trainer_ranks)
            address = self.cluster.address
        else:
            address = self.rcfg.address
        if not ray.is_initialized():
            ray.init(address=address, logging_level=logging.ERROR, include_dashboard=False)
            self.own_ray = True

    # -- placement -------------------------------------------------------------------------------

    def _start_trainer(self) -> None:
        import secrets

        import ray

        from . import ray_place
        from .ray_trainer import TrainerRank

        r = self.rcfg
        how = self.report["placement"] = ray_place.mode(r.placement, r.trainer_ranks, self.cfg.samplers)
        self.pg, opts = ray_place.trainer_options(how, r.trainer_ranks, self.cfg.stall_timeout)
        actor = ray.remote(num_cpus=0, max_restarts=0)(TrainerRank)
        self.ranks = [actor.options(**o).remote(i, r.trainer_ranks, self.cfg) for i, o in enumerate(opts)]
        node = ray.get(self.ranks[0].node.remote(), timeout=self.cfg.stall_timeout)
        self.trainer_node = node["node_id"]
        host = ray_place.publish_host(r.publish_host, node["ip"])
        self.token = secrets.token_bytes(16)  # no one else on the network can push weights
        # the publisher listens first, so the samplers start (imports, model) while the ranks shard the policy
        opened = ray.get(self.ranks[0].open.remote(f"tcp://{host}:{r.publish_port}", self.token, "127.0.0.1"),
                         timeout=self.cfg.stall_timeout)
        self.address = opened["address"]
        self.report["publisher"] = {"address": self.address, "node": self.trainer_node, "ranks": r.trainer_ranks}
        self._start_samplers(ray_place.sampler_options(how, self.cfg.samplers, self.trainer_node))
        out = self._trainer("setup", "127.0.0.1", opened["port"])
        self.report["publisher"].update(sharded=all(o["sharded"] for o in out),  # every parameter a DTensor shard
                                        gather_checked=all(o["gather_checked"] for o in out))
        if self.cfg.report_digests:
            self.result.digests[0] = out[0]["digest"]

    def _start_samplers(self, opts: list[dict]) -> None:
        import ray

        from .ray_sampler import SamplerActor
        from .sampler import SamplerConfig

        c = self.cfg
        scfg = SamplerConfig(policy=c.policy, decode=c.decode, threads=c.threads, seed=c.seed,
                             report_digests=c.report_digests, metrics_port=c.metrics_port)
        actor = ray.remote(num_cpus=0, max_restarts=self.rcfg.max_restarts, max_concurrency=4)(SamplerActor)
        backlog = (c.eta + 1) * c.batch_groups + 4
        self.samplers = [actor.options(**o).remote(i, scfg, self.address, self.token, backlog)
                         for i, o in enumerate(opts)]

    # -- tickets and results ---------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Give waiting tickets to the samplers that hold the fewest, up to what each can run."""
        out: dict[int, list] = {}
        while self.tickets:
            up = [w for w in range(self.cfg.samplers)
                  if w not in self.down and self.lives[w] and len(self.held[w]) < self.cap]
            if not up:
                break
            w = min(up, key=lambda i: len(self.held[i]))
            t = self.tickets.popleft()
            self.held[w][t["group"]] = t
            out.setdefault(w, []).append(t)
        for w, ts in out.items():
            self.gives.append(self.samplers[w].give.remote(ts))
            self.report["held_max"] = max(self.report["held_max"], len(self.held[w]))

    def _next(self) -> dict:
        """The next item from any sampler; raises when none has spoken for stall_timeout seconds."""
        deadline = time.perf_counter() + self.cfg.stall_timeout
        while not self.inbox:
            self._pump(1.0)
            if not self.inbox and time.perf_counter() > deadline:
                raise SamplerFailed(f"no sampler output for {self.cfg.stall_timeout}s; samplers up: "
                                    f"{sorted(set(range(self.cfg.samplers)) - self.down)}, lost: {self.report['lost']}")
        return self.inbox.popleft()

    def _pump(self, timeout: float) -> None:
        """Keep one take() open per sampler; collect the answered ones; write off the silent and the dead."""
        import ray
        from ray.exceptions import RayError

        now = time.monotonic()
        for w, h in enumerate(self.samplers):
            if w not in self.takes and now >= self.retry_at[w]:
                self.takes[w] = (h.take.remote(0.5), now)
        refs = {ref: w for w, (ref, _) in self.takes.items()}
        if refs:
            ready, _ = ray.wait(list(refs), num_returns=1, timeout=timeout)
            if ready:
                ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        else:
            time.sleep(min(timeout, 0.2))
            ready = []
        for ref in ready:
            w = refs[ref]
            del self.takes[w]
            try:
                self.inbox.extend(ray.get(ref))
            except RayError as e:  # dead, or restarting: ask again in a while
                self.retry_at[w] = time.monotonic() + 1.0
                self._lose(w, f"{type(e).__name__}: {str(e).splitlines()[0]}")
            else:
                self.down.discard(w)  # it answered: up (again), whatever was said about it before
        now = time.monotonic()
        for w, (_, asked) in self.takes.items():
            if w in self.alive and now - asked > self.rcfg.lost_after:  # not while it starts (imports, model)
                self._lose(w, f"silent for {now - asked:.1f}s")
        if self.gives:  # failed gives surface through take; collect them so Ray does not report them unhandled
            done, self.gives = ray.wait(self.gives, num_returns=len(self.gives), timeout=0)
            for ref in done:
                try:
                    ray.get(ref)
                except RayError:
                    pass

    def _lose(self, w: int, why: str) -> None:
        if w in self.down:
            return
        self.down.add(w)
        self.alive.discard(w)
        self.written_off[w] = self.lives[w][-1] if self.lives[w] else None
        self.report["lost"].append({"worker": w, "version": self.version, "t": round(self.rec.elapsed(), 3),
                                    "why": why})
        self._requeue(w)

    def _requeue(self, w: int) -> None:
        """The groups sampler w held go first in line for the others (admission still counts them as running)."""
        held = sorted(self.held[w].values(), key=lambda t: t["group"])
        self.held[w] = {}
        self.report["requeued_groups"] += len(held)
        self.tickets.extendleft(reversed(held))

    def consume(self, item: dict) -> None:
        w, life, kind = item["worker"], item.get("life"), item["kind"]
        lives = self.lives[w]
        if life in lives[:-1]:
            return  # from an incarnation that is gone
        if not lives or life != lives[-1]:
            if lives:  # Ray restarted it: what the old one held is lost (unless the loss was seen already:
                self.report["restarts"] += 1  # then what it holds now went to the new one)
                if self.written_off.get(w) != lives[-1]:
                    self._requeue(w)
            lives.append(life)
        key = (w, len(lives) - 1)  # clocks per incarnation: a restart starts them at zero
        if kind == "applied":
            self.report["applied"].append({k: item[k] for k in ("worker", "version", "bytes", "apply_s", "keyframe")}
                                          | {"incarnation": len(lives) - 1})
        elif kind in ("ready", "bye"):
            (self.alive.add if kind == "ready" else self.alive.discard)(w)
            if item.get("metrics"):
                self.metrics["samplers"][w] = item["metrics"]
            if "stats" in item:
                self.rec.sampler_stats(key, item["stats"])
        elif kind == "group":
            if self.held[w].pop(item["group"], None) is None:  # issued again meanwhile: one copy counts
                self.report["orphaned_groups"] += 1
                self.rec.sampler_stats(key, item["stats"])
                return
            super().consume({**item, "worker": key})
        else:
            super().consume(item)

    # -- the trainer -------------------------------------------------------------------------------

    def _trainer(self, method: str, *args, timeout: float | None = None) -> list:
        """Call `method` on every rank; any rank failing (or the call outliving the timeout) is _TrainerDown."""
        import ray
        from ray.exceptions import GetTimeoutError, RayError, RayTaskError

        refs = [getattr(r, method).remote(*args) for r in self.ranks]
        pending, deadline = list(refs), time.monotonic() + (timeout or self.cfg.stall_timeout)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0))
                if not done:
                    raise GetTimeoutError(f"trainer {method} took over {timeout or self.cfg.stall_timeout}s")
                ray.get(done)  # a dead rank raises here, before the others give up their collective
            return ray.get(refs)
        except RayTaskError:
            raise  # the step itself raised: a bug to see with its traceback, not a lost rank
        except RayError as e:
            raise _TrainerDown(method) from e

    def train(self) -> None:
        import ray

        t = time.perf_counter()
        outs = self._trainer("step", ray.put(self.batch), self.version + 1)
        wall = time.perf_counter() - t
        self.version += 1
        o = outs[0]
        sync_s = o["gather_s"] + o["publish_s"]
        self.rec.trainer["train_s"] += wall - sync_s
        self.rec.trainer["publish_s"] += sync_s
        self.report["step_overhead_s"] += wall - (o["train_s"] + sync_s)
        self.report["steps"].append({"version": self.version, "gather_s": o["gather_s"], "publish_s": o["publish_s"]})
        if self.cfg.report_digests:
            self.result.digests[self.version] = o["digest"]
        if self.cfg.keep_samples:
            self.result.samples.extend(s for g in self.batch for s in g)
        self.rec.step(self.version, self.batch, o["stats"], o["sync"], len(self.inbox))
        self.batch = []

    def _trainer_lost(self, cause: BaseException) -> TrainerFailed:
        """Stop every rank; ask each sampler what it serves and have it decode one more group to show it."""
        import ray

        for r in self.ranks:
            ray.kill(r, no_restart=True)
        self.ranks = []
        up = [w for w in range(self.cfg.samplers) if w not in self.down]
        probes = {}
        for i, w in enumerate(up):
            g = -1 - i  # ids no issued group has
            probes[g] = w
            ticket = {"group": g, "digits": sample_digits(self.cfg.task, self.rng), "size": self.cfg.group_size,
                      "min_version": 0}
            self.held[w][g] = ticket
            self.gives.append(self.samplers[w].give.remote([ticket]))
        deadline = time.monotonic() + self.rcfg.probe_timeout
        serving = {r["worker"]: r for r in self._statuses(up, self.rcfg.probe_timeout)}
        for w, r in serving.items():
            if "error" in r:
                self._lose(w, r["error"])
        probes = {g: w for g, w in probes.items() if "error" not in serving[w]}
        while probes and time.monotonic() < deadline:
            if not self.inbox:
                self._pump(0.5)
                continue
            item = self.inbox.popleft()
            if item["kind"] == "group" and item["group"] in probes:
                w = probes.pop(item["group"])
                serving[w]["probe_versions"] = sorted({v for s in item["samples"] for v in s["versions"]})
        rows = list(serving.values())
        said = "; ".join(f"sampler {r['worker']} is unreachable" if "error" in r else
                         f"sampler {r['worker']} serves version {r['version']}" for r in rows) or "no sampler is up"
        self.result.summary = {"trainer_failed": f"{type(cause).__name__}: {cause}", "serving": rows,
                               "steps": self.version, "ray": self.report}
        return TrainerFailed(f"a trainer rank died after version {self.version} ({type(cause).__name__}); {said}",
                             serving=rows, result=self.result)

    def _statuses(self, workers: list[int], timeout: float) -> list[dict]:
        """What each sampler serves (version, digest, node), asked of all at once: one that Ray is still
        restarting, or whose node is gone, costs the timeout once, and says why instead."""
        import ray
        from ray.exceptions import RayError

        asked = [(w, self.samplers[w].status.remote()) for w in workers]
        deadline = time.monotonic() + timeout
        out = []
        for w, ref in asked:
            try:
                out.append(ray.get(ref, timeout=max(deadline - time.monotonic(), 0.1)))
            except RayError as e:
                out.append({"worker": w, "error": str(e).splitlines()[0]})
        return out

    # -- the end -------------------------------------------------------------------------------------

    def _finish(self) -> Result:
        import ray
        from ray.exceptions import RayError

        from wsync.hardware import describe

        if self.cfg.progress:
            print(file=sys.stderr)
        pub = self._trainer("sync_stats", 60.0, timeout=120.0)[0]
        up = [w for w in range(self.cfg.samplers) if w not in self.down]
        serving = self._statuses(up, 60.0)
        closing = {self.samplers[w].close.remote(): w for w in up}
        for ref, w in closing.items():
            try:
                for item in ray.get(ref, timeout=60):
                    self.consume(item)
            except RayError:
                pass
        s = self.rec.summary()
        s["sync"] = sync_summary(pub, self.rec.samplers)
        s["metrics"] = self.metrics
        s["config"] = asdict(self.cfg)
        s["hardware"] = describe()
        s["history"] = self.rec.steps
        s["ray"] = {**self.report, "config": asdict(self.rcfg), "serving": serving,
                    "versions": _versions(pub, self.report), "nodes": len([n for n in ray.nodes() if n["Alive"]])}
        self.result.summary = s
        return self.result

    def _shutdown(self) -> None:
        if "ray" not in sys.modules:  # it never imported: nothing was started, and the import error is what to say
            return
        import ray

        if ray.is_initialized():
            for r in self.ranks:
                try:
                    ray.get(r.close.remote(), timeout=10)
                except Exception:  # noqa: BLE001 - a dead or hung rank is killed below either way
                    pass
            for a in self.ranks + self.samplers:
                ray.kill(a, no_restart=True)
            if self.pg is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.pg)
            if self.own_ray:
                ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()


class _Line(deque):
    """Tickets issued and not yet given to a sampler (Driver.issue puts them here)."""

    def put(self, ticket: dict) -> None:
        self.append(ticket)


def _versions(pub: PublisherStats, report: dict) -> list[dict]:
    """Per version: bytes on the wire, encode seconds and seconds from publish() until on every link (publisher),
    the trainer's gather and publish seconds, and each sampler's apply seconds and bytes received (keyframe or
    delta)."""
    steps = {s["version"]: s for s in report["steps"]}
    applied: dict[int, list] = {}
    for a in report["applied"]:
        applied.setdefault(a["version"], []).append({k: a[k] for k in ("worker", "incarnation", "bytes", "apply_s",
                                                                         "keyframe")})
    out = []
    for v in sorted(set(pub.bytes) | set(applied)):
        st, got = steps.get(v, {}), applied.get(v, [])
        sent = pub.bytes.get(v)  # a keyframe is sized when first sent: then what the samplers got
        out.append({"version": v, "bytes": sent if sent is not None else max((a["bytes"] for a in got), default=None),
                    "encode_s": pub.encode_s.get(v), "send_s": pub.send_s.get(v), "gather_s": st.get("gather_s"),
                    "publish_s": st.get("publish_s"), "applied": got})
    return out


def run_on_ray(cfg: LoopConfig, ray: RayConfig | bool = True, on_step=None) -> Result:
    """Run the loop on Ray until its budget is spent. on_step(driver) runs after every trainer step (tests)."""
    rcfg = ray if isinstance(ray, RayConfig) else RayConfig()
    return RayDriver(cfg, rcfg, on_step).run()
