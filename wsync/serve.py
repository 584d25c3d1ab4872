"""`wsync serve` and `wsync pull`: a checkpoint folder as a publisher, and a folder that follows one.

    python -c 'import secrets; print(secrets.token_hex(16))' > ~/.wsync-token   # once; both ends read the same file
    wsync serve ./ckpts --listen 127.0.0.1:7070 --token-file ~/.wsync-token  # every checkpoint in ./ckpts, and new ones
    wsync pull tcp://127.0.0.1:7070 -o ./replica --token-file ~/.wsync-token  # newest version, resumable

serve publishes SRC: a .safetensors file or a checkpoint folder is one version
(version 0); a folder of checkpoints (files or sub-folders whose names end in a
number, like step_0004 or step_0004.safetensors) is a series, published in
numeric order as versions 4, ..., and watched for new ones. Anything else in it
is ignored; serve says so once while it finds nothing to send.
A checkpoint is taken only once it parses and has not changed for
``settle_s`` seconds, so a half-written one is never sent; one whose files are
symlinks out of SRC is skipped unless follow_symlinks (``--follow-symlinks``).

pull writes the newest version to OUT atomically, the version and digest stored
in the safetensors metadata (and copied to ``OUT/wsync-version.json``). OUT must
be new, empty, or a folder wsync wrote (fsutil.check_output); nothing else is
ever emptied. Run again (after an interruption, or later),
it starts from what OUT holds and fetches only the deltas since.

serve maps each checkpoint and keeps no copy of it, encoded or not; pull
holds the version it receives and writes it out through a mapping, never a
second in-memory copy. ``serve --no-watch`` exits non-zero if it could serve
no file (naming each and why) or nobody took what it served. docs/serve.md
states these promises and the tests that hold them.
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from pathlib import Path

from .checkpoint import Checkpoint, prepare_output, read_checkpoint, write_checkpoint
from .engines.spool import Spool
from . import safejson, tokens
from .errors import FormatError, WsyncError
from .layout import Layout, layout_of
from .subscriber import WaitTimeout, version_digest

VERSION_FILE = "wsync-version.json"
_NUMBER = re.compile(r"(\d+)(?:\.safetensors)?$")


def _is_checkpoint(p: Path) -> bool:
    if p.is_file():
        return p.suffix == ".safetensors"
    return p.is_dir() and (any(p.glob("*.safetensors")) or (p / "model.safetensors.index.json").exists())


def find_versions(src: Path) -> list[tuple[int, Path]]:
    """The checkpoints under src with their version numbers, oldest first."""
    src = Path(src)
    if not src.exists():
        raise FileNotFoundError(f"{src} does not exist")
    if src.is_file():
        if src.suffix != ".safetensors":
            raise ValueError(f"{src} is not a .safetensors file; serve takes one, a checkpoint folder, "
                             "or a folder of them named like step_0004")
        return [(0, src)]
    if _is_checkpoint(src) and not any(_NUMBER.search(c.name) and _is_checkpoint(c) for c in src.iterdir()):
        return [(0, src)]
    found = []
    for child in src.iterdir():
        m = _NUMBER.search(child.name)
        if m and _is_checkpoint(child):
            found.append((int(m.group(1)), child))
    return sorted(found)


def _settled(path: Path, settle_s: float) -> bool:
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    return bool(files) and time.time() - max(f.stat().st_mtime for f in files) >= settle_s


class NothingServed(WsyncError):
    """serve --no-watch found no checkpoint it could send, or no subscriber took what it sent."""


def unservable(src: Path) -> list[str]:
    """Why each entry of src that serve passes over is no checkpoint (one line each); [] if src is one."""
    src = Path(src)
    if src.is_file():
        return [] if src.suffix == ".safetensors" else [f"{src.name}: not a .safetensors file"]
    found = find_versions(src)
    if found == [(0, src)]:
        return []  # src is the checkpoint: why it could not be read is said when it is read
    out = []
    for child in sorted(set(src.iterdir()) - {p for _, p in found}):
        if child.is_dir():
            why = "a checkpoint folder whose name does not end in its step number (step_0004)" \
                if _is_checkpoint(child) else "a folder with no .safetensors file or index"
        elif child.suffix != ".safetensors":
            why = "not a .safetensors file"
        else:
            why = "a .safetensors file whose name does not end in its step number (step_0004.safetensors)"
        out.append(f"{child.name}: {why}")
    return out or [f"{src} is empty"]


def serve(src, listen: str, *, token=None, watch: bool = True, poll_s: float = 1.0, settle_s: float = 2.0,
          stop=None, log=print, follow_symlinks: bool = False, flush_timeout: float = 300.0, **config) -> None:
    """Publish every checkpoint in src, then (watch=True) each new one, until stop() is true.

    Memory: each checkpoint is mapped, never copied: the publisher encodes from the mapping (publish(frozen=
    True)), keeps no encoded keyframe (each subscriber's is encoded a bucket at a time as it is sent) and
    makes no mirror, so serving a checkpoint of S bytes to any number of subscribers holds about S (the
    mapped pages) plus a bucket per subscriber sending.

    watch=False: once what is there is published, waits up to flush_timeout seconds for a subscriber to take
    the newest version and for every connected one to hold it. Raises NothingServed when no file could be
    served (naming each and why) or nobody took it, and FlushTimeout naming each subscriber left behind (a
    frozen subscriber must not hold serve forever)."""
    from .sync import Publisher

    src = Path(src)
    pub = Publisher(listen, token=token, **config)
    log(f"serving {src} at {pub.address}")
    if pub.metrics is not None:
        log(f"metrics at {pub.metrics.url}")
    done: set[int] = set()
    skipped: dict[str, str] = {}  # name -> why it was not served (said if --no-watch serves nothing)
    said_empty = False
    try:
        while True:
            found = find_versions(src)
            if not found and not said_empty:
                said_empty = True
                log(f"nothing to serve in {src} yet: it takes .safetensors files or checkpoint folders "
                    "whose names end in their step number (step_0004), or SRC itself as one checkpoint")
            for version, path in found:
                if version in done or (pub.newest is not None and version <= pub.newest):
                    continue
                if not _settled(path, settle_s):
                    skipped[path.name] = f"still changing (taken once unchanged for {settle_s:g}s)"
                    break  # later ones wait for this one: versions go out in order
                try:
                    ck = read_checkpoint(path, inside=None if follow_symlinks else src)
                except (WsyncError, OSError) as e:
                    log(f"skipping {path}: {e}")
                    skipped[path.name] = str(e)
                    done.add(version)
                    continue
                pub.publish(ck.state, version=version, frozen=True)
                done.add(version)
                log(f"published version {version} from {path}")
            if not watch:
                _serve_once(pub, src, skipped, flush_timeout, log)
                return
            if stop is not None and stop():
                pub.flush(flush_timeout)
                return
            time.sleep(poll_s)
    finally:
        pub.close()


def _serve_once(pub, src: Path, skipped: dict[str, str], timeout: float, log) -> None:
    """serve --no-watch's end: something was published and somebody took it, or NothingServed says why not."""
    if pub.newest is None:
        reasons = [f"{n}: {why}" for n, why in skipped.items()] + unservable(src)  # unservable: what was never tried
        raise NothingServed(f"nothing to serve in {src}: " + "; ".join(reasons) + ". serve takes .safetensors files "
                            "or checkpoint folders whose names end in their step number (step_0004), or SRC itself "
                            "as one checkpoint")
    deadline = time.monotonic() + timeout
    pub.flush(timeout)  # every subscriber connected now holds it, or FlushTimeout names who does not
    if not pub.wait_taken(0):
        log(f"waiting up to {timeout:g}s (--flush-timeout) for a subscriber to take version {pub.newest}")
        if not pub.wait_taken(max(0.0, deadline - time.monotonic())):
            raise NothingServed(f"served nobody: no subscriber took version {pub.newest} of {src} within {timeout:g}s "
                                f"(--flush-timeout); serve without --no-watch to keep serving")
    pub.flush(max(0.0, deadline - time.monotonic()))


def read_replica(out: Path) -> tuple[Spool, list | None]:
    """The state a previous pull left in out (an empty engine if none or unreadable), and its layouts.

    The version, digest and bucket layouts live in the safetensors metadata,
    written in the same atomic step as the weights, so they cannot disagree
    after a crash; with the layouts, the next pull can take deltas. The
    weights are mapped copy-on-write, not read into memory (engines.Spool).
    """
    out = Path(os.path.abspath(out))
    if not out.exists():
        return Spool(out), None
    try:
        ck = read_checkpoint(out, private=True)
        served = [Layout.from_doc(d) for d in safejson.loads(ck.metadata["wsync_layouts"], what="replica layouts")]
        engine = Spool(out, ck.state)
        if version_digest(engine.state, served) != ck.metadata["wsync_digest"]:
            raise FormatError(f"{out}: weights do not match the digest stored with them")
        engine.version = int(ck.metadata["wsync_version"])
    except (WsyncError, OSError, ValueError, KeyError, TypeError) as e:
        print(f"wsync: ignoring what {out} holds ({e!r:.200}); fetching a keyframe", file=sys.stderr)
        return Spool(out), None
    return engine, served


def replica_metadata(state, version: int, served: list | None = None) -> dict[str, str]:
    """What a replica's safetensors metadata holds: version, digest, and the bucket layouts it came in.

    served: the layouts of that version as it was sent (default: the whole state as one bucket, which is
    what a Publisher's default bucket size makes of any state under 64 MB)."""
    served = served if served is not None else [layout_of(state)]
    return {"wsync_version": str(version), "wsync_digest": version_digest(state, served),
            "wsync_layouts": json.dumps([m.to_doc() for m in served], separators=(",", ":"))}


def pull(address: str, out, *, token=None, timeout: float | None = None, version: int | None = None,
         progress: bool = True, connect_timeout: float | None = None, say=None, say_every: float = 5.0) -> int:
    """Fetch the newest version (or at least `version`) into out; returns the version written.

    timeout: seconds for the whole pull (None: no limit); connect_timeout: seconds, within that, for the
    publisher to answer at all, so a wrong address or a stopped publisher fails soon while a large version
    may take long. Both raise WaitTimeout naming why the publisher could not be reached; a refused token
    raises the refusal (a TransportError) without waiting them out. While it waits, say (default: a line on
    stderr) is told every say_every seconds what for and why, e.g. "waiting for tcp://127.0.0.1:7070:
    nothing listening, 12 s of 60".

    Memory: the version is staged as received (the payloads, about the model's size for a keyframe), then
    decoded a bucket at a time into a scratch file that is mapped, not into the heap (engines.Spool); the
    output is written from that mapping. A resumed pull maps the replica it starts from. About 1x the
    checkpoint in all, never a second or third in-memory copy."""
    from .progress import pull_bar
    from .subscriber import Subscriber

    out = Path(out)
    prepare_output(out)  # before fetching anything: a folder wsync did not write is never replaced
    engine, served = read_replica(out)
    if version is not None and engine.version is not None and engine.version >= version:
        return engine.version
    bar = pull_bar() if progress else None  # a bar per version on a terminal; None (silent) in a pipe or log
    say = say or _say
    sub = Subscriber(address, engine=engine, token=token, apply="poll", progress=bar, served=served)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        limit = min(t for t in (connect_timeout, timeout, math.inf) if t is not None)
        newest = _waiting(lambda t: sub.wait_announced(t), limit, say_every,
                          lambda s: say(f"waiting for {address}: {_why_unreached(sub)}, {s}"),
                          lambda: f"{address} announced no version within {limit:g}s{_cause(sub)}")
        target = version if version is not None else newest
        if engine.version is not None and engine.version >= target:
            return engine.version
        limit = math.inf if deadline is None else max(0.0, deadline - time.monotonic())

        def waiting_for(s):
            if sub.newest_seen is not None and sub.newest_seen < target:
                say(f"waiting for version {target} from {address}: the newest it has announced is "
                    f"{sub.newest_seen}, {s}")
            elif sub.error is not None:
                say(f"waiting for version {target} from {address}: {_why_unreached(sub)}, {s}")
        got = _waiting(lambda t: sub.wait_for(target, timeout=t), limit, say_every, waiting_for,
                       lambda: f"engine still at version {engine.version} after {limit:g}s, waited for "
                               f"{target}{_cause(sub)}")
    finally:
        sub.close()
        if bar:
            bar.close()
    meta = replica_metadata(engine.state, got, sub.served)
    held = meta["wsync_digest"]
    note = json.dumps({"version": got, "digest": held, "source": address}).encode()  # for people and scripts
    write_checkpoint(out, Checkpoint(engine.state, None, meta), extra={VERSION_FILE: note})
    return got


def _waiting(wait, limit: float, every: float, tell, timed_out):
    """wait(seconds) in slices of every seconds until it returns, telling how long so far after each slice;
    WaitTimeout(timed_out()) once limit seconds (inf: none) have passed."""
    t0 = time.monotonic()
    while True:
        left = limit - (time.monotonic() - t0)
        try:
            return wait(max(0.0, min(every, left)))
        except WaitTimeout:
            waited = time.monotonic() - t0
            if waited >= limit:
                raise WaitTimeout(timed_out()) from None
            tell(f"{waited:.0f} s" + (f" of {limit:g}" if limit != math.inf else " (no limit)"))


def _why_unreached(sub) -> str:
    """Why the publisher has not answered, in a few words."""
    e = sub.error
    if e is None:
        return "connected, no version announced yet"
    text = str(e)
    if "Connection refused" in text or "ECONNREFUSED" in text:
        return "nothing listening"
    return text if len(text) <= 160 else text[:160] + "..."


def _cause(sub) -> str:
    return f"; no link to the publisher: {sub.error}" if sub.error is not None else ""


def _say(line: str) -> None:
    from .progress import write

    write(f"wsync: {line}", file=sys.stderr)


def add_parsers(sub) -> None:
    s = sub.add_parser("serve", help="publish a checkpoint (or a folder of them, watched) to subscribers")
    s.add_argument("src", type=Path, help="a .safetensors file or checkpoint folder (one version, 0), or a folder "
                                          "of them named by step, like step_0004: the number is the version")
    s.add_argument("--listen", required=True,
                   help="HOST:PORT or a full address (tcp://, ucx://, local://); 127.0.0.1 keeps it on this machine")
    tokens.add_cli_options(s, "the shared secret subscribers must prove (HMAC); without one, anyone who reaches "
                              "the port can read the weights (default: none, warned off loopback)")
    s.add_argument("--no-watch", action="store_true",
                   help="serve what is there until a subscriber has taken it, then exit; exits 2, naming why, "
                        "if no file could be served or nobody took it within --flush-timeout")
    s.add_argument("--codec", choices=["delta", "raw"], default="delta",
                   help="delta: only what changed between versions; raw: every version whole (default delta)")
    s.add_argument("--tier", choices=["sparse", "packed"], default="packed",
                   help="packed: smallest, for TCP/WAN; sparse: fixed width, fastest to apply (default packed)")
    s.add_argument("--keyframe-every", type=int, default=50,
                   help="a whole version every N versions, deltas between; 0: only the first (default 50)")
    s.add_argument("--follow-symlinks", action="store_true",
                   help="also serve checkpoint files that are symlinks to outside SRC (skipped by default)")
    s.add_argument("--flush-timeout", type=float, default=300.0,
                   help="--no-watch: seconds to wait for a subscriber to take the newest version (and for every "
                        "connected one to hold it) before giving up and naming those left behind (default 300)")
    s.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1:PORT (default: none)")
    s.set_defaults(fn=_serve_cmd)
    p = sub.add_parser("pull", help="fetch the newest version from a publisher into a folder (resumable)")
    p.add_argument("address", help="the publisher: HOST:PORT or a full address (tcp://HOST:PORT, ...)")
    p.add_argument("-o", "--output", type=Path, required=True,
                   help="replica folder: new, empty, or one an earlier pull wrote (then only deltas are fetched)")
    tokens.add_cli_options(p, "the publisher's shared secret (as serve was given it)")
    p.add_argument("--version", type=int, help="wait for at least this version instead of the newest announced")
    p.add_argument("--connect-timeout", type=float, default=60.0,
                   help="seconds for the publisher to answer before giving up; inf waits (default 60)")
    p.add_argument("--timeout", type=float, help="seconds for the whole pull, transfer included (default: no limit)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (it shows only on a terminal anyway)")
    p.set_defaults(fn=_pull_cmd)


def _address(s: str) -> str:
    return s if "://" in s else f"tcp://{s}"


def _serve_cmd(a) -> None:
    serve(a.src, _address(a.listen), token=tokens.from_cli(a), watch=not a.no_watch, codec=a.codec, tier=a.tier,
          keyframe_every=a.keyframe_every, follow_symlinks=a.follow_symlinks, flush_timeout=a.flush_timeout,
          metrics_port=a.metrics_port)


def _pull_cmd(a) -> None:
    v = pull(_address(a.address), a.output, token=tokens.from_cli(a), timeout=a.timeout, version=a.version,
             connect_timeout=a.connect_timeout)
    print(f"{a.output} holds version {v} (digest verified)")
