"""Codec kernel throughput: each backend end to end and kernel by kernel, on one data set.

`run_kernel_bench` builds one bf16 state (default 256 MiB in 16 tensors, 1%
of elements changed, mostly by ±1 representable value, a few escapes), then
times, in the same process on the same arrays: a numpy copy of the state into
resident memory (the baseline every ratio is against) and into fresh memory,
`wsync.encode(tier="sparse")` and `wsync.apply` end to end per backend, and
the pieces they are made of (the plain and fused kernels, checksums, the copy
and scatter of an unfused apply), so a slow end-to-end number can be pinned on
the piece that costs it. `apply` is out of place (fresh result tensors, whose
pages must be faulted in, as for `copy_fresh`); `apply_inplace` writes into
resident tensors, as an engine updating its weights does. Throughput is GB/s
(1e9 bytes) of model bytes, best of `repeats` rounds after a warm-up, all
operations interleaved round by round; every backend's output is checked
byte for byte against the reference's.

    wsync bench kernels --backends cpu --json result.json
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from wsync import api, backends
from wsync.codecs import delta_ref
from wsync.dtypes import DTYPES
from wsync.errors import BackendUnavailable
from wsync.hardware import describe
from wsync.snapshot import TensorBits

from .results import one_line


def make_pair(size_bytes: int, density: float, tensors: int, seed: int = 0) -> tuple[dict, dict]:
    """Base and new bf16 states as TensorBits: the changes an RL optimizer step makes."""
    rng = np.random.default_rng(seed)
    n = size_bytes // 2 // tensors
    bf16 = DTYPES["BF16"]
    base, new = {}, {}
    for t in range(tensors):
        # bf16 = the top half of an fp32 N(0, 0.02) weight
        b = (rng.standard_normal(n, dtype=np.float32) * np.float32(0.02)).view(np.uint32) >> np.uint32(16)
        b = b.astype(np.uint16)
        w = b.copy()
        pos = np.flatnonzero(rng.random(n) < density)
        w[pos] = delta_ref.unkey(delta_ref.monotone_key(b[pos], "float") + _steps(rng, len(pos)), "float")
        name = f"layers.{t}.weight"
        base[name], new[name] = TensorBits(bf16, (n,), b), TensorBits(bf16, (n,), w)
    return base, new


def _steps(rng, k: int) -> np.ndarray:
    """Key steps: ±1 mostly, ±2 sometimes, a rare jump past the i8 range (an escape)."""
    mag = rng.choice(np.array([1, 2, 3, 500], np.uint16), size=k, p=[0.9, 0.08, 0.019, 0.001])
    return np.where(rng.random(k) < 0.5, mag, (-mag.astype(np.int32)).astype(np.uint16)).astype(np.uint16)


@dataclass
class Op:
    """One timed operation; setup runs untimed before every run of it."""

    fn: Callable[[], object]
    setup: Callable[[], object] | None = None


def interleaved(ops: dict, rounds: int) -> dict:
    """Best seconds of each op over `rounds` rounds, after a warm-up round.

    Every round runs every op once, baseline included, so a burst of load
    from another process on the machine slows both sides of a ratio alike
    instead of one op's whole series.
    """
    best = {name: float("inf") for name in ops}
    for r in range(rounds + 1):
        for name, op in ops.items():
            if op.setup is not None:
                op.setup()
            t = time.perf_counter()
            op.fn()
            dt = time.perf_counter() - t
            if r:  # round 0 warms up: page faults, lazy imports, first touch of outputs
                best[name] = min(best[name], dt)
    return best


def _torch_state(state: dict) -> dict:
    """The same bits as torch bf16 tensors (no copy), what callers of wsync.apply pass."""
    import torch

    return {n: torch.from_numpy(tb.bits).view(torch.bfloat16) for n, tb in state.items()}


def _same(out: dict, new: dict) -> bool:
    import torch

    return all(torch.equal(out[n].view(torch.int16), torch.from_numpy(tb.bits.view(np.int16))) for n, tb in new.items())


def _end_to_end(base, new, tbase, name: str) -> tuple[dict, dict]:
    """wsync.encode / wsync.apply (out of place, and in place into resident tensors), and facts checked once."""
    payload = api.encode(base, new, tier="sparse", backend=name)
    # In place: an engine updating weights it already holds. The target is
    # allocated once (resident pages) and reset, untimed, before every run.
    target = {n: t.clone() for n, t in tbase.items()}

    def reset():
        for n, t in target.items():
            t.copy_(tbase[n])

    ops = {
        "encode": Op(lambda: api.encode(base, new, tier="sparse", backend=name)),
        "apply": Op(lambda: api.apply(tbase, payload, backend=name)),
        "apply_inplace": Op(lambda: api.apply(target, payload, inplace=True, backend=name), reset),
    }
    reset()
    api.apply(target, payload, inplace=True, backend=name)
    facts = {"exact": _same(api.apply(tbase, payload, backend=name), new) and _same(target, new),
             "payload_bytes": payload.nbytes}
    return ops, facts


def _pieces(k, base, new) -> dict:
    """Each piece that encode/apply spend time on, as an op over the whole state."""
    names = list(new)
    secs = {n: k.delta_encode(base[n].bits, new[n].bits, "float") for n in names}
    decoded = {n: k.delta_decode(base[n].bits, secs[n], "float") for n in names}
    scratch = {n: base[n].bits.copy() for n in names}  # resident, for the in-place and copy pieces

    def copy_scatter():
        for n in names:
            out = base[n].bits.copy()
            out[decoded[n][0]] = decoded[n][1]

    def reset():
        for n in names:
            np.copyto(scratch[n], base[n].bits)

    return {
        "delta_encode": Op(lambda: [k.delta_encode(base[n].bits, new[n].bits, "float") for n in names]),
        "delta_decode": Op(lambda: [k.delta_decode(base[n].bits, secs[n], "float") for n in names]),
        "checksum": Op(lambda: [k.checksum(new[n].bits) for n in names]),
        "copy_and_scatter": Op(copy_scatter),
        "fused_encode": Op(lambda: [k.delta_encode_checksummed(base[n].bits, new[n].bits, "float") for n in names]),
        "fused_decode": Op(lambda: [k.delta_decode_checksummed(base[n].bits, secs[n], "float") for n in names]),
        "fused_apply": Op(lambda: [k.delta_apply(base[n].bits, secs[n], "float") for n in names]),
        "fused_apply_inplace": Op(lambda: [k.delta_apply_inplace(scratch[n], secs[n], "float") for n in names], reset),
        "copy_checksummed": Op(lambda: [k.copy_checksummed(base[n].bits, scratch[n]) for n in names]),
    }


def _check_kernels(k, ref, base, new) -> bool:
    """Sections, decoded values and checksums identical to the reference's."""
    for n in new:
        a, b = k.delta_encode(base[n].bits, new[n].bits, "float"), ref.delta_encode(base[n].bits, new[n].bits, "float")
        if not all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("table", "gaps", "steps", "escapes")):
            return False
        (pa, va), (pb, vb) = k.delta_decode(base[n].bits, b, "float"), ref.delta_decode(base[n].bits, b, "float")
        if not (np.array_equal(pa, pb) and np.array_equal(va, vb) and k.checksum(new[n].bits) == ref.checksum(new[n].bits)):
            return False
    return True


def run_kernel_bench(size_bytes: int = 256 << 20, density: float = 0.01, *, tensors: int = 16, repeats: int = 5,
                     backends_: tuple[str, ...] = ("ref", "cpu")) -> dict:
    """Throughput of every loadable backend on one bf16 state; see the module docstring."""
    base, new = make_pair(size_bytes, density, tensors)
    tbase = _torch_state(base)
    model_bytes = sum(tb.nbytes for tb in new.values())
    scratch = {n: np.empty_like(tb.bits) for n, tb in base.items()}
    ops = {
        ("numpy", "copy"): Op(lambda: [np.copyto(scratch[n], tb.bits) for n, tb in base.items()]),
        ("numpy", "copy_fresh"): Op(lambda: [tb.bits.copy() for tb in base.values()]),
    }
    result = {"hardware": describe(), "model_bytes": model_bytes, "tensors": tensors, "density": density,
              "repeats": repeats, "loadavg_before": os.getloadavg(), "backends": {}}
    ref = backends.kernels("ref")
    for name in backends_:
        try:
            k = backends.kernels(name)
        except BackendUnavailable as e:
            result["backends"][name] = {"skipped": str(e)}
            continue
        e2e, facts = _end_to_end(base, new, tbase, name)
        ops.update({(name, op): fn for op, fn in {**e2e, **_pieces(k, base, new)}.items()})
        facts["kernels_match_ref"] = _check_kernels(k, ref, base, new)
        facts["threads"] = getattr(k, "threads", 1)
        result["backends"][name] = facts
    best = interleaved(ops, repeats)
    result["loadavg_after"] = os.getloadavg()  # the machine may be shared: say how busy it was
    result["numpy_copy_gbps"] = model_bytes / best["numpy", "copy"] / 1e9
    result["numpy_copy_fresh_gbps"] = model_bytes / best["numpy", "copy_fresh"] / 1e9
    for (name, op), secs in best.items():
        if name != "numpy":
            result["backends"][name][f"{op}_gbps"] = model_bytes / secs / 1e9
    return result


def render(result: dict) -> str:
    """A markdown table, ratios against the numpy copy measured in the same run."""
    base = result["numpy_copy_gbps"]
    cols = ["encode", "apply", "apply_inplace", "fused_encode", "fused_apply", "fused_apply_inplace", "fused_decode",
            "delta_encode", "delta_decode", "checksum", "copy_checksummed", "copy_and_scatter"]
    lines = [f"{result['model_bytes'] / 2**20:.0f} MiB bf16 in {result['tensors']} tensors, density {result['density']:.2%}; "
             f"{one_line(result['hardware'])}",
             f"numpy copy: {base:.2f} GB/s (= 1.00x); numpy copy into fresh memory: "
             f"{result['numpy_copy_fresh_gbps']:.2f} GB/s ({result['numpy_copy_fresh_gbps'] / base:.2f}x); "
             f"best of {result['repeats']} interleaved rounds; kernel threads: {_threads(result)}; "
             f"load average {result['loadavg_before'][0]:.1f} before, {result['loadavg_after'][0]:.1f} after", "",
             "| backend | " + " | ".join(f"{c} GB/s" for c in cols) + " | exact |",
             "|---|" + "---:|" * len(cols) + "---|"]
    for name, row in result["backends"].items():
        if "skipped" in row:
            lines.append(f"| {name} | skipped: {row['skipped']} |")
            continue
        cells = [f"{row[f'{c}_gbps']:.2f} ({row[f'{c}_gbps'] / base:.2f}x)" if f"{c}_gbps" in row else "-" for c in cols]
        exact = row["exact"] and row["kernels_match_ref"]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {'yes' if exact else 'NO'} |")
    return "\n".join(lines)


def _threads(result: dict) -> str:
    return ", ".join(f"{name} {row.get('threads', '-')}" for name, row in result["backends"].items())


def add_parsers(bench) -> None:
    ap = bench.add_parser("kernels", help="codec kernel throughput: each backend end to end and kernel by kernel",
                          description=__doc__.splitlines()[0],
                          epilog="Default 256 MiB: about 20 s here (2 cores); --mib sets the size.")
    ap.add_argument("--mib", type=int, default=256, help="model size in MiB of bf16 (default 256)")
    ap.add_argument("--density", type=float, default=0.01, help="fraction of elements changed (default 0.01)")
    ap.add_argument("--tensors", type=int, default=16, help="tensors the model is split into (default 16)")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved timed rounds, best kept (default 5)")
    ap.add_argument("--backends", default="ref,cpu", help="comma-separated backends to time (default ref,cpu)")
    ap.add_argument("--json", help="also write the result dict here")
    ap.set_defaults(fn=main)


def main(args) -> None:
    import json

    result = run_kernel_bench(args.mib << 20, args.density, tensors=args.tensors, repeats=args.repeats,
                              backends_=tuple(args.backends.split(",")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(render(result))

