"""One round of the commit: what the trainer ranks announced for a version, and what each engine rank reported.

Kept apart from the coordinator's links and threads (commit.py) because it is
the part worth reading: the digests (defined once, here) and the comparison
that decides commit or abort.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import xxhash


def _fold(pairs) -> str:
    h = xxhash.xxh3_64()
    for k, v in sorted(pairs):
        h.update(f"{k}\0{v}\n".encode())
    return h.hexdigest()


def partial_digest(sums: dict[str, str]) -> str:
    """One (trainer rank, engine rank) pair's pieces: the checksum of each bits dtype's stream of them
    (streams.STREAM + dtype -> checksum; see streams.py)."""
    return _fold(sums.items())


def rank_digest(partials: dict[int, str]) -> str:
    """An engine rank's version: its partials, by trainer rank."""
    return _fold(partials.items())


def engine_digest(ranks: dict[int, str]) -> str:
    """The engine's version: its ranks' digests, by engine rank."""
    return _fold(ranks.items())


@dataclass
class Round:
    version: int
    # engine rank -> trainer rank -> the partial digest that trainer rank announced (None: it announced none)
    expected: dict[int, dict[int, str | None]]
    deadline: float  # time.monotonic() by which the current phase must finish
    phase: str = "prepare"  # "prepare": collecting ready; "commit": decided, collecting committed
    ready: dict[int, dict[int, str]] = field(default_factory=dict)  # engine rank -> its staged partials
    committed: dict[int, dict[int, str]] = field(default_factory=dict)  # engine rank -> its live partials
    lost: set[int] = field(default_factory=set)  # engine ranks whose link dropped after the decision
    outcome: str | None = None  # "committed" | "aborted" once decided: what a rank that asks is told
    reason: str = ""
    keyframe: dict[int, list[int]] = field(default_factory=dict)  # aborted: engine rank -> sources to re-key
    # engine ranks known to serve this version or a newer one (a committed round is complete once all do)
    confirmed: set[int] = field(default_factory=set)
    doc: dict | None = None  # its entry in the coordinator's settled list, updated as late ranks confirm

    def all_reported(self, ranks: int) -> bool:
        return len(set(self.committed) | self.lost) == ranks

    def unconfirmed(self, ranks: int) -> list[int]:
        """Engine ranks not yet known to serve the committed version (or a newer one): [] for an abort, which
        every rank obeys by doing nothing."""
        return [] if self.outcome != "committed" else sorted(set(range(ranks)) - self.confirmed)

    def decision(self) -> dict:
        """What the decision log keeps of this round (decisions.py)."""
        return {"outcome": self.outcome, "reason": self.reason, "keyframe": self.keyframe,
                "expected": self.expected}

    def wrong(self, reports: dict[int, dict[int, str]]) -> dict[int, list[int]]:
        """For each reporting engine rank whose partials differ from the announced ones: the trainer ranks
        whose pieces differ (a partial missing on either side counts as different)."""
        out = {}
        for r, got in reports.items():
            want = self.expected.get(r, {})
            bad = sorted(s for s in set(want) | set(got) if want.get(s) is None or got.get(s) != want.get(s))
            if bad:
                out[r] = bad
        return out

    def describe(self, wrong: dict[int, list[int]]) -> str:
        return "; ".join(f"engine rank {r} from trainer ranks {srcs}" for r, srcs in sorted(wrong.items()))

    def engine_digest(self) -> str | None:
        """The engine digest the trainer ranks' announcements imply (None if one is missing)."""
        if any(d is None for parts in self.expected.values() for d in parts.values()):
            return None
        return engine_digest({r: rank_digest(parts) for r, parts in self.expected.items()})
