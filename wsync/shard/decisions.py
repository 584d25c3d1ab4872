"""The coordinator's decisions on disk: what a coordinator started again on the same state dir tells the ranks.

Two-phase commit blocks when the coordinator dies between its commit messages:
the ranks told *commit* serve version v, the others hold v staged and voted
ready, and only the decision can settle them. So a coordinator given a state
dir writes each decision here (atomically, fsynced) *before* it tells any rank,
and one started again on that dir answers a rank that asks about v from this
file, even if no trainer rank publishes again.

One small JSON file per plan, the newest ``KEEP`` decisions, each with the
partial digests the trainer ranks announced (so a rank that reports late is
still checked against them). A state dir belongs to one run: versions only
grow within it.
"""
from __future__ import annotations

import json
from pathlib import Path

from .. import safejson
from ..errors import FormatError, WsyncError
from ..fsutil import atomic_write, plain_name

KEEP = 16  # decisions kept: a rank only ever asks about the newest round it voted in
FORMAT = 1
MAX_BYTES = 4 << 20


class DecisionLog:
    """decisions-<plan hash>.json in state_dir: version -> {"outcome", "reason", "keyframe", "expected"}."""

    def __init__(self, state_dir, plan_hash: str):
        self.path = Path(state_dir) / plain_name(f"decisions-{plan_hash}.json", "decision log name")
        self.plan_hash = plan_hash
        self.decisions: dict[int, dict] = {}

    def load(self) -> dict[int, dict]:
        """What the file holds (nothing if there is no file yet); a file that does not parse is an error, never
        read as "no decisions": that would let a restarted coordinator run a decided round again."""
        if not self.path.exists():
            return {}
        try:
            doc = safejson.loads(self.path.read_bytes(), what=str(self.path), max_bytes=MAX_BYTES)
            if doc.get("format") != FORMAT or doc.get("plan") != self.plan_hash:
                raise FormatError(f"format {doc.get('format')!r:.20}, plan {doc.get('plan')!r:.40}; expected "
                                  f"format {FORMAT}, plan {self.plan_hash}")
            self.decisions = {_version(d): _decision(d) for d in doc["decisions"]}
        except (WsyncError, KeyError, TypeError, AttributeError, ValueError) as e:
            raise FormatError(f"the coordinator's decision log {self.path} cannot be read ({e}); move it away "
                              f"to start with no record of earlier rounds") from None
        return dict(self.decisions)

    def record(self, version: int, decision: dict) -> None:
        """Durable before it returns (fsynced, renamed over the old file, the folder fsynced)."""
        self.decisions[version] = decision
        for v in sorted(self.decisions)[:-KEEP]:
            del self.decisions[v]
        body = {"format": FORMAT, "plan": self.plan_hash,
                "decisions": [{"version": v, **d} for v, d in sorted(self.decisions.items())]}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(self.path) as f:
            f.write(json.dumps(body, sort_keys=True).encode())


def _version(d: dict) -> int:
    v = d["version"]
    if type(v) is not int or v < 0:
        raise ValueError(f"version {v!r:.20}")
    return v


def _decision(d: dict) -> dict:
    if d["outcome"] not in ("committed", "aborted") or not isinstance(d["reason"], str):
        raise ValueError(f"outcome {d['outcome']!r:.20}")
    keyframe = {int(r): [int(s) for s in srcs] for r, srcs in d["keyframe"].items()}
    expected = {int(r): {int(s): (None if x is None else str(x)) for s, x in parts.items()}
                for r, parts in d["expected"].items()}
    return {"outcome": d["outcome"], "reason": d["reason"], "keyframe": keyframe, "expected": expected}
