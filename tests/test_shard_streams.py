"""A rank's pieces as one stream (wsync/shard/streams.py): the rows of a box are the box's elements in C order, as
views (no copy); one multi-tensor copy-and-hash equals copying and hashing the pieces one by one, back to back."""
from __future__ import annotations

import numpy as np
import pytest

from wsync import backends
from wsync.shard import streams

torch = pytest.importorskip("torch")

BOXES = [  # (shape, box): whole, leading rows, a column band (a row per leading index), 3-D expert slices, empty
    ((6, 8), ((0, 6), (0, 8))), ((6, 8), ((2, 5), (0, 8))), ((6, 8), ((1, 5), (3, 7))),
    ((5, 6, 4), ((3, 5), (0, 6), (0, 4))), ((5, 6, 4), ((0, 3), (2, 5), (0, 4))), ((5, 6, 4), ((1, 4), (2, 5), (1, 3))),
    ((7,), ((2, 6),)), ((6, 8), ((2, 2), (0, 8))),
]


@pytest.mark.parametrize("shape,box", BOXES)
def test_rows_are_views_of_the_box_in_c_order(shape, box):
    t = torch.arange(int(np.prod(shape)), dtype=torch.int16).view(torch.bfloat16).reshape(shape)
    arr = streams.bits_view(t)
    got = streams.rows(arr, box)
    want = arr[tuple(slice(a, b) for a, b in box)].reshape(-1)
    assert np.array_equal(np.concatenate(got) if got else np.empty(0, arr.dtype), want)
    assert all(np.shares_memory(r, arr) and r.flags.c_contiguous for r in got)


def test_strided_or_foreign_tensors_have_no_rows():
    t = torch.zeros(6, 8, dtype=torch.bfloat16)
    assert streams.bits_view(t.t()) is None  # not contiguous: the caller copies per piece
    arr = streams.bits_view(t).T  # innermost dimension strided
    assert streams.rows(arr, ((0, 8), (0, 3))) is None


def test_one_copy_and_hash_equals_piece_by_piece():
    kernels = backends.kernels(None)
    g = torch.Generator().manual_seed(0)
    local = {"a": torch.randn(10, 12, generator=g).to(torch.bfloat16), "b": torch.randn(4, 6, 5, generator=g)}
    boxes = [("a", ((0, 10), (3, 9))), ("b", ((1, 3), (0, 6), (0, 5))), ("a", ((4, 6), (0, 12))),
             ("b", ((0, 4), (2, 4), (1, 4)))]
    views = {n: streams.bits_view(t) for n, t in local.items()}
    bufs = [torch.empty([b - a for a, b in box], dtype=local[n].dtype) for n, box in boxes]
    src = streams.tables((views[n], box) for n, box in boxes)
    dst = streams.tables((streams.bits_view(b), tuple((0, d) for d in b.shape)) for b in bufs)
    sums = streams.copy_sums(kernels, src, dst)
    for (n, box), buf in zip(boxes, bufs):
        assert torch.equal(buf, local[n][tuple(slice(a, b) for a, b in box)])
    for dt, want in (("<u2", [0, 2]), ("<u4", [1, 3])):  # each dtype's pieces back to back, hashed once
        cat = np.concatenate([streams.bits_view(bufs[i]).reshape(-1) for i in want])
        assert sums[streams.STREAM + dt] == kernels.checksum(cat)
    assert streams.sums(kernels, dst) == sums
