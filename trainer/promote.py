"""Continual learning in the reference loop: trained versions reach users only through a gate, and go back at once.

The samplers follow the trainer's own publisher (the ``train`` stream) and get
every version, good or bad: RL needs on-policy samples. Users must not. This
module puts a ``wsync.channels.Channels`` hub beside the trainer; every N steps
the trained version is offered to it and promoted onto ``prod`` through a gate.

    trainer step v (v % N == 0) --offer/promote--> hub --gate channel--> evaluator: greedy on held-out prompts
                                                       --prod channel--> production engine: answers requests

The gate's rule: a candidate passes when its mean reward (the task's own reward
function, greedy decoding, a fixed set of held-out prompts) is at least the
threshold (``gate``) AND at most ``margin`` below the reward of the version prod
serves (measured when that version passed; the same bytes decode the same
answers). The floor catches a version that is bad outright, the margin one that
is worse than what users have now; margin 1 leaves only the floor.

Prod starts on version 0, the weights training starts from (in a real run, the
checkpoint production already serves): it is measured and recorded, not gated.

The production engine is a Subscriber (apply="poll") into its own HF model in
the trainer process: on two cores a process of its own would take CPU from the
samplers, and it reaches prod over the same tcp wire a remote engine would (so
it can only ever be handed what was promoted). Polling in the thread that
answers the requests makes "which version served this request" exact: no
version is written while a request decodes. After each promotion or rollback it
waits for the release before answering, so the log shows the change at its step.

Promotion runs in the trainer's thread between two steps (the gate decodes the
held-out prompts there): on the reference loop's model that is tens of
milliseconds per promotion, reported as ``seconds`` in the summary; with a large
model the hub would run as a process of its own (``Channels.follow``).

A planted bad stretch (``corrupt``) trains steps A..B on a corrupted reward; the
gate must refuse what is offered then while prod keeps its last good version and
training goes on. ``rollback`` at step S makes prod serve version V's exact bytes
again while the samplers keep following ``train``.
"""
from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np

from .task import Vocab, prompt_ids, response_limit, reward, sample_digits

CORRUPTIONS = ("junk", "negate", "random")
RULE = "passed = reward >= gate and reward >= prod_reward - margin (held-out prompts, greedy decoding)"


@dataclass(kw_only=True)
class PromoteConfig:
    every: int  # offer the trained version to the hub and promote it onto prod every `every` trainer steps
    gate: float = 0.0  # floor: a candidate's held-out mean reward must reach it (rewards lie in [0, 1])
    margin: float = 0.05  # and be no more than this below prod's version's reward (1: the floor alone)
    prompts: int = 128  # held-out prompts the evaluator decodes, fixed for the run
    requests: int = 2  # requests the production engine answers after each trainer step
    corrupt: tuple[int, int] | None = None  # trainer steps A..B (inclusive) that learn from a corrupted reward
    # junk: a reward bug that pays for tokens that are not digits (an empty answer scores 1), which the policy
    # learns within a few steps; negate: the reward's sign flipped; random: noise in [0, 1)
    corruption: str = "junk"
    rollback: tuple[int, int | None] | None = None  # at trainer step S, prod back to version V (None: the one before)
    keep: int = 8  # promoted versions prod keeps for rollback (raised so that the rollback's target is kept)
    timeout: float = 120.0  # seconds the evaluator and the production engine may take to receive a version

    def __post_init__(self):
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"promote every N steps needs N >= 1, got {self.every!r}")
        for name in ("gate", "margin"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"the gate's {name} is a reward in [0, 1], got {getattr(self, name)}")
        if self.prompts < 1 or self.requests < 0 or self.keep < 1:
            raise ValueError(f"need prompts >= 1, requests >= 0, keep >= 1; got {self.prompts}, {self.requests}, "
                             f"{self.keep}")
        if self.corruption not in CORRUPTIONS:
            raise ValueError(f"corruption must be one of {CORRUPTIONS}, got {self.corruption!r}")
        if self.corrupt is not None:
            a, b = self.corrupt
            if not 1 <= a <= b:
                raise ValueError(f"corrupted steps A:B need 1 <= A <= B, got {a}:{b}")
        if self.rollback is not None:
            step, to = self.rollback
            if step < 1:
                raise ValueError(f"a rollback happens at a trainer step >= 1, got {step}")
            if to is not None and not (0 <= to < step and to % self.every == 0):
                raise ValueError(f"rollback at step {step} to version {to}: only versions promoted before it can be "
                                 f"served again, i.e. 0 or a multiple of {self.every} below {step}")

    def check_budget(self, steps: int) -> None:
        """Refuse steps the loop will never reach (with a step budget)."""
        if steps <= 0:
            return
        for what, at in (("corrupted stretch", self.corrupt and self.corrupt[0]),
                         ("rollback", self.rollback and self.rollback[0])):
            if at and at > steps:
                raise ValueError(f"the {what} starts at step {at}, after the last of the {steps} steps")

    @property
    def kept(self) -> int:
        """Promoted versions prod must keep: enough that the rollback's target is still held at its step."""
        return max(self.keep, self.rollback[0] // self.every + 2 if self.rollback else 0)


def greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy answers to digit prompts, batched and left-padded; each cut at its EOS or its length limit.

    No KV cache: the answers are a few tokens long, and a fresh forward per token keeps this independent of
    the samplers' decoder, whose sampled tokens it is meant to check."""
    import torch

    from .decode import positions

    rows = [prompt_ids(d) for d in prompts]
    limits = [response_limit(d) for d in prompts]
    out: list[list[int]] = [[] for _ in rows]
    with torch.no_grad():
        for _ in range(max(limits, default=0)):
            seqs = [r + o for r, o in zip(rows, out)]
            width = max(map(len, seqs))
            ids = torch.full((len(seqs), width), Vocab.PAD, dtype=torch.long)
            mask = torch.zeros((len(seqs), width), dtype=torch.long)
            for i, s in enumerate(seqs):
                ids[i, width - len(s):] = torch.tensor(s)
                mask[i, width - len(s):] = 1
            nxt = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits[:, -1].argmax(dim=-1)
            for i, o in enumerate(out):
                if len(o) < limits[i] and Vocab.EOS not in o:
                    o.append(int(nxt[i]))
            if all(len(o) >= n or Vocab.EOS in o for o, n in zip(out, limits)):
                break
    return out


def heldout_reward(model, prompts: list[list[int]]) -> float:
    answers = greedy(model, prompts)
    return round(float(np.mean([reward(d, a) for d, a in zip(prompts, answers)])), 6)


def corrupted(sample: dict, kind: str, rng: np.random.Generator) -> float:
    """The planted bug's reward for one sample."""
    if kind == "junk":
        resp = sample["response"]
        return sum(not 0 <= t - Vocab.DIGIT0 < 10 for t in resp) / max(len(resp), 1)
    if kind == "negate":
        return -sample["reward"]
    return float(rng.random())


class Promoter:
    """The hub, its evaluator and the production engine of one loop run; the driver calls it at each step."""

    def __init__(self, cfg, state):
        """cfg: the LoopConfig (cfg.promote set); state: version 0, which prod serves from the start."""
        import secrets

        from wsync.channels import Channels, Gate
        from wsync.engines import HF
        from wsync.subscriber import Subscriber

        from .policy import build

        self.cfg, self.pc = cfg, cfg.promote
        # their own stream, so the training prompts stay as they were. Fixed and drawn apart, not unseen: a task
        # of 2-digit prompts has only 100, which training meets too
        rng = np.random.default_rng([cfg.seed, 1])
        self.heldout = [sample_digits(cfg.task, rng) for _ in range(self.pc.prompts)]
        self.requests_rng = np.random.default_rng([cfg.seed, 2])
        self.noise = np.random.default_rng([cfg.seed, 3])
        self.scores: dict[int, float] = {}  # version -> held-out reward when it passed (or was measured)
        self.prod_reward: float | None = None  # the reward of what prod serves, set before each gate runs
        self.log: list[dict] = []  # one entry per production request
        self.events: list[dict] = []  # prod changes as the production engine saw them (and failed rollbacks)
        self.corrupted_steps: list[int] = []
        self.unserved = 0
        self.seconds = 0.0
        self.hub = self.prod = None
        try:
            self.evaluator = HF(build(cfg.policy))
            gate = Gate(check=self._check, engine=self.evaluator, timeout=self.pc.timeout)
            self.hub = Channels(("prod",), token=secrets.token_bytes(16), keep=self.pc.kept, candidates=2,
                                gates={"prod": gate}, codec=cfg.codec)
            self.engine = HF(build(cfg.policy))
            self.prod = Subscriber(self.hub.address("prod"), engine=self.engine, token=self.hub.token, apply="poll")
            self.hub.offer(state, 0)
            baseline = Gate(check=self._measure, engine=self.evaluator, timeout=self.pc.timeout)
            rec = self.hub.promote(0, why="baseline: the weights training starts from", gate=baseline)
            self.scores[0] = rec.gate["detail"]["reward"]
            self._follow(rec, 0)
        except BaseException:
            self.close()
            raise

    # -- the driver's hooks ---------------------------------------------------------------------

    def rewarded(self, batch: list[list[dict]], step: int) -> list[list[dict]]:
        """The batch trainer step `step` learns from: corrupted copies inside the planted stretch (the
        originals, with the task's reward, are what the loop records)."""
        if self.pc.corrupt is None or not self.pc.corrupt[0] <= step <= self.pc.corrupt[1]:
            return batch
        self.corrupted_steps.append(step)
        return [[{**s, "reward": corrupted(s, self.pc.corruption, self.noise)} for s in g] for g in batch]

    def step_done(self, version: int, state) -> None:
        """After trainer step `version` was published: promote (every N), roll back (when due), serve."""
        t = time.perf_counter()
        if version % self.pc.every == 0:
            self._promote(version, state)
        if self.pc.rollback is not None and version == self.pc.rollback[0]:
            self._rollback(version, self.pc.rollback[1])
        self._serve(version)
        self.seconds += time.perf_counter() - t

    # -- the gate -------------------------------------------------------------------------------

    def _check(self, engine) -> dict:
        """The gate's check, run by the hub once the evaluator holds the candidate's bytes."""
        got = heldout_reward(engine.model, self.heldout)
        floor = self.pc.gate if self.prod_reward is None else max(self.pc.gate, self.prod_reward - self.pc.margin)
        floor = round(floor, 6)  # 0.1 - 0.05 is 0.05000000000000001: compare at the rewards' own rounding
        return {"passed": got >= floor, "reward": got, "floor": floor, "gate": self.pc.gate,
                "margin": self.pc.margin, "prod_reward": self.prod_reward, "prompts": len(self.heldout)}

    def _measure(self, engine) -> dict:
        return {"passed": True, "reward": heldout_reward(engine.model, self.heldout), "baseline": True,
                "prompts": len(self.heldout)}

    def _promote(self, version: int, state) -> None:
        from wsync.channels import GateRefused

        head = self.hub.head("prod")
        self.prod_reward = None if head is None else self.scores.get(head.version)
        self.hub.offer(state, version)
        try:
            rec = self.hub.promote(version, why=f"trainer step {version}")
        except GateRefused as e:
            d = e.record.gate["detail"]
            held = self.hub.head("prod")
            self._say(f"step {version}: the gate refused version {version} (held-out reward {_r(d)} < floor "
                      f"{_r(d, 'floor')}); prod still serves version {None if held is None else held.version}")
            return
        self.scores[version] = rec.gate["detail"]["reward"]
        self._say(f"step {version}: version {version} promoted to prod (held-out reward {_r(rec.gate['detail'])} "
                  f">= floor {_r(rec.gate['detail'], 'floor')})")
        self._follow(rec, version)

    def _rollback(self, step: int, to: int | None) -> None:
        from wsync.channels import ChannelError

        before = self.hub.head("prod")
        try:
            rec = self.hub.rollback(to=to, why=f"manual rollback at trainer step {step}")
        except ChannelError as e:  # e.g. the version was refused by the gate: training goes on regardless
            self.events.append({"step": step, "kind": "rollback_failed", "to": to, "error": str(e)})
            self._say(f"step {step}: rollback to version {to} refused: {e}")
            return
        if rec is before:
            self.events.append({"step": step, "kind": "rollback_noop", "to": rec.version})
            self._say(f"step {step}: rollback to version {rec.version}: prod serves it already")
            return
        self._follow(rec, step)
        exact = self.events[-1]["exact"]
        self._say(f"step {step}: prod rolled back to version {rec.version} (release {rec.release}); the production "
                  f"engine holds its exact bytes: {'yes' if exact else 'NO'}")

    # -- the production engine ------------------------------------------------------------------

    def _follow(self, rec, step: int) -> None:
        """Let the production engine take `rec`'s release, and record what it then holds, as bytes."""
        from wsync.channels import report

        from .policy import state_digest

        self.prod.wait_for(rec.release, timeout=self.pc.timeout)
        held = self.engine.digest()
        self.events.append({"step": step, "kind": rec.kind, "version": rec.version, "release": rec.release,
                            "served": report(self.prod), "engine_digest": held, "record_digest": rec.digest,
                            "exact": held == rec.digest, "weights_digest": state_digest(self.engine.model)})

    def _serve(self, step: int) -> None:
        """Answer this step's requests with whatever prod serves, and log which version answered each."""
        from wsync.channels import report

        self.prod.poll()  # every change was waited for already; this only takes what may have come since
        if self.prod.version is None:
            self.unserved += self.pc.requests
            return
        now = report(self.prod)
        prompts = [sample_digits(self.cfg.task, self.requests_rng) for _ in range(self.pc.requests)]
        for d, a in zip(prompts, greedy(self.engine.model, prompts)):
            self.log.append({"id": len(self.log), "step": step, "prompt": "".join(map(str, d)),
                             "answer": Vocab.decode(a), "reward": reward(d, a), "version": now["version"],
                             "release": now["release"], "channel": now["channel"], "digest": now["digest"],
                             "since": now["since"]})

    # -- what the run reports -------------------------------------------------------------------

    def summary(self) -> dict:
        from wsync.channels import report

        recs = [asdict(r) for r in self.hub.records if r.channel == "prod"]
        head = self.hub.head("prod")
        by_version = Counter(e["version"] for e in self.log)
        return {
            "rule": RULE, "gate": self.pc.gate, "margin": self.pc.margin, "heldout_prompts": len(self.heldout),
            "records": recs,
            "promoted": [r["version"] for r in recs if r["kind"] == "promote"],
            "refused": [r["version"] for r in recs if r["kind"] == "refused"],
            "rollbacks": [e for e in self.events if e["kind"].startswith("rollback")],
            "corrupted_steps": self.corrupted_steps, "corruption": self.pc.corruption,
            "prod": None if head is None else {"version": head.version, "release": head.release,
                                               "digest": head.digest},
            "served": report(self.prod), "events": self.events,
            "requests": {"total": len(self.log), "unserved": self.unserved,
                         "by_version": {str(v): by_version[v] for v in sorted(by_version)},
                         "mean_reward": float(np.mean([e["reward"] for e in self.log])) if self.log else 0.0,
                         "log": self.log},
            "seconds": round(self.seconds, 4),
        }

    def _say(self, msg: str) -> None:
        if self.cfg.progress:  # on a terminal, clear the live progress line first (it is rewritten in place)
            print(("\r\033[K" if sys.stderr.isatty() else "") + f"promote: {msg}", file=sys.stderr, flush=True)

    def close(self) -> None:
        for part in (self.prod, self.hub):
            if part is not None:
                part.close()


def _r(detail: dict, key: str = "reward") -> str:
    v = detail.get(key) if isinstance(detail, dict) else None
    return "?" if v is None else f"{v:.3f}"


def one_line(p: dict) -> str:
    """The promotion part of the loop's closing line."""
    prod = p["prod"] or {}
    rb = ", ".join(f"rolled back to {e['version']} at step {e['step']}" for e in p["rollbacks"] if "version" in e)
    return (f"prod serves version {prod.get('version')} (release {prod.get('release')}); promoted {p['promoted']}, "
            f"refused by the gate {p['refused']}" + (f", {rb}" if rb else "") +
            f"; {p['requests']['total']} requests answered by versions {p['requests']['by_version']}")
