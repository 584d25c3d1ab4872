"""`wsync demo`: wsync's main job, end to end, in under a minute and with nothing to fetch.

A newcomer's first command should show what wsync is for, not only that it
installed. So the demo trains a small torch model for a few steps, publishes
every step's weights the way an RL trainer would (fp32 master weights, served
as bf16), and follows them from a subscriber in a process of its own, over a
real tcp loopback link with a token. Each step goes out twice, once whole
(codec raw) and once as a delta, so bytes and seconds sit side by side from the
same run on the same machine. The subscriber hashes the bytes its engine holds
(sha256, not wsync's own checksums) and the trainer compares them with its own:
the last line says "bit-exact" only when every version matched.
"""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import queue
import secrets
import statistics
import time

from .errors import BackendUnavailable, WsyncError

# what each column publishes: the same versions, one Publisher each
MODES = {"full": dict(codec="raw"), "delta": dict(codec="delta", tier="packed")}
WAIT_S = 120.0  # a version not live after this long means something is broken, not slow


class DemoError(WsyncError):
    """The subscriber process failed, or its weights differ from the trainer's."""


def add_parsers(sub) -> None:
    d = sub.add_parser("demo", help="train a small model, sync every step to a subscriber process: full vs delta")
    d.add_argument("--steps", type=int, default=8, help="training steps after the first version (default 8)")
    d.add_argument("--width", type=int, default=1024,
                   help="model width: 2 MLP blocks of width x 4*width, 16.8M parameters at 1024 (default 1024)")
    d.add_argument("--lr", type=float, default=1e-6,
                   help="Adam learning rate; RL fine-tuning runs at 1e-7 to 1e-5 (default 1e-6)")
    d.set_defaults(fn=main)


def main(args) -> None:
    if args.steps < 1 or args.width < 8 or args.lr <= 0:
        raise ValueError(f"wsync demo needs --steps >= 1, --width >= 8 and --lr > 0; got --steps {args.steps}, "
                         f"--width {args.width}, --lr {args.lr:g}")
    try:
        import torch
    except ImportError as e:
        raise BackendUnavailable("wsync demo trains a torch model: install torch 2.13.0 (the README's "
                                 "'Install and first run' gives the command that keeps a CPU machine on the "
                                 "CPU build)") from e
    torch.manual_seed(0)
    model, teacher = _mlp(args.width), _mlp(args.width)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    served = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}  # what engines hold
    nbytes = sum(t.numel() * t.element_size() for t in served.values())
    nparams = sum(t.numel() for t in served.values())

    from .sync import Publisher

    token = secrets.token_hex(16)
    pubs = {m: Publisher("tcp://127.0.0.1:0", token=token, keyframe_every=0, **cfg) for m, cfg in MODES.items()}
    ctx = mp.get_context("spawn")  # a fresh interpreter, as an inference engine would be
    results = ctx.Queue()
    child = ctx.Process(target=_follow, args=({m: p.address for m, p in pubs.items()}, token, args.steps, results),
                        name="wsync-demo-subscriber", daemon=True)
    child.start()
    try:
        for p in pubs.values():
            p.wait_for_subscribers(1, timeout=WAIT_S)
        params = f"{nparams / 1e6:.1f}M" if nparams >= 1e5 else f"{nparams:,}"
        print(f"wsync demo: a {params}-parameter MLP trained for {args.steps} step(s) (Adam, lr {args.lr:g}, fp32 "
              f"master weights).\nEach version goes out as bf16 ({_size(nbytes)}) over tcp loopback (with a token) "
              f"to a subscriber process (pid {child.pid}),\nonce whole (full) and once as a delta.\n")
        rows = []
        for step in range(args.steps + 1):
            loss, changed = (None, None) if step == 0 else _train_step(model, teacher, opt, served, args.width)
            expected = _sha256({n: (tuple(t.shape), _raw(t)) for n, t in served.items()})
            row = {"step": step, "loss": loss, "changed": changed}
            for mode, pub in pubs.items():
                t0 = time.monotonic()
                pub.publish(served, version=step)
                got = _expect(results, child, mode, step)
                if got["sha256"] != expected:
                    raise DemoError(f"version {step} ({mode}): the subscriber's weights hash to {got['sha256'][:16]}"
                                    f"..., the trainer's to {expected[:16]}...: NOT bit-exact")
                row[mode] = (got["bytes"], got["t"] - t0)
            rows.append(row)
            _print_row(row, nbytes)
        child.join(timeout=WAIT_S)  # the subscriber leaves first, so the publishers' close is a plain goodbye
        _print_summary(rows)
        print(f"sha256 of the subscriber's weights == the trainer's at every version ({args.steps + 1} x full, "
              f"{args.steps + 1} x delta): bit-exact")
    finally:
        if child.is_alive():
            child.terminate()
        for p in pubs.values():
            p.close()


def _mlp(width: int):
    import torch.nn as nn

    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.GELU(),
                         nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


def _train_step(model, teacher, opt, served, width: int) -> tuple[float, float]:
    """One Adam step towards a fixed random teacher; refresh the bf16 copy in place and count what changed.

    The fraction of bf16 elements that change is what decides a delta's size: RL
    learning rates move most fp32 weights by less than one bf16 step."""
    import torch

    x = torch.randn(64, width)
    with torch.no_grad():
        target = teacher(x)
    loss = torch.nn.functional.mse_loss(model(x), target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    changed = total = 0
    with torch.no_grad():
        for n, p in model.named_parameters():
            new = p.to(torch.bfloat16)
            changed += int((new.view(torch.int16) != served[n].view(torch.int16)).sum())
            total += new.numel()
            served[n].copy_(new)
    return loss.item(), changed / total


def _follow(addresses: dict, token: str, steps: int, results) -> None:
    """Subscriber process: follow each publisher into a host-memory engine and report every version it serves."""
    from . import engines
    from .subscriber import Subscriber

    subs = {}
    try:
        subs = {m: Subscriber(a, engine=engines.Shadow(), token=token) for m, a in addresses.items()}
        for version in range(steps + 1):
            for mode, sub in subs.items():
                sub.wait_for(version, timeout=WAIT_S)
                t = time.monotonic()  # the engine serves it now: checked, applied, digest verified
                results.put({"mode": mode, "version": version, "t": t, "bytes": sub.stats.last.bytes,
                             "sha256": _sha256({n: (tb.shape, tb.bits) for n, tb in sub.engine.state.items()})})
    except BaseException as e:  # the trainer must hear why, not wait out its timeout
        results.put({"error": f"{type(e).__name__}: {e}"})
    finally:
        for sub in subs.values():
            sub.close()


def _expect(results, child, mode: str, version: int) -> dict:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            got = results.get(timeout=0.5)
        except queue.Empty:
            if not child.is_alive():
                raise DemoError(f"the subscriber process exited (code {child.exitcode}) before version {version}")
            continue
        if "error" in got:
            raise DemoError(f"the subscriber process failed: {got['error']}")
        if (got["mode"], got["version"]) != (mode, version):
            raise DemoError(f"expected version {version} ({mode}) from the subscriber, got {got['version']} "
                            f"({got['mode']})")
        return got
    raise DemoError(f"version {version} ({mode}) was not live on the subscriber after {WAIT_S:g}s")


def _raw(t):
    """The bytes of a torch tensor as numpy sees them (bf16 has no numpy dtype: viewed as int16)."""
    import torch

    return t.detach().contiguous().view(torch.int16 if t.element_size() == 2 else t.dtype).numpy()


def _sha256(tensors: dict) -> str:
    """sha256 over names, shapes and raw bytes ({name: (shape, array)}): independent of wsync's own checksums,
    which are what it checks."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        shape, a = tensors[name]
        h.update(f"{name}:{tuple(int(d) for d in shape)}:".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


HEADER = f"{'step':>4}  {'loss':>9}  {'changed':>7} | {'full: bytes':>12} {'seconds':>8} | {'delta: bytes':>12} {'seconds':>8}"


def _print_row(row: dict, nbytes: int) -> None:
    if row["step"] == 0:
        print(HEADER)
    (fb, fs), (db, ds) = row["full"], row["delta"]
    loss = "" if row["loss"] is None else f"{row['loss']:.6f}"
    changed = "" if row["changed"] is None else f"{row['changed']:.2%}"
    note = "   first version: both send everything" if row["step"] == 0 else ""
    print(f"{row['step']:>4}  {loss:>9}  {changed:>7} | {_size(fb):>12} {fs:>8.3f} | {_size(db):>12} {ds:>8.3f}{note}",
          flush=True)


def _print_summary(rows: list[dict]) -> None:
    later = rows[1:]
    fb, fs = (statistics.median(r["full"][i] for r in later) for i in (0, 1))
    db, ds = (statistics.median(r["delta"][i] for r in later) for i in (0, 1))
    print(f"{'median, steps 1-' + str(len(later)):>24} | {_size(fb):>12} {fs:>8.3f} | {_size(db):>12} {ds:>8.3f}")
    print(f"\ndelta vs full after the first version: {fb / db:.0f}x fewer bytes, live {fs / ds:.1f}x sooner\n"
          f"(seconds: from publish() on the trainer until the subscriber process serves the version: received, "
          f"checked,\napplied, digest verified; {os.cpu_count()} CPU cores here)")
