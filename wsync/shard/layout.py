"""Sharded layouts as data: which slice of which parameter each rank holds, or needs.

A trainer rank *holds* boxes of the trainer's parameters (its local tensor of
parameter `name` is ``global[box]``); an engine rank *needs* boxes of them,
each written into a box of one of its own local tensors, under the engine's
names (fused q/k/v, gate/up, vocab padding: see conventions.py). A box is a
tuple of half-open ``(start, stop)`` ranges, one per dimension. Every slice the
usual conventions make (Shard(d) of FSDP2 and TP, column and row parallel,
fused projections split per rank, experts by index) is a box, so routing is
box intersection and nothing here ever looks at a tensor's values.

These types are the contract between the layout builders, the routing plan
(route.py) and the point-to-point sync (sync.py); they are plain frozen data,
hashable, and printable.
"""
from __future__ import annotations

from dataclasses import dataclass

Box = tuple[tuple[int, int], ...]  # per dimension [start, stop)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def box_numel(box: Box) -> int:
    n = 1
    for a, b in box:
        n *= max(0, b - a)
    return n


def full_box(shape) -> Box:
    return tuple((0, int(d)) for d in shape)


def intersect(x: Box, y: Box) -> Box | None:
    """The common box of x and y, or None if it is empty."""
    out = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(x, y, strict=True))
    return out if all(a < b for a, b in out) else None


def shift(box: Box, frm: Box, to: Box) -> Box:
    """`box` (inside `frm`) moved to the same place inside `to` (frm and to have the same shape)."""
    return tuple((a - f0 + t0, b - f0 + t0) for (a, b), (f0, _), (t0, _) in zip(box, frm, to, strict=True))


def same_elements(x: Box, y: Box) -> bool:
    """Whether boxes x and y hold as many elements in the same C order: equal shapes once dimensions of size 1
    are dropped (a 2-D expert weight copied into one slot of a 3-D fused expert tensor)."""
    return [n for n in box_shape(x) if n != 1] == [n for n in box_shape(y) if n != 1]


def map_box(box: Box, frm: Box, to: Box) -> Box:
    """`box` (inside `frm`) moved to the same elements inside `to`, where frm and to hold the same elements
    (same_elements): `shift` when they have the same shape, else matched dimension by dimension past the
    dimensions of size 1, which `box` cannot cut."""
    if box_shape(frm) == box_shape(to):
        return shift(box, frm, to)
    out = list(to)
    src = [i for i, (a, b) in enumerate(frm) if b - a != 1]
    dst = [j for j, (a, b) in enumerate(to) if b - a != 1]
    for i, j in zip(src, dst, strict=True):
        out[j] = (box[i][0] - frm[i][0] + to[j][0], box[i][1] - frm[i][0] + to[j][0])
    return tuple(out)


def check_box(box: Box, shape, what: str) -> None:
    if len(box) != len(shape) or any(not (0 <= a <= b <= d) for (a, b), d in zip(box, shape)):
        raise ValueError(f"{what}: box {box} does not lie in shape {tuple(shape)}")


@dataclass(frozen=True)
class Param:
    """One parameter: its global shape and dtype (a torch dtype name such as 'bfloat16')."""

    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Held:
    """Trainer rank `rank` holds box `box` of parameter `name` as its local tensor (a C-contiguous copy of global[box])."""

    rank: int
    name: str
    box: Box


@dataclass(frozen=True)
class Need:
    """Engine rank `rank` needs global box `src` of trainer parameter `src_name`, written at box `dst` of its local
    tensor `name` (src and dst have the same shape, up to dimensions of size 1: see same_elements)."""

    rank: int
    name: str
    dst: Box
    src_name: str
    src: Box


@dataclass(frozen=True)
class TrainerLayout:
    ranks: int
    params: dict[str, Param]
    held: tuple[Held, ...]

    def check(self) -> None:
        for h in self.held:
            if not 0 <= h.rank < self.ranks or h.name not in self.params:
                raise ValueError(f"trainer layout: {h} names a rank or parameter it does not have")
            check_box(h.box, self.params[h.name].shape, f"trainer rank {h.rank} {h.name}")


@dataclass(frozen=True)
class EngineLayout:
    ranks: int
    # (engine rank, engine name) -> the local tensor's shape and dtype
    locals: dict[tuple[int, str], Param]
    needs: tuple[Need, ...]

    def check(self, trainer: TrainerLayout) -> None:
        for n in self.needs:
            local = self.locals.get((n.rank, n.name))
            src = trainer.params.get(n.src_name)
            if local is None or src is None:
                raise ValueError(f"engine layout: {n} names a tensor neither side declares")
            if not same_elements(n.dst, n.src):
                raise ValueError(f"engine layout: {n} copies a box into one of another shape")
            check_box(n.dst, local.shape, f"engine rank {n.rank} {n.name}")
            check_box(n.src, src.shape, f"engine rank {n.rank} {n.name} <- {n.src_name}")
            if local.dtype != src.dtype:
                raise ValueError(f"engine layout: {n.name} is {local.dtype} but {n.src_name} is {src.dtype}")


@dataclass(frozen=True)
class Piece:
    """One transfer of the routing plan: trainer rank `src_rank` sends global box `src` of `src_name` (read from its
    local tensor at `local`, the same box relative to what it holds) to engine rank `dst_rank`, which writes it at box
    `dst` of its local tensor `dst_name`."""

    src_rank: int
    src_name: str
    src: Box
    local: Box
    dst_rank: int
    dst_name: str
    dst: Box

    @property
    def key(self) -> str:
        """A name for the piece, unique in its plan, stable across versions (the sync's tensor name)."""
        lo = ",".join(f"{a}:{b}" for a, b in self.dst)
        return f"{self.dst_name}[{lo}]"

    def numel(self) -> int:
        return box_numel(self.src)
