"""Sampler worker: a separate process that generates continuously into the results queue.

Each worker holds its own copy of the policy and gets weights only through a
wsync Subscriber (never through the queues). Between two decode steps it polls
the subscriber; a new version is written into the live parameters in place and
the next token is already sampled with it, so a sequence can span versions.

Work arrives as tickets (one GRPO group: a prompt to sample ``size`` times),
issued by the driver under admission control. A ticket may demand a minimum
version; that is how the synchronous mode makes samplers wait for each step.

Everything that crosses the queues is plain lists, ints, floats and strings.
"""
from __future__ import annotations

import time
import traceback
from dataclasses import asdict, dataclass, field

from .decode import DecodeConfig, Decoder, Sequence
from .policy import PolicyConfig
from .task import prompt_ids, response_limit, reward


@dataclass(kw_only=True)
class SamplerConfig:
    policy: PolicyConfig = field(default_factory=PolicyConfig)  # must match the trainer's architecture
    decode: DecodeConfig = field(default_factory=DecodeConfig)  # slots, temperature, top-p, KV cache policy
    threads: int = 1  # torch and OpenMP threads of this process (the loop's processes share the cores)
    seed: int = 0  # sampling seed; worker i draws from seed * 1000 + i
    report_digests: bool = False  # after each applied version, send a digest of the live weights (tests)
    connect_timeout: float = 60.0  # seconds to wait for version 0, or for a version a ticket demands
    metrics_port: int | None = None  # Prometheus: worker i serves on port + 1 + i (0: any free port); None: off


class Worker:
    """The state of one sampler process; `run` is its main loop."""

    def __init__(self, index: int, cfg: SamplerConfig, address: str, token: bytes, tickets, results, stop):
        import torch
        from wsync.engines import HF

        from .policy import build

        torch.set_num_threads(cfg.threads)
        self.index, self.cfg, self.tickets, self.results, self.stop = index, cfg, tickets, results, stop
        self.model = build(cfg.policy)
        self.sub = self._subscriber(address, engine=HF(self.model), token=token, apply="poll",
                                    metrics_port=metrics_port(cfg.metrics_port, index))
        self.decoder = Decoder(self.model, cfg.decode, seed=cfg.seed * 1000 + index)
        self.groups: dict[int, dict] = {}  # group id -> ticket and its finished samples
        self.held = None  # a ticket taken from the queue that waits for free slots or a newer version
        self.clock = {"decode_s": 0.0, "no_work_s": 0.0, "wait_version_s": 0.0, "queue_full_s": 0.0, "apply_s": 0.0}
        self.count = {"steps": 0, "tokens": 0, "sequences": 0, "versions_applied": 0}

    def _subscriber(self, address: str, **kw):
        """The wsync Subscriber this worker follows the trainer with (the Ray sampler's records each version)."""
        import wsync

        return wsync.Subscriber(address, **kw)

    def run(self) -> None:
        t = time.perf_counter()
        self.sub.wait_for(0, timeout=self.cfg.connect_timeout)
        self._applied(self.sub.version, time.perf_counter() - t)
        self._put({"kind": "ready", "worker": self.index, "version": self.sub.version,
                   "metrics": self.sub.metrics.url if self.sub.metrics else None})
        while not self.stop.is_set():
            self._poll()
            if not self._admit():
                break
            self._decode()
        self._put({"kind": "bye", "worker": self.index, "stats": self.stats()})

    def _poll(self) -> None:
        """Apply the newest received version, if any, between two decode steps."""
        t = time.perf_counter()
        v = self.sub.poll()
        if v is not None:
            self._applied(v, time.perf_counter() - t)

    def _applied(self, version: int, seconds: float) -> None:
        self.decoder.weights_changed()
        self.clock["apply_s"] += seconds
        self.count["versions_applied"] += 1
        if self.cfg.report_digests:
            from .policy import state_digest

            self._put({"kind": "synced", "worker": self.index, "version": version, "digest": state_digest(self.model)})

    def _admit(self) -> bool:
        """Start as many held/queued groups as there are free slots. False once told to stop."""
        import queue

        while True:
            if self.held is None:
                idle = self.decoder.active == 0
                t = time.perf_counter()
                try:
                    # with nothing to decode, block briefly (idle); otherwise only take what is ready
                    self.held = self.tickets.get(timeout=0.05) if idle else self.tickets.get_nowait()
                except queue.Empty:
                    self.clock["no_work_s"] += time.perf_counter() - t if idle else 0.0
                    return True
                self.clock["no_work_s"] += time.perf_counter() - t if idle else 0.0
                if self.held is None:  # the driver's stop sentinel
                    return False
            ticket = self.held
            if ticket["size"] > self.decoder.free or not self.decoder.refilling:
                return True
            if ticket["min_version"] > self.sub.version:
                if self.decoder.active:
                    return True  # keep decoding what runs; the poll before the next step may bring the version
                t = time.perf_counter()
                self.sub.wait_for(ticket["min_version"], timeout=self.cfg.connect_timeout)
                self.clock["wait_version_s"] += time.perf_counter() - t
                self._applied(self.sub.version, 0.0)
            self._start(ticket)
            self.held = None

    def _start(self, ticket: dict) -> None:
        self.groups[ticket["group"]] = {"ticket": ticket, "done": []}
        for _ in range(ticket["size"]):
            digits = ticket["digits"]
            self.decoder.add(Sequence(prompt=prompt_ids(digits), limit=response_limit(digits),
                                      tag={"group": ticket["group"]}))

    def _decode(self) -> None:
        if not self.decoder.active:
            return
        t = time.perf_counter()
        active = self.decoder.active
        finished = self.decoder.step(self.sub.version)
        self.clock["decode_s"] += time.perf_counter() - t
        self.count["steps"] += 1
        self.count["tokens"] += active
        for seq in finished:
            self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        g = self.groups[seq.tag["group"]]
        digits = g["ticket"]["digits"]
        g["done"].append({"prompt": seq.prompt, "response": seq.response, "versions": seq.versions,
                          "logprobs": seq.logprobs, "reward": reward(digits, seq.response)})
        self.count["sequences"] += 1
        if len(g["done"]) == g["ticket"]["size"]:
            del self.groups[seq.tag["group"]]
            self._put({"kind": "group", "worker": self.index, "group": g["ticket"]["group"], "digits": digits,
                       "samples": g["done"], "stats": self.stats()})

    def _put(self, item: dict) -> None:
        """Hand an item to the driver; a full queue blocks the worker, and that wait is counted as idle."""
        t = time.perf_counter()
        self.results.put(item)
        self.clock["queue_full_s"] += time.perf_counter() - t

    def stats(self) -> dict:
        s = {**self.clock, **self.count, "slots": self.cfg.decode.slots}
        s.update({f"sub_{k}": v for k, v in asdict(self.sub.stats).items() if isinstance(v, (int, float))})
        return s


def metrics_port(base: int | None, index: int) -> int | None:
    """Worker i's metrics port: base + 1 + i (the trainer has base), any free one for base 0, None for none."""
    if base is None:
        return None
    return base + 1 + index if base else 0


def main(index: int, cfg: SamplerConfig, address: str, token: bytes, tickets, results, stop) -> None:
    """Process entry point (multiprocessing spawn). Errors go back to the driver as an item, never silently."""
    import os

    # set before torch (or wsync's C++ backend) starts its OpenMP pool: idle spinning threads would steal the
    # cores the other processes of the loop need
    os.environ["OMP_NUM_THREADS"] = str(cfg.threads)
    worker = None
    try:
        worker = Worker(index, cfg, address, token, tickets, results, stop)
        worker.run()
    except BaseException:  # noqa: BLE001 - the driver must learn why a sampler died, whatever it was
        results.put({"kind": "error", "worker": index, "error": traceback.format_exc()})
    finally:
        if worker is not None:
            worker.sub.close()
