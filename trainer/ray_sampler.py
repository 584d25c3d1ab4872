"""A sampler of the Ray loop: the one-process loop's sampler worker, run inside a Ray actor.

The worker (``trainer.sampler.Worker``: continuous batching, a wsync Subscriber
polled between decode steps) runs in a thread of the actor, with in-process
queues where the one-host loop has multiprocessing ones. The driver hands it
tickets with ``give`` and collects what it produced with ``take``; the actor is
threaded (``max_concurrency``) so those calls never wait behind each other.

Every item carries ``life``, a name of this incarnation of the actor: when Ray
restarts a killed sampler, the driver sees a new life, puts the groups the old
one held back in line, and the new one starts from a keyframe (its fresh model
holds no version, so its hello asks for one).
"""
from __future__ import annotations

import os
import queue
import secrets
import threading
import traceback

from .sampler import SamplerConfig, Worker


class RayWorker(Worker):
    """The worker, plus an 'applied' item per committed version (bytes, seconds, keyframe) and status requests."""

    def __init__(self, *args, life: str, **kw):
        self.life = life
        self.requests: queue.Queue = queue.Queue()
        self.commits: queue.Queue = queue.Queue()  # a line per version the Subscriber commits (its on_commit)
        super().__init__(*args, **kw)

    def _subscriber(self, address: str, **kw):
        import wsync

        return wsync.Subscriber(address, on_commit=self.commits.put, **kw)

    def _applied(self, version: int, seconds: float) -> None:
        super()._applied(version, seconds)
        while True:
            try:
                line = self.commits.get_nowait()
            except queue.Empty:
                return
            self._put({"kind": "applied", "worker": self.index, **line})

    def _poll(self) -> None:
        super()._poll()
        while True:  # between decode steps, as weights are applied: the model is not in use
            try:
                box, done = self.requests.get_nowait()
            except queue.Empty:
                return
            box.update(self.status())
            done.set()

    def status(self) -> dict:
        from .policy import state_digest

        return {"worker": self.index, "life": self.life, "version": self.sub.version,
                "digest": state_digest(self.model), "link_error": str(self.sub.error) if self.sub.error else None}


class _Tagged:
    """A results queue that stamps each item with the worker's life."""

    def __init__(self, q: queue.Queue, life: str):
        self.q, self.life = q, life

    def put(self, item: dict) -> None:
        self.q.put({**item, "life": self.life})


class SamplerActor:
    """A Ray actor around one RayWorker thread."""

    def __init__(self, index: int, cfg: SamplerConfig, address: str, token: bytes | None, backlog: int):
        os.environ["OMP_NUM_THREADS"] = str(cfg.threads)  # before torch starts its pool (see trainer.sampler)
        self.index, self.life = index, secrets.token_hex(4)
        self.tickets: queue.Queue = queue.Queue()
        self.results: queue.Queue = queue.Queue(maxsize=backlog)
        self.stop = threading.Event()
        self.worker = RayWorker(index, cfg, address, token, self.tickets, _Tagged(self.results, self.life),
                                self.stop, life=self.life)
        self.thread = threading.Thread(target=self._main, name="wsync-sampler", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        try:
            self.worker.run()
        except BaseException:  # noqa: BLE001 - the driver must learn why, whatever it was
            self.results.put({"kind": "error", "worker": self.index, "life": self.life,
                              "error": traceback.format_exc()})

    def give(self, tickets: list) -> None:
        for t in tickets:
            self.tickets.put(t)

    def take(self, timeout: float) -> list:
        """What the worker produced: waits up to `timeout` for the first item, then takes all that are ready."""
        try:
            items = [self.results.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                items.append(self.results.get_nowait())
            except queue.Empty:
                return items

    def status(self, timeout: float = 30.0) -> dict:
        """The version this sampler serves, a digest of its weights (taken between two decode steps), its node."""
        if not self.thread.is_alive():
            return self.worker.status() | self.node()
        box, done = {}, threading.Event()
        self.worker.requests.put((box, done))
        if not done.wait(timeout):
            box = {"worker": self.index, "life": self.life, "version": self.worker.sub.version, "digest": None,
                   "link_error": "busy: no status within the timeout"}
        return box | self.node()

    def node(self) -> dict:
        import ray

        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    def close(self, timeout: float = 30.0) -> list:
        """Stop the worker; returns what it produced meanwhile (its last item is 'bye', with its clocks)."""
        self.stop.set()
        self.tickets.put(None)
        items = []
        while self.thread.is_alive() or not self.results.empty():
            items += self.take(0.2)
            self.thread.join(timeout=0.01)
            timeout -= 0.2
            if timeout <= 0:
                break
        self.worker.sub.close()
        return items
