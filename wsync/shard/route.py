"""The routing plan: which trainer rank sends which slice of which parameter to which engine rank.

A pure function of the two layouts, so every trainer and engine rank computes
the same plan on its own (its hash is checked when they meet) and nothing is
decided per version. Each engine need is cut along the boxes the trainer ranks
hold; a slice several trainer ranks hold (replicated norms, data-parallel
replicas of FSDP shards) goes to the sender with the fewest bytes so far,
largest slices first, so no trainer rank sends much more than its share.
Nothing is gathered: every piece is a box of one sender's own local tensor.
"""
from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property

import xxhash

from ..dtypes import from_torch
from .layout import Box, EngineLayout, Piece, TrainerLayout, box_numel, box_shape, intersect

_CACHE: OrderedDict[tuple[str, str], Plan] = OrderedDict()
_CACHE_SIZE = 8


def _digest(lines) -> str:
    """xxh3-128 of canonical text: one line per record, records sorted, so order of construction never matters."""
    h = xxhash.xxh3_128()
    for line in sorted(lines):
        h.update(line.encode())
        h.update(b"\n")
    return h.hexdigest()


def trainer_digest(t: TrainerLayout) -> str:
    """A stable digest of a trainer layout's content (its parameters and every held box)."""
    return _digest([f"ranks {t.ranks}"] + [f"param {n} {list(p.shape)} {p.dtype}" for n, p in t.params.items()]
                   + [f"held {h.rank} {h.name} {h.box}" for h in t.held])


def engine_digest(e: EngineLayout) -> str:
    """A stable digest of an engine layout's content (its local tensors and every need)."""
    return _digest([f"ranks {e.ranks}"] + [f"local {r} {n} {list(p.shape)} {p.dtype}" for (r, n), p in e.locals.items()]
                   + [f"need {x.rank} {x.name} {x.dst} {x.src_name} {x.src}" for x in e.needs])


@dataclass(frozen=True)
class Plan:
    """The pieces of one (trainer layout, engine layout) pair, sorted by (engine rank, engine tensor, its box,
    trainer rank)."""

    trainer: TrainerLayout
    engine: EngineLayout
    pieces: tuple[Piece, ...]
    hash: str = field(default="", compare=False)  # hex digest of the layouts and the pieces

    def for_trainer(self, rank: int) -> tuple[Piece, ...]:
        """What trainer rank `rank` sends, sorted by (engine rank, key)."""
        return self._by_src.get(rank, ())

    def for_engine(self, rank: int) -> tuple[Piece, ...]:
        """What engine rank `rank` receives, sorted by (key, trainer rank)."""
        return self._by_dst.get(rank, ())

    def sends(self, rank: int) -> dict[int, tuple[Piece, ...]]:
        """Trainer rank `rank`'s pieces per engine rank it sends to."""
        out: dict[int, list[Piece]] = {}
        for p in self.for_trainer(rank):
            out.setdefault(p.dst_rank, []).append(p)
        return {r: tuple(ps) for r, ps in out.items()}

    def piece_bytes(self, p: Piece) -> int:
        return p.numel() * from_torch(self.trainer.params[p.src_name].dtype).itemsize

    def bytes_by_trainer(self) -> list[int]:
        out = [0] * self.trainer.ranks
        for p in self.pieces:
            out[p.src_rank] += self.piece_bytes(p)
        return out

    def bytes_by_engine(self) -> list[int]:
        out = [0] * self.engine.ranks
        for p in self.pieces:
            out[p.dst_rank] += self.piece_bytes(p)
        return out

    @cached_property
    def _by_src(self) -> dict[int, tuple[Piece, ...]]:
        out: dict[int, list[Piece]] = {}
        for p in self.pieces:
            out.setdefault(p.src_rank, []).append(p)
        return {r: tuple(sorted(ps, key=lambda p: (p.dst_rank, p.key))) for r, ps in out.items()}

    @cached_property
    def _by_dst(self) -> dict[int, tuple[Piece, ...]]:
        out: dict[int, list[Piece]] = {}
        for p in self.pieces:
            out.setdefault(p.dst_rank, []).append(p)
        return {r: tuple(sorted(ps, key=lambda p: (p.key, p.src_rank))) for r, ps in out.items()}

    def describe(self, max_rows: int = 16) -> str:
        """Per-rank bytes on both sides, the busiest rank and its bytes against the ideal total / min(M, N)."""
        t, e = self.bytes_by_trainer(), self.bytes_by_engine()
        total, m, n = sum(t), self.trainer.ranks, self.engine.ranks
        ideal = total / min(m, n) if total else 0.0
        lines = [f"route plan {self.hash[:16]}: {m} trainer ranks -> {n} engine ranks, {len(self.pieces):,} pieces, "
                 f"{total / 1e9:.4g} GB (GB = 1e9 bytes)"]
        for side, sizes, count, peers in (("trainer", t, self._by_src, "dst_rank"), ("engine", e, self._by_dst,
                                                                                      "src_rank")):
            lines.append(f"{side:>8} rank  {'GB':>10}  {'x ideal':>7}  {'pieces':>7}  {'peers':>5}")
            ranks = range(len(sizes))
            if len(sizes) > max_rows:  # the busiest and the idlest, in rank order
                order = sorted(ranks, key=lambda r: (-sizes[r], r))
                ranks = sorted(order[: max_rows // 2] + order[-(max_rows // 2):])
            for r in ranks:
                ps = count.get(r, ())
                lines.append(f"{'':>8} {r:>4}  {sizes[r] / 1e9:>10.4g}  {sizes[r] / ideal if ideal else 0:>7.3f}  "
                             f"{len(ps):>7,}  {len({getattr(p, peers) for p in ps}):>5}")
            if len(sizes) > max_rows:
                lines.append(f"{'':>8} ({len(sizes) - len(ranks)} ranks between not shown)")
        side, r, b = max([("trainer", r, x) for r, x in enumerate(t)] + [("engine", r, x) for r, x in enumerate(e)],
                         key=lambda s: (s[2], s[0] == "engine", -s[1]))
        lines.append(f"busiest: {side} rank {r}, {b / 1e9:.4g} GB = {b / ideal if ideal else 0:.3f}x the ideal "
                     f"{ideal / 1e9:.4g} GB (total / min(M, N) = {total / 1e9:.4g} / {min(m, n)})")
        return "\n".join(lines)


class _Holders:
    """The distinct boxes trainer ranks hold of one parameter, indexed along one dimension for lookup."""

    def __init__(self, boxes: dict[Box, list[int]]):
        self.boxes = sorted(boxes)
        self.ranks = [tuple(sorted(boxes[b])) for b in self.boxes]
        ndim = len(self.boxes[0]) if self.boxes else 0
        self.dim = max(range(ndim), key=lambda d: len({b[d] for b in self.boxes}), default=None)
        self.stops = None
        if self.dim is not None:
            order = sorted(range(len(self.boxes)), key=lambda i: self.boxes[i][self.dim])
            self.boxes, self.ranks = [self.boxes[i] for i in order], [self.ranks[i] for i in order]
            self.starts = [b[self.dim][0] for b in self.boxes]
            stops = [b[self.dim][1] for b in self.boxes]
            if all(s <= a for s, a in zip(stops, self.starts[1:])):
                self.stops = stops  # disjoint along dim (FSDP, TP): both ends bisect, and no box overlaps another
        self.disjoint = self.stops is not None or len(self.boxes) <= 1

    def overlapping(self, box: Box) -> range:
        if self.dim is None:
            return range(len(self.boxes))
        lo, hi = box[self.dim]
        end = bisect.bisect_left(self.starts, hi)
        start = bisect.bisect_right(self.stops, lo) if self.stops is not None else 0
        return range(start, end)


def _inside(x: Box, y: Box) -> bool:
    return all(c <= a and b <= d for (a, b), (c, d) in zip(x, y))


def _subtract(r: Box, x: Box) -> list[Box]:
    """r minus x (x inside r) as disjoint boxes."""
    out, cur = [], list(r)
    for d, ((a, b), (c, e)) in enumerate(zip(r, x)):
        if a < c:
            out.append(tuple(cur[:d]) + ((a, c),) + r[d + 1:])
        if e < b:
            out.append(tuple(cur[:d]) + ((e, b),) + r[d + 1:])
        cur[d] = (c, e)
    return out


def _dims(src: Box, dst: Box) -> list[tuple[int, int, int]]:
    """(src dim, dst dim, offset) pairs that move a box inside src to the same elements inside dst (layout.map_box,
    worked out once per need rather than per piece)."""
    if box_shape(src) == box_shape(dst):
        return [(d, d, b[0] - a[0]) for d, (a, b) in enumerate(zip(src, dst))]
    si = [i for i, (a, b) in enumerate(src) if b - a != 1]
    dj = [j for j, (a, b) in enumerate(dst) if b - a != 1]
    return [(i, j, dst[j][0] - src[i][0]) for i, j in zip(si, dj, strict=True)]


def _cut(need_src: Box, h: _Holders, what: str) -> list[tuple[Box, tuple[int, ...]]]:
    """need_src cut into disjoint boxes, each with the indices of the held boxes that contain all of it."""
    cands = [(i, x) for i in h.overlapping(need_src) if (x := intersect(need_src, h.boxes[i])) is not None]
    if h.disjoint and sum(box_numel(x) for _, x in cands) == box_numel(need_src):
        return [(x, (i,)) for i, x in cands]  # the usual case: one holder box per slice
    remaining, out = [need_src], []
    for i, _ in cands:
        nxt = []
        for r in remaining:
            x = intersect(r, h.boxes[i])
            if x is None:
                nxt.append(r)
                continue
            out.append((x, tuple(j for j, _ in cands if j == i or _inside(x, h.boxes[j]))))
            nxt.extend(_subtract(r, x))
        remaining = nxt
    if remaining:
        raise ValueError(f"{what}: no trainer rank holds box {remaining[0]} of it (uncovered: {remaining[:3]})")
    return out


def _route(trainer: TrainerLayout, engine: EngineLayout) -> tuple[Piece, ...]:
    trainer.check()
    engine.check(trainer)
    grouped: dict[str, dict[Box, list[int]]] = {}
    for x in trainer.held:
        if box_numel(x.box):
            grouped.setdefault(x.name, {}).setdefault(x.box, []).append(x.rank)
    holders = {n: _Holders(b) for n, b in grouped.items()}
    size = {n: from_torch(p.dtype).itemsize for n, p in trainer.params.items()}
    empty = _Holders({})
    load, forced, choose = [0] * trainer.ranks, [], []
    for need in sorted(engine.needs, key=lambda x: (x.rank, x.name, x.dst, x.src_name, x.src)):
        h = holders.get(need.src_name, empty)
        for x, owners in _cut(need.src, h, f"engine rank {need.rank} {need.name} <- {need.src_name}"):
            ranks = h.ranks[owners[0]] if len(owners) == 1 else tuple(sorted({k for j in owners for k in h.ranks[j]}))
            item = (box_numel(x) * size[need.src_name], need, x, ranks, h, owners)
            if len(ranks) == 1:
                load[ranks[0]] += item[0]
                forced.append((ranks[0], item))
            else:
                choose.append(item)
    # several holders: the least-loaded one, largest slices first, ties by engine rank, name, box, then trainer rank
    choose.sort(key=lambda it: (-it[0], it[1].rank, it[1].name, it[2]))
    picked = []
    for item in choose:
        r = min(item[3], key=lambda k: (load[k], k))
        load[r] += item[0]
        picked.append((r, item))
    pieces, dims = [], {}
    for r, (_, need, x, _, h, owners) in forced + picked:
        held = h.boxes[owners[0]] if len(owners) == 1 else next(h.boxes[j] for j in owners if r in h.ranks[j])
        if (m := dims.get(id(need))) is None:
            m = dims[id(need)] = _dims(need.src, need.dst)
        dst = list(need.dst)
        for i, j, off in m:
            dst[j] = (x[i][0] + off, x[i][1] + off)
        pieces.append(Piece(src_rank=r, src_name=need.src_name, src=x,
                            local=tuple((a - h0, b - h0) for (a, b), (h0, _) in zip(x, held)),
                            dst_rank=need.rank, dst_name=need.name, dst=tuple(dst)))
    pieces.sort(key=lambda p: (p.dst_rank, p.dst_name, p.dst, p.src_rank))
    return tuple(pieces)


def route(trainer: TrainerLayout, engine: EngineLayout) -> Plan:
    """The plan of a layout pair: deterministic, balanced, every need covered (else ValueError), memoized."""
    key = (trainer_digest(trainer), engine_digest(engine))
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    pieces = _route(trainer, engine)
    plan = Plan(trainer, engine, pieces, _digest([f"trainer {key[0]}", f"engine {key[1]}"] + [
        f"piece {p.dst_rank} {p.dst_name} {p.dst} {p.src_rank} {p.src_name} {p.src} {p.local}" for p in pieces]))
    _CACHE[key] = plan
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return plan
