"""The driver of the reference RL loop: trainer, admission control, staleness, weight publishing.

    trainer (this process)                         sampler processes
    ----------------------                         -----------------
    issue tickets   --- tickets queue ------------> take a group, decode it with continuous batching
    pull groups     <-- results queue (bounded) --- finished groups: tokens, versions, logprobs, reward
    GRPO step -> version v+1
    Publisher.publish(state, v+1)  === wsync ====> Subscriber.poll() between decode steps

Staleness of a sample = the trainer's version when it trains on it minus the
version of its first token (versions only grow along a sequence). Two
mechanisms bound it by eta (``max_staleness``):

* admission control: a ticket is issued only while
  ``accepted + running <= (eta + v + 1) * batch`` (counted in groups), so no
  sampler can run far ahead of the trainer;
* drop-if-stale: a group whose oldest token is more than eta versions behind
  when it reaches the trainer is discarded (it no longer counts as running,
  so admission lets a replacement start).

``mode="sync"`` is eta = 0 plus tickets that demand the current version: the
samplers wait for every step, and every sample is exactly on-policy.

Samplers are started with multiprocessing "spawn" (torch does not survive
fork), so a script that calls ``trainer.loop.run`` must guard it with
``if __name__ == "__main__":``. The Ray loop (ray_loop.py, ray_trainer.py)
builds on this module; ``trainer.loop.run`` picks between the two.
"""
from __future__ import annotations

import queue
import secrets
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .decode import DecodeConfig
from .grpo import GRPOConfig
from .metrics import Recorder
from .policy import PolicyConfig
from .promote import PromoteConfig
from .task import TaskConfig, sample_digits

if TYPE_CHECKING:
    from wsync.sync import PublisherStats


class SamplerFailed(RuntimeError):
    """A sampler process raised; the message carries its traceback."""


@dataclass(kw_only=True)
class LoopConfig:
    mode: str = "async"  # "sync": samplers wait for each version; "async": bounded staleness
    max_staleness: int = 1  # eta for async (sync uses 0)
    steps: int = 0  # stop after this many trainer steps (0: no step limit)
    seconds: float = 0.0  # stop after this much wall time, sampler start-up excluded (0: no time limit)
    samplers: int = 1  # sampler processes (one core each is the intent; the trainer takes another)
    group_size: int = 8  # samples per prompt (the GRPO group)
    batch_groups: int = 16  # groups per trainer step
    seed: int = 0  # prompts, policy init, sampling
    address: str = "tcp://127.0.0.1:0"  # where the publisher listens ("local://name" on one host)
    codec: str = "delta"  # wsync codec between keyframes
    keyframe_every: int = 50  # a raw keyframe every K versions
    threads: int = 1  # torch threads per process (trainer and each sampler)
    stall_timeout: float = 300.0  # seconds without any sampler output before the loop gives up
    report_digests: bool = False  # samplers report a digest per applied version (bit-identity checks)
    keep_samples: bool = False  # keep every trained sample in the result (tests)
    progress: bool = True  # live progress line on stderr
    metrics_port: int | None = None  # Prometheus: trainer on this port, sampler i on port + 1 + i (0: any free)
    task: TaskConfig = field(default_factory=TaskConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    promote: PromoteConfig | None = None  # promote to a prod channel through a gate every N steps (promote.py)

    def __post_init__(self):
        if self.mode not in ("sync", "async"):
            raise ValueError(f"mode must be 'sync' or 'async', got {self.mode!r}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.steps <= 0 and self.seconds <= 0:
            raise ValueError("give a budget: steps > 0 or seconds > 0")
        if self.decode.slots < self.group_size:
            raise ValueError(f"decode slots ({self.decode.slots}) must hold a whole group ({self.group_size})")
        if self.promote is not None:
            self.promote.check_budget(self.steps)

    @property
    def eta(self) -> int:
        return 0 if self.mode == "sync" else self.max_staleness


@dataclass
class Result:
    summary: dict  # what --json writes: config, hardware, totals, idle breakdown, sync, per-step history
    digests: dict = field(default_factory=dict)  # version -> trainer weight digest (report_digests)
    synced: list = field(default_factory=list)  # sampler reports {worker, version, digest} (report_digests)
    samples: list = field(default_factory=list)  # trained samples (keep_samples)


class Driver:
    def __init__(self, cfg: LoopConfig):
        import torch

        from .grpo import Learner
        from .policy import build

        torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        self.model = build(PolicyConfig(**{**asdict(cfg.policy), "seed": cfg.seed}))
        self.learner = Learner(self.model, cfg.grpo, temperature=cfg.decode.temperature, top_p=cfg.decode.top_p)
        self._start_records(cfg)

    def _start_records(self, cfg: LoopConfig) -> None:
        """The run's state that admission control and the records keep (every driver starts from it)."""
        self.rng = np.random.default_rng(cfg.seed)
        self.rec = Recorder(progress=cfg.progress)
        self.result = Result(summary={})
        self.version = 0
        self.issued = self.returned = self.accepted = 0  # in groups
        self.batch: list[list[dict]] = []
        self.alive: set[int] = set()
        self.promoter = None  # the prod channel, its gate and production engine (promote.py), when configured

    # -- admission control -------------------------------------------------------------------

    def issue(self) -> None:
        running = self.issued - self.returned
        limit = (self.cfg.eta + self.version + 1) * self.cfg.batch_groups
        while self.accepted + running < limit:
            self.tickets.put({"group": self.issued, "digits": sample_digits(self.cfg.task, self.rng),
                              "size": self.cfg.group_size,
                              "min_version": self.version if self.cfg.mode == "sync" else 0})
            self.issued += 1
            running += 1

    def consume(self, item: dict) -> None:
        kind = item["kind"]
        if kind == "error":
            raise SamplerFailed(f"sampler {item['worker']} failed:\n{item['error']}")
        if kind == "synced":
            self.result.synced.append(item)
        elif kind in ("ready", "bye"):
            (self.alive.add if kind == "ready" else self.alive.discard)(item["worker"])
            if item.get("metrics"):
                self.metrics["samplers"][item["worker"]] = item["metrics"]
            if "stats" in item:
                self.rec.sampler_stats(item["worker"], item["stats"])
        elif kind == "group":
            self.rec.sampler_stats(item["worker"], item["stats"])
            self.returned += 1
            oldest = min(s["versions"][0] for s in item["samples"])
            if self.version - oldest > self.cfg.eta:
                self.rec.dropped += len(item["samples"])
                return
            for s in item["samples"]:
                s["staleness"] = self.version - s["versions"][0]
            self.accepted += 1
            self.batch.append(item["samples"])

    # -- trainer step ------------------------------------------------------------------------

    def train(self) -> None:
        from .policy import state_digest

        t = time.perf_counter()
        # a planted bad stretch (promote.py) trains on corrupted rewards; the records keep the task's own
        batch = self.batch if self.promoter is None else self.promoter.rewarded(self.batch, self.version + 1)
        stats = self.learner.step(batch)
        self.rec.trainer["train_s"] += time.perf_counter() - t
        self.version += 1
        t = time.perf_counter()
        self.pub.publish(self.model.state_dict(), version=self.version)
        self.rec.trainer["publish_s"] += time.perf_counter() - t
        if self.cfg.report_digests:
            self.result.digests[self.version] = state_digest(self.model)
        if self.cfg.keep_samples:
            self.result.samples.extend(s for g in self.batch for s in g)
        self.rec.step(self.version, self.batch, stats, last_sync(self.pub.stats), _qsize(self.results))
        self.batch = []
        if self.promoter is not None:
            self.promoter.step_done(self.version, self.model.state_dict())

    def done(self) -> bool:
        c = self.cfg
        return (c.steps > 0 and self.version >= c.steps) or (c.seconds > 0 and self.rec.elapsed() >= c.seconds)

    # -- the run -------------------------------------------------------------------------------

    def run(self) -> Result:
        import multiprocessing as mp

        import wsync

        from . import sampler
        from .policy import state_digest

        # an auth token keeps anyone else on the network from pushing weights; local:// is a private socket
        token = secrets.token_bytes(16) if self.cfg.address.startswith("tcp://") else None
        self.pub = wsync.Publisher(self.cfg.address, codec=self.cfg.codec, keyframe_every=self.cfg.keyframe_every,
                                   token=token, metrics_port=self.cfg.metrics_port)
        self.metrics: dict = {"trainer": self.pub.metrics.url if self.pub.metrics else None, "samplers": {}}
        ctx = mp.get_context("spawn")
        self.tickets = ctx.Queue()
        self.results = ctx.Queue(maxsize=(self.cfg.eta + 1) * self.cfg.batch_groups + 4 * self.cfg.samplers)
        self.stop = ctx.Event()
        scfg = sampler.SamplerConfig(policy=self.cfg.policy, decode=self.cfg.decode, threads=self.cfg.threads,
                                     seed=self.cfg.seed, report_digests=self.cfg.report_digests,
                                     metrics_port=self.cfg.metrics_port)
        self.procs = procs = [ctx.Process(target=sampler.main, name=f"wsync-sampler-{i}", daemon=True,
                             args=(i, scfg, self.pub.address, token, self.tickets, self.results, self.stop))
                 for i in range(self.cfg.samplers)]
        try:
            self.pub.publish(self.model.state_dict(), version=0)
            if self.cfg.report_digests:
                self.result.digests[0] = state_digest(self.model)
            for p in procs:
                p.start()
            if self.cfg.promote is not None:  # built while the samplers start; prod begins on version 0
                from .promote import Promoter

                self.promoter = Promoter(self.cfg, self.model.state_dict())
            while len(self.alive) < self.cfg.samplers:
                self.consume(self._next())
            self.rec.restart_clock()
            while not self.done():
                self.issue()
                t = time.perf_counter()
                item = self._next()
                self.rec.trainer["wait_samples_s"] += time.perf_counter() - t
                self.consume(item)
                if len(self.batch) == self.cfg.batch_groups:
                    self.train()
            self.pub.flush(timeout=60.0)
            return self._finish()
        finally:
            self._shutdown(procs)

    def _next(self) -> dict:
        """The next item from the samplers; a sampler that died without a word, or silence, raises."""
        deadline = time.perf_counter() + self.cfg.stall_timeout
        while True:
            try:
                return self.results.get(timeout=1.0)
            except queue.Empty:
                pass
            dead = [p for p in self.procs if p.exitcode is not None]
            if dead:
                raise SamplerFailed(f"sampler process {dead[0].name} exited with code {dead[0].exitcode} "
                                    "without reporting an error (killed, or out of memory?)")
            if time.perf_counter() > deadline:
                raise SamplerFailed(f"no sampler output for {self.cfg.stall_timeout}s; samplers alive: "
                                    f"{sorted(self.alive)}")

    def _finish(self) -> Result:
        from wsync.hardware import describe

        if self.cfg.progress:
            print(file=sys.stderr)
        self.stop.set()
        deadline = time.perf_counter() + 30.0
        while self.alive and time.perf_counter() < deadline:  # the final 'bye' items carry the sampler clocks
            try:
                self.consume(self.results.get(timeout=1.0))
            except queue.Empty:
                continue
        s = self.rec.summary()
        s["sync"] = sync_summary(self.pub.stats, self.rec.samplers)  # stats: a snapshot, safe while encoding
        s["metrics"] = self.metrics
        s["config"] = asdict(self.cfg)
        s["hardware"] = describe()
        s["history"] = self.rec.steps
        if self.promoter is not None:
            s["promotion"] = self.promoter.summary()
        self.result.summary = s
        return self.result

    def _shutdown(self, procs) -> None:
        self.stop.set()
        # drain so no sampler stays blocked on a full results queue, then join; terminate only our own stragglers
        deadline = time.perf_counter() + 15.0
        while any(p.pid is not None and p.is_alive() for p in procs) and time.perf_counter() < deadline:
            try:
                self.results.get(timeout=0.2)
            except queue.Empty:
                pass
        for p in procs:
            if p.pid is None:  # never started
                continue
            p.join(timeout=1.0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
        if self.promoter is not None:
            self.promoter.close()
        self.pub.close()


def _qsize(q) -> int:
    try:
        return q.qsize()
    except NotImplementedError:  # macOS has no sem_getvalue
        return -1


def _sent(stats: PublisherStats) -> dict:
    """version -> bytes on the wire, for versions whose size is known (keyframes are sized on first use)."""
    return {v: n for v, n in stats.bytes.items() if n is not None}


def last_sync(stats: PublisherStats) -> dict:
    """Bytes and seconds of the newest version on every sampler's link, seconds counted from publish() (its
    encoding included); before any version is, the newest encoded and the seconds of its encoding."""
    sent = _sent(stats)
    on_links = [v for v in stats.send_s if v in sent]
    if on_links:
        v = max(on_links)
        return {"version": v, "bytes": sent[v], "seconds": stats.send_s[v]}
    if not sent:
        return {}
    v = max(sent)
    return {"version": v, "bytes": sent[v], "seconds": stats.encode_s.get(v, 0.0)}


def sync_summary(pub: PublisherStats, samplers: dict) -> dict:
    sent = _sent(pub)
    return {
        "versions_sent": len(sent), "bytes_total": int(sum(sent.values())),
        "bytes_per_version_mean": float(np.mean(list(sent.values()))) if sent else 0.0,
        "encode_s": float(sum(pub.encode_s.values())), "send_s": float(sum(pub.send_s.values())),
        "sampler_apply_s": float(sum(s.get("apply_s", 0.0) for s in samplers.values())),
    }
