"""Where the bits of a delta go, and how far each part is from its entropy.

Per (base, new) snapshot pair it reports, in bits per changed element:
  - today's `packed` tier split into positions (gaps_lo + gaps_hi), steps,
    escapes, chunk table and manifest (plus the container header);
  - XOR+zstd-1 (slime's scheme) for the ratio the issue's targets are stated in;
  - entropy bounds: positions i.i.d. Bernoulli; positions conditioned on the
    base value's exponent class (the v2 position model); steps i.i.d.; steps
    conditioned on the same class;
  - the `v2` tier when it is registered, with the same split, and the C++
    encode/decode speed of both tiers (GB/s of model bytes) when --speed.

    wsync bench codec-v2                   # the default pairs (generated, cached)
    wsync bench codec-v2 --pair BASE NEW   # any two safetensors files
    wsync bench codec-v2 --size bench --json out.json --speed

The default pairs are the bench model's snapshots at lr 3e-7 (0.3-0.6% of bf16
values change per step: the issue's "pretrained, lr 1e-6" regime) and lr 1e-6
(~1.2%), generated once by wsync_bench.snapshots and cached.
"""
from __future__ import annotations

import datetime
import json
import math
import platform
import subprocess
import time
from pathlib import Path

import numpy as np

from wsync import api
from wsync.checkpoint import read_checkpoint
from wsync.codecs import delta_ref
from wsync.payload import HEADER

# (lr, steps generated, gaps measured): sparse pairs first, the regime
DEFAULT_SERIES = ((3e-7, 4, (1, 2, 4)), (1e-6, 16, (1,)))


def _h2(p: np.ndarray) -> np.ndarray:
    p = np.asarray(p, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -(p * np.log2(p) + (1 - p) * np.log2(1 - p))
    return np.nan_to_num(h)


def _entropy(counts: np.ndarray) -> float:
    """Bits to code a sequence with these symbol counts under their own empirical distribution."""
    counts = counts[counts > 0].astype(np.float64)
    n = counts.sum()
    return float(-(counts * np.log2(counts / n)).sum()) if n else 0.0


def v2_small() -> int:
    from wsync.codecs import v2_ref

    return v2_ref.SMALL


def exponent_class(bits: np.ndarray, dtype) -> np.ndarray:
    from wsync.codecs import v2_ref  # the v2 spec's class function, when it exists

    return v2_ref.value_class(bits, dtype)


def bounds(base: dict, new: dict) -> dict:
    """Entropy bounds, in bits, pooled over all tensors of the pair (state: name -> TensorBits)."""
    n_tot = k_tot = 0
    cls_n = cls_k = None
    steps_all, step_by_cls = [], {}
    for name, nb in new.items():
        bb = base[name]
        a, b = np.asarray(bb.bits), np.asarray(nb.bits)
        cls = exponent_class(a, nb.dtype)
        changed = a != b
        n_tot += a.size
        k_tot += int(changed.sum())
        cn = np.bincount(cls, minlength=256)
        ck = np.bincount(cls[changed], minlength=256)
        cls_n = cn if cls_n is None else cls_n + cn
        cls_k = ck if cls_k is None else cls_k + ck
        ka = delta_ref.monotone_key(a[changed], nb.dtype.order)
        kb = delta_ref.monotone_key(b[changed], nb.dtype.order)
        d = (kb - ka).view(f"<i{a.dtype.itemsize}").astype(np.int64)
        steps_all.append(d)
        c = cls[changed]
        for v in np.unique(c):
            step_by_cls.setdefault(int(v), []).append(d[c == v])
    steps = np.concatenate(steps_all) if steps_all else np.zeros(0, np.int64)
    _, sc = np.unique(steps, return_counts=True)
    step_cond = sum(_entropy(np.unique(np.concatenate(v), return_counts=True)[1]) for v in step_by_cls.values())
    mag = np.abs(steps)
    k = max(k_tot, 1)
    esc = mag[mag > v2_small()] - v2_small()
    # v2 writes an escape into the position bitstream: a sign bit and |d| - 7 in Elias gamma
    v2_escape_bits = float((2 + 2 * np.floor(np.log2(esc))).sum()) if len(esc) else 0.0
    return {
        "n": n_tot, "changed": k_tot, "density": k_tot / max(n_tot, 1),
        "pos_iid": float(n_tot * _h2(k_tot / max(n_tot, 1))) / k,
        "pos_given_class": float((cls_n * _h2(np.divide(cls_k, np.maximum(cls_n, 1)))).sum()) / k,
        "step_iid": _entropy(sc) / k,
        "step_given_class": step_cond / k,
        "frac_step1": float((mag == 1).mean()) if k_tot else 0.0,
        "frac_step_gt7": float((mag > 7).mean()) if k_tot else 0.0,
        "v2_escape_bits": v2_escape_bits / k,
    }


def split(payload, tier: str) -> dict:
    """Bytes of a payload by what they carry."""
    out = {"positions": 0, "steps": 0, "escapes": 0, "table": 0, "dense": 0}
    names = {"gaps": "positions", "gaps_lo": "positions", "gaps_hi": "positions", "pos": "positions",
             "steps": "steps", "escapes": "escapes", "table": "table", "model": "table", "data": "dense"}
    for spec in payload.manifest.tensors:
        for part, n in spec.parts.items():
            out[names.get(part, part)] = out.get(names.get(part, part), 0) + n
    out["manifest"] = HEADER.size + len(payload.manifest.to_json())
    out["total"] = payload.nbytes
    return out


def xor_zstd_bytes(base: dict, new: dict) -> int:
    import zstandard

    c = zstandard.ZstdCompressor(level=1)
    total = 0
    for name, nb in new.items():
        diff = np.bitwise_xor(np.asarray(nb.bits), np.asarray(base[name].bits))
        if diff.any():
            total += len(c.compress(diff)) + 8 + len(name)  # the peer's frame header, as in bench/peers.py
    return total


def _tiers() -> list[str]:
    from wsync.manifest import TIERS

    return [t for t in ("packed", "v2") if t in TIERS["delta"]]


def _speed(base, new, tier: str, nbytes: int, repeats: int) -> dict:
    import torch

    def best(fn):
        t = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            r = fn()
            t = min(t, time.perf_counter() - t0)
        return t, r

    te, p = best(lambda: api.encode(base, new, tier=tier, backend="cpu"))
    blob = p.to_bytes()
    td, out = best(lambda: api.apply_state(base, blob, backend="cpu"))
    exact = all(np.array_equal(np.asarray(out[n].bits), np.asarray(new[n].bits)) for n in new)
    ti, live = _inplace(base, blob, repeats)
    exact = exact and all(live[n].contiguous().view(-1).view(torch.uint8).numpy().tobytes() ==
                          np.asarray(new[n].bits).tobytes() for n in new)
    return {"encode_gbps": nbytes / te / 1e9, "decode_gbps": nbytes / td / 1e9,
            "decode_inplace_gbps": nbytes / ti / 1e9, "exact": exact}


def _inplace(base, blob, repeats: int) -> tuple[float, dict]:
    """wsync.apply(inplace=True) into torch tensors that already hold the base (a subscriber's live path: no
    fresh result memory to fault in and zero). The base is copied back between runs, outside the timer."""
    from wsync.snapshot import to_torch

    ref = {n: to_torch(tb) for n, tb in base.items()}
    live = {n: t.clone() for n, t in ref.items()}
    t = math.inf
    for _ in range(repeats):
        for n, x in live.items():
            x.copy_(ref[n])
        t0 = time.perf_counter()
        api.apply(live, blob, inplace=True, backend="cpu")
        t = min(t, time.perf_counter() - t0)
    return t, live


def measure_pair(base_path, new_path, *, speed: bool, repeats: int) -> dict:
    base, new = read_checkpoint(base_path).state, read_checkpoint(new_path).state
    base = {n: tb.__class__(tb.dtype, tb.shape, np.array(tb.bits)) for n, tb in base.items()}
    new = {n: tb.__class__(tb.dtype, tb.shape, np.array(tb.bits)) for n, tb in new.items()}
    raw = sum(np.asarray(tb.bits).nbytes for tb in new.values())
    row = {"base": str(base_path), "new": str(new_path), "model_bytes": raw, "tensors": len(new),
           "bounds": bounds(base, new), "xor_zstd_bytes": xor_zstd_bytes(base, new), "tiers": {}}
    k = max(row["bounds"]["changed"], 1)
    for tier in _tiers():
        p = api.encode(base, new, tier=tier)
        parts = split(p, tier)
        bits = {kk: 8 * v / k for kk, v in parts.items()}
        if tier == "v2":  # its escapes ride in the position bitstream: count them where they belong
            bits["positions"] -= row["bounds"]["v2_escape_bits"]
            bits["escapes"] += row["bounds"]["v2_escape_bits"]
        t = {"bytes": parts, "bits_per_changed": bits,
             "ratio_vs_raw": raw / parts["total"], "vs_xor_zstd": row["xor_zstd_bytes"] / parts["total"]}
        if speed:
            t["speed_cpu"] = _speed(base, new, tier, raw, repeats)
        row["tiers"][tier] = t
    return row


def default_pairs(size: str) -> list[tuple[str, Path, Path]]:
    from .snapshots import SnapshotConfig, ensure_snapshots

    out = []
    for lr, steps, gaps in DEFAULT_SERIES:
        paths = ensure_snapshots(None, SnapshotConfig(size=size, lr=lr, steps=steps))
        out += [(f"{size} lr {lr:g} gap {g}", paths[0], paths[g]) for g in gaps if g < len(paths)]
    return out


def render(label: str, r: dict) -> str:
    b = r["bounds"]
    lines = [f"### {label}: {r['tensors']} tensors, {b['n']:,} elements, density {b['density']:.3%}",
             f"bounds (bits/changed): positions iid {b['pos_iid']:.2f}, | exponent class {b['pos_given_class']:.2f}; "
             f"steps iid {b['step_iid']:.2f}, | class {b['step_given_class']:.2f}; "
             f"|step|=1 {b['frac_step1']:.1%}, |step|>7 {b['frac_step_gt7']:.3%}",
             "", "| tier | positions | steps | escapes | table | dense | manifest | total bits/chg | x raw | x XOR+zstd-1 |"
             + (" enc GB/s | dec GB/s | dec in place GB/s |" if any("speed_cpu" in t for t in r["tiers"].values())
                else ""),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
             + ("---:|---:|---:|" if any("speed_cpu" in t for t in r["tiers"].values()) else "")]
    for name, t in r["tiers"].items():
        q = t["bits_per_changed"]
        s = f"| {name} | {q['positions']:.2f} | {q['steps']:.2f} | {q['escapes']:.2f} | {q['table']:.2f} | {q['dense']:.2f} | " \
            f"{q['manifest']:.2f} | {q['total']:.2f} | {t['ratio_vs_raw']:.0f} | {t['vs_xor_zstd']:.2f} |"
        if "speed_cpu" in t:
            sp = t["speed_cpu"]
            s += f" {sp['encode_gbps']:.2f} | {sp['decode_gbps']:.2f} | {sp['decode_inplace_gbps']:.2f} |" \
                + ("" if sp["exact"] else " NOT EXACT")
        lines.append(s)
    return "\n".join(lines)


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown CPU"


def add_parsers(bench) -> None:
    ap = bench.add_parser("codec-v2", help="where a delta's bits go, per tier, and how far each part is from its "
                                           "entropy", description=__doc__.split("\n")[0],
                          epilog="Default small: about 30 s here (2 cores) where bench codec's small snapshots are "
                                 "cached, a few minutes from nothing (0.3 GB); --size bench: ~15 min the first time, "
                                 "2.8 GB; --size tiny: seconds.")
    ap.add_argument("--pair", nargs=2, type=Path, action="append", metavar=("BASE", "NEW"),
                    help="two safetensors files to measure instead of the generated pairs (repeatable)")
    ap.add_argument("--size", default="small", choices=["tiny", "small", "bench"],
                    help="snapshot model preset for the default pairs (default small)")
    ap.add_argument("--speed", action="store_true", help="also time C++ encode/decode of each tier")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds with --speed, best kept (default 3)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.set_defaults(fn=main)


def main(a) -> None:
    pairs = [(f"{b.name} -> {n.name}", b, n) for b, n in a.pair] if a.pair else default_pairs(a.size)
    print(f"# wsync bench codec-v2 on {cpu_name()}, {__import__('os').cpu_count()} cores\n")
    runs = []
    for label, b, n in pairs:
        r = measure_pair(b, n, speed=a.speed, repeats=a.repeats)
        r["label"] = label
        runs.append(r)
        print(render(label, r) + "\n", flush=True)
    if a.json:
        a.json.write_text(json.dumps({"date": datetime.datetime.now().isoformat(timespec="seconds"),
                                      "cpu": cpu_name(), "runs": runs}, indent=1))
        print(f"wrote {a.json}")

