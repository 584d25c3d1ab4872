"""Peers must round-trip bit-exactly, or their sizes mean nothing; the bound must be the formula."""
import math

import numpy as np
import pytest

from wsync_bench.peers import (PEERS, Peer, check_pair, entropy_bound_bits, monotone_key, run_peer,
                               states_equal, synthetic_rl_step)
from wsync.errors import FormatError, MismatchError, WsyncError


def key_inverse(keys: np.ndarray) -> np.ndarray:
    sign = keys.dtype.type(1 << (8 * keys.itemsize - 1))
    return np.where(keys & sign, keys & ~sign, ~keys)


# Special bf16 patterns and one change of each that the codec must carry exactly:
# -0 -> +0 and +tiny -> -tiny cross the sign, NaN payloads and infinities move too.
SPECIAL_CHANGES = [
    (0x8000, 0x0000),  # -0.0 -> +0.0 (one key step up)
    (0x0001, 0x8001),  # smallest +subnormal -> smallest -subnormal (two steps down)
    (0x7FC0, 0x7FC1),  # NaN payload change
    (0xFF80, 0xFF7F),  # -inf -> most negative finite
    (0x7F7F, 0x7F80),  # largest finite -> +inf
]
SPECIAL_STILL = [0x7FC0, 0xFFC0, 0x7F80, 0xFF80, 0x8000, 0x0000]


def bf16_state(n=40_000, density=0.01, seed=0):
    rng = np.random.default_rng(seed)
    floats = rng.normal(0.0, 0.02, n).astype(np.float32)
    base = (floats.view(np.uint32) >> 16).astype(np.uint16)
    keys = monotone_key(base)
    moved = rng.random(n) < density
    steps = rng.choice(np.array([-2, -1, 1, 2], np.int32), n)
    new_keys = np.where(moved, (keys.astype(np.int32) + steps).astype(np.uint16), keys)
    new = key_inverse(new_keys)
    old_sp, new_sp = (np.array(x, np.uint16) for x in zip(*SPECIAL_CHANGES))
    still = np.array(SPECIAL_STILL, np.uint16)
    b = {"w": base, "special": np.concatenate([old_sp, still]), "small": base[:7].copy()}
    m = {"w": new, "special": np.concatenate([new_sp, still]), "small": base[:7].copy()}
    return b, m


def mixed_state(seed=1):
    """fp32 and fp8 patterns next to bf16, each with a few changes."""
    rng = np.random.default_rng(seed)
    b32 = rng.integers(0, 2**32, 5000, dtype=np.uint32)
    b8 = rng.integers(0, 256, 3000, dtype=np.uint8)
    n32, n8 = b32.copy(), b8.copy()
    n32[::97] ^= 1
    n8[::53] ^= 3
    b, n = bf16_state(n=5000, seed=seed)
    return {**b, "fp32": b32, "fp8": b8}, {**n, "fp32": n32, "fp8": n8}


def edge_state():
    e = np.zeros(0, np.uint16)
    return ({"empty": e, "one": np.array([0x3F80], np.uint16), "empty32": np.zeros(0, np.uint32)},
            {"empty": e.copy(), "one": np.array([0x3F81], np.uint16), "empty32": np.zeros(0, np.uint32)})


@pytest.fixture(params=sorted(PEERS))
def peer(request) -> Peer:
    p = PEERS[request.param]
    if not p.available():
        pytest.skip(f"{p.name} unavailable: {p.why_unavailable}")
    return p


def roundtrip(peer, base, new):
    snapshot = {k: v.copy() for k, v in base.items()}, {k: v.copy() for k, v in new.items()}
    blob = peer.encode(base, new)
    assert isinstance(blob, bytes)
    out = peer.decode(base, blob)
    assert out.keys() == new.keys()
    for k in new:
        assert out[k].dtype == new[k].dtype, k
        assert np.array_equal(out[k], new[k]), k
    # Neither encode nor decode may touch the caller's arrays (zipnn's core works in place).
    assert states_equal(base, snapshot[0]) and states_equal(new, snapshot[1])
    return blob


def test_roundtrip_sparse_bf16_with_specials(peer):
    base, new = bf16_state()
    assert np.count_nonzero(base["special"] != new["special"]) == len(SPECIAL_CHANGES)
    roundtrip(peer, base, new)


def test_roundtrip_mixed_widths(peer):
    roundtrip(peer, *mixed_state())


def test_roundtrip_unchanged(peer):
    base, _ = bf16_state()
    blob = roundtrip(peer, base, {k: v.copy() for k, v in base.items()})
    if peer.name != "raw":
        assert len(blob) < sum(v.nbytes for v in base.values()) // 20


def test_roundtrip_empty_and_single(peer):
    roundtrip(peer, *edge_state())


def test_roundtrip_synthetic_rl_step(peer):
    base, new = synthetic_rl_step(n=1 << 16, seed=3)
    roundtrip(peer, base, new)


def test_truncated_or_foreign_blob_is_a_format_error(peer):
    base, new = bf16_state(n=4000)
    blob = peer.encode(base, new)
    with pytest.raises(FormatError):
        peer.decode(base, blob[: len(blob) // 2])
    with pytest.raises(FormatError):
        peer.decode(base, b"NOPE" + blob[4:])


def test_blob_made_for_other_tensors_is_refused(peer):
    base, new = bf16_state(n=4000)
    blob = peer.encode(base, new)
    with pytest.raises(WsyncError):
        peer.decode({"w": base["w"]}, blob)


def test_mismatched_states_are_refused():
    base, new = bf16_state(n=100)
    with pytest.raises(MismatchError):
        check_pair(base, {**new, "extra": new["w"]})
    with pytest.raises(MismatchError):
        check_pair(base, {**new, "w": new["w"].astype(np.uint32)})
    with pytest.raises(MismatchError):
        check_pair({"f": np.zeros(3, np.float32)}, {"f": np.zeros(3, np.float32)})


def test_pulse_downscales_gap_width():
    base = {"w": np.zeros(100_000, np.uint16)}
    new = {"w": base["w"].copy()}
    new["w"][::400] = 1  # gaps of 400 need 16 bits, not 32
    # Incompressible values keep zstd from hiding the index width.
    new["w"][::400] = np.random.default_rng(0).integers(1, 2**16, new["w"][::400].size, dtype=np.uint16)
    assert len(PEERS["pulse"].encode(base, new)) < len(PEERS["pulse_v2"].encode(base, new))


def test_monotone_key_bf16_order():
    bits = np.arange(2**16, dtype=np.uint16)
    keys = monotone_key(bits)
    assert keys.dtype == np.uint16
    assert np.array_equal(np.sort(keys), bits)  # a bijection
    values = (bits.astype(np.uint32) << 16).view(np.float32)
    nan = np.isnan(values)
    order = np.argsort(keys[~nan])
    ordered_bits, ordered_values = bits[~nan][order], values[~nan][order]
    assert np.all(np.diff(ordered_values) >= 0)
    ties = np.flatnonzero(np.diff(ordered_values) == 0)
    # The only equal neighbours are -0.0 then +0.0, one key apart.
    assert [(ordered_bits[i], ordered_bits[i + 1]) for i in ties] == [(0x8000, 0x0000)]
    assert int(keys[0x0000]) - int(keys[0x8000]) == 1
    # NaNs sit outside the infinities.
    k = keys.astype(np.int64)
    assert np.all((k[nan] > k[0x7F80]) | (k[nan] < k[0xFF80]))


@pytest.mark.parametrize("dtype", [np.uint8, np.uint32])
def test_monotone_key_other_widths(dtype):
    rng = np.random.default_rng(0)
    bits = np.arange(256, dtype=np.uint8) if dtype == np.uint8 else rng.integers(0, 2**32, 10_000, dtype=np.uint32)
    keys = monotone_key(bits)
    assert keys.dtype == bits.dtype
    assert np.array_equal(key_inverse(keys), bits)
    if dtype == np.uint32:
        values = bits.view(np.float32)
        ok = ~np.isnan(values)
        order = np.argsort(keys[ok])
        assert np.all(np.diff(values[ok][order]) >= 0)


def test_entropy_bound_by_hand():
    # 16 elements over two tensors, 4 changed, key steps +1, +1, -1, +2.
    a = np.full(10, 0x3F80, np.uint16)  # 1.0: key 0xBF80
    b = np.full(6, 0xBF80, np.uint16)  # -1.0: key 0x407F
    a2, b2 = a.copy(), b.copy()
    a2[1], a2[7] = 0x3F81, 0x3F81  # +1 step each
    b2[0] = 0xBF81  # -1.0 -> slightly more negative: one step down
    b2[5] = 0xBF7E  # -1.0 -> two steps up (toward zero)
    got = entropy_bound_bits({"a": a, "b": b}, {"a": a2, "b": b2})
    h2 = -(0.25 * math.log2(0.25) + 0.75 * math.log2(0.75))
    position = 16 * h2
    step = 4 * 1.5  # p(+1) = 1/2, p(-1) = p(+2) = 1/4
    assert got["n_total"] == 16 and got["n_changed"] == 4 and got["density"] == 0.25
    assert got["position_bits"] == pytest.approx(position, rel=1e-12)
    assert got["step_bits"] == pytest.approx(step, rel=1e-12)
    assert got["total_bits"] == pytest.approx(position + step, rel=1e-12)
    assert got["bits_per_changed"] == pytest.approx((position + step) / 4, rel=1e-12)
    assert got["ratio_vs_raw"] == pytest.approx(16 * 16 / (position + step), rel=1e-12)


def test_entropy_bound_unchanged_state():
    a = {"a": np.arange(10, dtype=np.uint16)}
    got = entropy_bound_bits(a, {"a": a["a"].copy()})
    assert got["n_changed"] == 0 and got["total_bits"] == 0 and got["ratio_vs_raw"] == math.inf


def test_run_peer_reports(peer):
    base, new = bf16_state(n=4000)
    r = run_peer(peer, base, new, repeats=1)
    assert set(r) >= {"name", "bytes", "ratio_vs_raw", "bits_per_changed", "encode_gbps", "decode_gbps", "exact"}
    assert r["exact"] is True and r["name"] == peer.name
    assert r["ratio_vs_raw"] == pytest.approx(sum(v.nbytes for v in new.values()) / r["bytes"])


class _Liar(Peer):
    """Claims one byte and hands back the base: run_peer must say so, not raise."""

    name = "liar"

    def encode(self, base, new):
        return b"x"

    def decode(self, base, blob):
        return {k: v.copy() for k, v in base.items()}


def test_run_peer_reports_inexact_instead_of_asserting():
    r = run_peer(_Liar(), *bf16_state(n=1000), repeats=1)
    assert r["exact"] is False
