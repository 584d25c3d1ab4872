"""Codec kernel throughput: each backend end to end and kernel by kernel, on one data set.

`run_kernel_bench` builds one bf16 state (default ~256 MiB, 1% of elements
changed, mostly by ±1 representable value, a few escapes), then times, in the
same process on the same arrays: a numpy copy of the state (the baseline every
ratio is against), `wsync.encode(tier="sparse")` and `wsync.apply` end to end
per backend, and the pieces they are made of (delta kernels, checksums, the
copy and scatter of an out-of-place apply), so a slow end-to-end number can
be pinned on the piece that costs it. `apply` is out of place (fresh result
tensors, whose pages the kernel must fault in); `apply_inplace` writes into
resident tensors, as an engine updating its weights does. Throughput is GB/s (1e9 bytes) of model
bytes, best of `repeats` after a warm-up; every backend's output is checked
byte for byte against the reference's.
"""
from __future__ import annotations

import time

import numpy as np

from .. import api, backends
from ..codecs import delta_ref
from ..dtypes import DTYPES
from ..errors import BackendUnavailable
from ..snapshot import TensorBits
from . import hardware


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


def _best(fn, repeats: int) -> float:
    fn()  # warm-up: page faults, lazy imports, first-touch of outputs
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _torch_state(state: dict) -> dict:
    """The same bits as torch bf16 tensors (no copy), what callers of wsync.apply pass."""
    import torch

    return {n: torch.from_numpy(tb.bits).view(torch.bfloat16) for n, tb in state.items()}


def _same(out: dict, new: dict) -> bool:
    import torch

    return all(torch.equal(out[n].view(torch.int16), torch.from_numpy(tb.bits.view(np.int16))) for n, tb in new.items())


def _end_to_end(base, new, tbase, name: str, repeats: int, model_bytes: int) -> dict:
    payload = api.encode(base, new, tier="sparse", backend=name)
    row = {"encode_gbps": model_bytes / _best(lambda: api.encode(base, new, tier="sparse", backend=name), repeats) / 1e9}
    row["apply_gbps"] = model_bytes / _best(lambda: api.apply(tbase, payload, backend=name), repeats) / 1e9
    row["apply_inplace_gbps"] = model_bytes / _best_inplace(tbase, payload, name, repeats) / 1e9
    row["exact"] = _same(api.apply(tbase, payload, backend=name), new)
    row["payload_bytes"] = payload.nbytes
    return row


def _best_inplace(tbase: dict, payload, name: str, repeats: int) -> float:
    """wsync.apply(inplace=True) into a copy of base that is reset, untimed, before each run.

    The copy is made once, so its pages are resident: this is an engine
    updating the weights it already holds, with no fresh memory to fault in.
    """
    target = {n: t.clone() for n, t in tbase.items()}
    times = []
    for i in range(repeats + 1):
        for n, t in target.items():
            t.copy_(tbase[n])
        s = time.perf_counter()
        api.apply(target, payload, inplace=True, backend=name)
        times.append(time.perf_counter() - s)
    return min(times[1:])  # the first run is the warm-up


def _pieces(k, base, new, repeats: int, model_bytes: int) -> dict:
    """Each piece that encode/apply spend time on, timed alone over the whole state."""
    names = list(new)
    secs = {n: k.delta_encode(base[n].bits, new[n].bits, "float") for n in names}
    decoded = {n: k.delta_decode(base[n].bits, secs[n], "float") for n in names}

    def copy_scatter():
        for n in names:
            out = base[n].bits.copy()
            out[decoded[n][0]] = decoded[n][1]

    timers = {
        "delta_encode": lambda: [k.delta_encode(base[n].bits, new[n].bits, "float") for n in names],
        "delta_decode": lambda: [k.delta_decode(base[n].bits, secs[n], "float") for n in names],
        "checksum": lambda: [k.checksum(new[n].bits) for n in names],
        "copy_and_scatter": copy_scatter,
    }
    if hasattr(k, "delta_apply"):  # fused kernels: what encode/apply would cost if api.py called them
        timers["fused_encode"] = lambda: [k.delta_encode_checksummed(base[n].bits, new[n].bits, "float") for n in names]
        timers["fused_apply"] = lambda: [k.delta_apply(base[n].bits, secs[n], "float") for n in names]
    return {f"{p}_gbps": model_bytes / _best(fn, repeats) / 1e9 for p, fn in timers.items()}


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


def run_kernel_bench(size_bytes: int = 256 << 20, density: float = 0.01, *, tensors: int = 16, repeats: int = 3,
                     backends_: tuple[str, ...] = ("ref", "cpu")) -> dict:
    """Throughput of every loadable backend on one bf16 state; see the module docstring."""
    base, new = make_pair(size_bytes, density, tensors)
    tbase = _torch_state(base)
    model_bytes = sum(tb.nbytes for tb in new.values())
    scratch = np.empty_like(next(iter(base.values())).bits)
    copy_s = _best(lambda: [np.copyto(scratch, tb.bits) for tb in base.values()], repeats)
    result = {"hardware": hardware.describe(), "model_bytes": model_bytes, "tensors": tensors, "density": density,
              "numpy_copy_gbps": model_bytes / copy_s / 1e9, "backends": {}}
    ref = backends.kernels("ref")
    for name in backends_:
        try:
            k = backends.kernels(name)
        except BackendUnavailable as e:
            result["backends"][name] = {"skipped": str(e)}
            continue
        row = _end_to_end(base, new, tbase, name, repeats, model_bytes)
        row.update(_pieces(k, base, new, repeats, model_bytes))
        row["kernels_match_ref"] = _check_kernels(k, ref, base, new)
        row["threads"] = getattr(k, "threads", 1)
        result["backends"][name] = row
    return result


def render(result: dict) -> str:
    """A markdown table, ratios against the numpy copy measured in the same run."""
    base = result["numpy_copy_gbps"]
    cols = ["encode", "apply", "apply_inplace", "delta_encode", "delta_decode", "checksum", "copy_and_scatter", "fused_encode",
            "fused_apply"]
    lines = [f"{result['model_bytes'] / 2**20:.0f} MiB bf16 in {result['tensors']} tensors, density {result['density']:.2%}; "
             f"{hardware.one_line(result['hardware'])}",
             f"numpy copy: {base:.2f} GB/s (= 1.00x)", "",
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


if __name__ == "__main__":
    print(render(run_kernel_bench()))
