"""A seeded discrete-event simulation of an RL loop: samplers, trainer, weight syncs.

Sync mode generates a batch with one policy version, waits for its longest
response, trains, syncs, repeats: zero staleness, idle GPUs on both sides.
Async mode keeps the samplers busy: a sample starts only while fewer than
(version + max_staleness + 1) * batch samples have been admitted, the trainer
takes the first `samples_per_step` finished samples, weights land in flight
(engines pause `engine_pause_s`, running sequences continue on the new weights),
and a sample whose start version is more than `max_staleness` behind the step
that would train on it is dropped (buffered) or aborted (in flight), so the cap
always holds. Staleness of a sample = training step - version it started with.
Time only moves from event to event (a completion, a trainer step ending), so a
run of thousands of samples takes a fraction of a second.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .loop import DecodeCost, SimulatedLoop, sync_seconds, train_step_s
from .models import PlanError, get_model

_DONE = 1e-6  # tokens left below which a sequence counts as finished (float residue)


@dataclass
class _Seq:
    length: int  # response tokens
    version: int  # policy version it started with
    remaining: float  # tokens still to generate
    group: int = 0  # prompt it belongs to; a group reaches the trainer when all its samples are done


class _SimEngine:
    def __init__(self, cost: DecodeCost, prompt: int, max_batch: int):
        self.cost, self.prompt, self.max_batch = cost, prompt, max_batch
        self.seqs: list[_Seq] = []
        self.version = 0
        self.t = 0.0
        self.paused_until = 0.0
        self.dt = 0.0  # seconds per decode step with the current sequences
        self.decoding_s = 0.0  # time spent decoding
        self.slot_s = 0.0  # sum over time of active sequences

    def refresh(self) -> None:
        if self.seqs:
            ctx = self.prompt + sum(s.length - s.remaining for s in self.seqs) / len(self.seqs)
            self.dt = self.cost(len(self.seqs), ctx)

    def next_event(self) -> float:
        if not self.seqs:
            return math.inf
        return max(self.t, self.paused_until) + min(s.remaining for s in self.seqs) * self.dt

    def advance(self, t: float) -> None:
        start = max(self.t, self.paused_until)
        if t > start and self.seqs:
            n = (t - start) / self.dt
            for s in self.seqs:
                s.remaining -= n
            self.decoding_s += t - start
            self.slot_s += (t - start) * len(self.seqs)
        self.t = max(self.t, t)

    def finished(self) -> list[_Seq]:
        done = [s for s in self.seqs if s.remaining <= _DONE]
        if done:
            self.seqs = [s for s in self.seqs if s.remaining > _DONE]
        return done


@dataclass(frozen=True, kw_only=True)
class LoopResult:
    mode: str
    samples_per_s: float  # trained samples per second, steady state
    tokens_per_s: float  # trained tokens (prompt + response) per second
    step_s: float  # mean time per trainer step
    staleness_mean: float
    staleness_p99: float
    staleness_max: int
    dropped_fraction: float  # generated samples thrown away for staleness
    trainer_idle: float  # share of trainer-pool time not training
    sampler_idle: float  # share of sampler-engine time not decoding (waiting or paused)
    slot_occupancy: float  # mean active sequences / max_batch while the window runs
    sync_s: float  # trainer-side weight-sync time per step
    train_s: float  # mean trainer compute time per step


class _Sim:
    def __init__(self, cfg: SimulatedLoop):
        cfg.validate()
        self.cfg, m = cfg, get_model(cfg.model)
        self.m = m
        self.rng = np.random.default_rng(cfg.seed)
        self.sync_s, self.pause_s = sync_seconds(cfg, m)
        cost = DecodeCost(cfg, m)
        self.engines = [_SimEngine(cost, cfg.prompt_tokens, cfg.max_batch) for _ in range(cfg.infer_gpus // cfg.tp)]
        self.version = 0  # trainer steps done = newest policy version
        self.training_until = math.inf  # end of the current train + sync, inf when idle
        self.buffer: list[_Seq] = []
        self.admitted = 0  # samples admitted and not dropped
        self.dropped = self.generated = 0
        self.staleness: list[int] = []
        self.trained_lengths: list[int] = []
        self.train_s: list[float] = []
        self.train_busy = 0.0
        self.marks: dict[int, tuple] = {0: (0.0, 0.0, 0.0, 0.0, 0, 0, 0)}  # version -> counters when it landed
        self.pending: dict[int, list[_Seq]] = {}  # group -> its finished samples, until the group is whole
        self.groups = 0
        if cfg.length_table:
            caps, probs = zip(*cfg.length_table)
            self.caps, self.cap_p = np.array(caps), np.array(probs, dtype=float) / sum(probs)

    def _lengths(self) -> list[int]:
        """Response lengths of one group: a shared cap from the table, each sample may stop early."""
        c = self.cfg
        if not c.length_table:
            return [self._length() for _ in range(c.group_size)]
        cap = int(self.rng.choice(self.caps, p=self.cap_p))
        if c.early_stop <= 0:
            return [cap] * c.group_size
        return [int(n) for n in np.minimum(self.rng.geometric(c.early_stop, size=c.group_size), cap)]

    def _length(self) -> int:
        c = self.cfg
        if c.response_sigma <= 0:
            return max(1, min(int(round(c.response_mean)), c.response_max))
        mu = math.log(c.response_mean) - c.response_sigma ** 2 / 2  # lognormal with the requested mean
        return int(min(max(1.0, self.rng.lognormal(mu, c.response_sigma)), c.response_max))

    def _admit(self, t: float) -> None:
        c = self.cfg
        for e in self.engines:
            changed = False
            g = c.group_size
            while len(e.seqs) + g <= c.max_batch:
                if c.mode == "sync":
                    if self.training_until < math.inf or self.admitted + g > (self.version + 1) * c.samples_per_step:
                        break
                elif self.admitted + g > (e.version + c.max_staleness + 1) * c.samples_per_step:
                    break
                e.seqs += [_Seq(length=n, version=e.version, remaining=float(n), group=self.groups)
                           for n in self._lengths()]
                self.pending[self.groups] = []
                self.groups += 1
                self.admitted += g
                self.generated += g
                changed = True
            if changed:
                e.refresh()

    def _start_training(self, t: float) -> None:
        c, step = self.cfg, self.version
        cap = 0 if c.mode == "sync" else c.max_staleness
        keep = [s for s in self.buffer if step - s.version <= cap]
        self.dropped += len(self.buffer) - len(keep)
        self.admitted -= len(self.buffer) - len(keep)
        self.buffer = keep
        if len(self.buffer) < c.samples_per_step:
            return
        batch, self.buffer = self.buffer[:c.samples_per_step], self.buffer[c.samples_per_step:]
        for e in self.engines if c.abort_stale else ():  # in-flight samples too old for any later step
            alive = [s for s in e.seqs if s.version >= step + 1 - cap]
            if len(alive) != len(e.seqs):
                gone = {s.group for s in e.seqs} - {s.group for s in alive}
                done = sum(len(self.pending.pop(g, [])) for g in gone)  # finished samples of aborted groups
                self.dropped += len(e.seqs) - len(alive) + done
                self.admitted -= len(e.seqs) - len(alive) + done
                e.seqs = alive
                e.refresh()
        self.staleness += [step - s.version for s in batch]
        self.trained_lengths += [s.length for s in batch]
        tokens = sum(c.prompt_tokens + s.length for s in batch)
        train = train_step_s(c, self.m, tokens)
        self.train_s.append(train)
        self.train_busy += train
        self.training_until = t + train + self.sync_s

    def _finish_step(self, t: float) -> None:
        self.version += 1
        self.training_until = math.inf
        for e in self.engines:  # weights land; async engines pause to load them, sync engines are idle
            e.version = self.version
            e.paused_until = max(e.paused_until, t + (self.pause_s if self.cfg.mode == "async" else 0.0))
        if self.version in (self.cfg.warmup_steps, self.cfg.steps):
            self.marks[self.version] = (t, sum(e.decoding_s for e in self.engines),
                                        sum(e.slot_s for e in self.engines), self.train_busy,
                                        len(self.staleness), self.generated, self.dropped)

    def _collect(self, done: list[_Seq]) -> None:
        """Finished samples wait for the rest of their group; a whole group joins the buffer."""
        for s in done:
            members = self.pending.get(s.group)
            if members is None:  # its group was aborted as stale
                continue
            members.append(s)
            if len(members) == self.cfg.group_size:
                self.buffer += self.pending.pop(s.group)

    def run(self) -> LoopResult:
        t = 0.0
        self._admit(t)
        while self.version < self.cfg.steps:
            t = min(min(e.next_event() for e in self.engines), self.training_until)
            if t == math.inf:
                raise PlanError("the simulated loop stalled: no sample can start; raise max_batch or samples_per_step")
            for e in self.engines:
                e.advance(t)
                done = e.finished()
                if done:
                    self._collect(done)
                    e.refresh()
            if t >= self.training_until:
                self._finish_step(t)
            if self.training_until == math.inf:
                self._start_training(t)
            self._admit(t)
        return self._result()

    def _result(self) -> LoopResult:
        c = self.cfg
        (t0, dec0, slot0, tr0, n0, g0, d0) = self.marks[c.warmup_steps]
        (t1, dec1, slot1, tr1, n1, g1, d1) = self.marks[c.steps]
        window, steps = t1 - t0, c.steps - c.warmup_steps
        stale = np.array(self.staleness[n0:n1])
        trained = steps * c.samples_per_step
        tokens = trained * c.prompt_tokens + sum(self.trained_lengths[n0:n1])
        n_eng = len(self.engines)
        return LoopResult(
            mode=c.mode, samples_per_s=trained / window,
            tokens_per_s=tokens / window, step_s=window / steps,
            staleness_mean=float(stale.mean()), staleness_p99=float(np.percentile(stale, 99)),
            staleness_max=int(stale.max()), dropped_fraction=(d1 - d0) / max(1, g1 - g0),
            trainer_idle=1.0 - (tr1 - tr0) / window, sampler_idle=1.0 - (dec1 - dec0) / (n_eng * window),
            slot_occupancy=(slot1 - slot0) / (n_eng * c.max_batch * window), sync_s=self.sync_s,
            train_s=float(np.mean(self.train_s[c.warmup_steps:c.steps])),
        )


def simulate(cfg: SimulatedLoop) -> LoopResult:
    """Run the loop for `cfg.steps` trainer steps and report steady-state figures."""
    return _Sim(cfg).run()
