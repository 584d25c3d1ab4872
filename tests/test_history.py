"""Version chains and catch-up planning (pure functions, tested as tables)."""
import numpy as np
import pytest

from wsync.history import EncodedVersion, History, catch_up_versions, keyframe_due
from wsync.snapshot import as_state, plan_buckets


@pytest.mark.parametrize("have,newest,kf,deltas,expect", [
    (None, 5, 3, {4, 5}, (3, [4, 5])),  # nothing held: keyframe then the deltas after it
    (5, 5, 3, {4, 5}, (None, [])),  # up to date
    (4, 5, 3, {4, 5}, (None, [5])),  # one behind
    (2, 5, 3, {3, 4, 5}, (None, [3, 4, 5])),  # behind the keyframe, but the delta into it is kept
    (1, 5, 3, {3, 4, 5}, (3, [4, 5])),  # too far behind: keyframe
    (7, 5, 3, {4, 5}, (3, [4, 5])),  # claims a future version (publisher restarted): keyframe
    (3, 3, 3, set(), (None, [])),
])
def test_catchup(have, newest, kf, deltas, expect):
    assert catch_up_versions(have, newest, kf, deltas) == expect


@pytest.mark.parametrize("index,since,every,due", [
    (0, 0, 50, True), (1, 1, 50, False), (50, 50, 50, True), (49, 49, 50, False), (7, 7, 0, False), (0, 0, 0, True),
])
def test_keyframe_due(index, since, every, due):
    assert keyframe_due(index, since, every) is due


@pytest.mark.parametrize("sizes,cap,expect", [
    ([("a", 10), ("b", 10), ("c", 30), ("d", 1)], 20, [["a", "b"], ["c"], ["d"]]),
    ([("a", 5)], 1, [["a"]]),
    ([], 8, []),
    ([("a", 4), ("b", 4), ("c", 4)], 8, [["a", "b"], ["c"]]),
])
def test_plan_buckets(sizes, cap, expect):
    assert plan_buckets(sizes, cap) == expect


def test_plan_buckets_rejects_zero():
    with pytest.raises(ValueError, match="positive"):
        plan_buckets([("a", 1)], 0)


def _enc(v, base):
    return EncodedVersion(v, base, f"c{v}", 1)


def test_history_stays_bounded_and_checks_what_a_subscriber_holds():
    h = History()
    state = as_state({"w": np.zeros(4, np.float32)})
    h.add_keyframe(0, state, "c0", None)
    for v in range(1, 120):
        if v % 10 == 0:
            h.add_keyframe(v, state, f"c{v}", _enc(v, v - 1))
        else:
            h.add_delta(_enc(v, v - 1))
        assert len(h.deltas) <= 20 and len(h.checksums) <= 21
    kf, deltas = h.catch_up(115, "c115")
    assert kf is None and [d.version for d in deltas] == [116, 117, 118, 119]
    kf, deltas = h.catch_up(115, "not-what-we-sent")  # same number, other contents: start over
    assert kf.version == 110 and [d.version for d in deltas] == list(range(111, 120))
    kf, deltas = h.catch_up(103, "c103")  # behind the keyframe: the deltas since the one before are kept
    assert kf is None and [d.version for d in deltas] == list(range(104, 120))
    kf, _ = h.catch_up(99, "c99")  # older than that: keyframe
    assert kf.version == 110
