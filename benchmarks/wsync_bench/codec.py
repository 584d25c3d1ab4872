"""`wsync bench codec`: our delta tiers beside the peers, on real consecutive snapshots.

Every scheme runs on the same (base, new) pair in the same process: sizes as
ratios against raw bf16, bits per changed element, encode/apply GB/s of model
bytes, a bit-exactness check, and the entropy bound computed from the data.
Without --base/--new it generates (once, then caches) RL-style snapshots of a
Qwen3-architecture model at each lr and compares step 0 with steps 1, 4, 16.
"""
from __future__ import annotations

import datetime
import json
from pathlib import Path

import numpy as np

from wsync import api, progress
from wsync.checkpoint import read_checkpoint
from wsync.hardware import describe
from wsync.snapshot import TensorBits

from .peers import PEERS, Peer, entropy_bound_bits, run_peer
from .results import one_line


class WsyncPeer(Peer):
    """wsync's own codec behind the peers' interface, so one harness times everyone."""

    def __init__(self, tier: str, dtypes: dict, backend: str | None = None):
        self.name = f"wsync-{tier}" + (f"[{backend}]" if backend else "")
        self.tier, self.dtypes, self.backend = tier, dtypes, backend

    def _state(self, bits: dict) -> dict:
        return {n: TensorBits(self.dtypes[n][0], self.dtypes[n][1], b) for n, b in bits.items()}

    def encode(self, base, new) -> bytes:
        return api.encode(self._state(base), self._state(new), tier=self.tier, backend=self.backend).to_bytes()

    def decode(self, base, blob) -> dict:
        out = api.apply_state(self._state(base), blob, backend=self.backend)
        return {n: tb.bits for n, tb in out.items()}


def schemes(meta: dict) -> list[Peer]:
    return [WsyncPeer("packed", meta), WsyncPeer("sparse", meta)] + list(PEERS.values())


def compare(base_path, new_path, *, repeats: int = 3, label: str = "", bar=None) -> dict:
    """All schemes on one pair of checkpoints; bar (from wsync.progress) advances once per scheme."""
    base, new = read_checkpoint(base_path).state, read_checkpoint(new_path).state
    meta = {n: (tb.dtype, tb.shape) for n, tb in new.items()}
    # Load into memory once so no scheme pays for page faults the others skip.
    b = {n: np.array(tb.bits) for n, tb in base.items()}
    w = {n: np.array(tb.bits) for n, tb in new.items()}
    bound = entropy_bound_bits(b, w)
    rows = []
    for peer in schemes(meta):
        if bar is not None:
            bar.set_postfix_str(peer.name)
        if not peer.available():
            rows.append({"name": peer.name, "skipped": peer.why_unavailable})
        else:
            rows.append(run_peer(peer, b, w, repeats))
        if bar is not None:
            bar.update()
    return {"label": label, "base": str(base_path), "new": str(new_path), "bound": bound, "schemes": rows}


def summary(run: dict) -> dict:
    """The issue's targets as numbers: packed vs XOR+zstd-1 and vs the entropy bound."""
    by = {r["name"]: r for r in run["schemes"] if "skipped" not in r}
    packed, xor, sparse = by["wsync-packed"], by.get("xor_zstd"), by["wsync-sparse"]
    return {
        "density": run["bound"]["density"],
        "packed_ratio": packed["ratio_vs_raw"],
        "packed_vs_xor_zstd": packed["ratio_vs_raw"] / xor["ratio_vs_raw"] if xor else None,
        "packed_over_bound": run["bound"]["ratio_vs_raw"] / packed["ratio_vs_raw"] - 1,
        "sparse_ratio": sparse["ratio_vs_raw"],
        "all_exact": all(r["exact"] for r in by.values()),
    }


def render(run: dict) -> str:
    bd = run["bound"]
    lines = [
        f"### {run['label'] or run['new']}",
        f"{bd['n_total']:,} elements, density {bd['density']:.3%}",
        "",
        "| scheme | bytes | ratio vs raw | bits/changed | encode GB/s | apply GB/s | exact |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in run["schemes"]:
        if "skipped" in r:
            lines.append(f"| {r['name']} | skipped: {r['skipped']} | | | | | |")
            continue
        lines.append(f"| {r['name']} | {r['bytes']:,} | {r['ratio_vs_raw']:.1f} | {r['bits_per_changed']:.2f} "
                     f"| {r['encode_gbps']:.2f} | {r['decode_gbps']:.2f} | {'yes' if r['exact'] else 'NO'} |")
    lines.append(f"| entropy bound | {bd['total_bits'] / 8:,.0f} | {bd['ratio_vs_raw']:.1f} | {bd['bits_per_changed']:.2f} | | | |")
    s = summary(run)
    lines += ["", f"packed = {s['packed_vs_xor_zstd']:.2f}x XOR+zstd-1, {s['packed_over_bound']:+.1%} over the entropy bound; "
              f"sparse {s['sparse_ratio']:.1f}x raw"]
    return "\n".join(lines)


def _pairs(a) -> list[tuple[str, Path, Path]]:
    if a.base or a.new:
        if not (a.base and a.new):
            raise ValueError("give both --base and --new, or neither")
        return [("given pair", a.base, a.new)]
    from .snapshots import (SnapshotConfig, announce, default_cache_dir, ensure_snapshots, require_generator,
                            snapshot_pairs)

    cfgs = [SnapshotConfig(size=a.size, lr=lr, steps=max(a.gaps)) for lr in a.lr]
    require_generator(cfgs, instead="compare two checkpoints of yours with --base and --new")
    announce(cfgs)  # the disk all of them take, said once before the first is generated
    out = []
    for cfg in cfgs:
        paths = ensure_snapshots(default_cache_dir(cfg), cfg)
        out += [(f"{a.size} model, lr {cfg.lr:g}, gap {g}", b, n) for g, b, n in snapshot_pairs(paths, gaps=a.gaps)]
    return out


def main(a) -> None:
    hw = describe()
    pairs = _pairs(a)  # before the heading: a machine that cannot make the snapshots prints only why
    print(f"# wsync bench codec on {one_line(hw)}\n")
    runs = []
    with progress.bar(len(pairs) * len(schemes({})), "bench codec", unit="scheme") as bar:
        for label, b, n in pairs:
            run = compare(b, n, repeats=a.repeats, label=label, bar=bar)
            run["summary"] = summary(run)
            runs.append(run)
            progress.write(render(run) + "\n")
    if a.json:
        doc = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "hardware": hw, "runs": runs}
        Path(a.json).write_text(json.dumps(doc, indent=2, default=str))
        print(f"wrote {a.json}")
