"""Replays a v2 corpus (make_v2_corpus.py) against one decoder and writes one outcome per input, as JSON.

    python tests/fuzz/replay_v2_corpus.py CORPUS OUT {ref,cpu} [--module PATH_TO_wsync._cpu]

An outcome is ["decoded", sha256 of the v1 sections] or [exception type, message, whether it is a
WsyncError]. "cpu" runs whichever C++ path this process was started with (WSYNC_V2_PORTABLE,
WSYNC_NO_AVX2) and records wsync._cpu.v2_paths() so the caller can see which ran; --module loads another
build of the extension (the AddressSanitizer one) as wsync._cpu first. Any exception is an outcome, so a
decoder that raises the wrong thing is seen, not hidden; a crash ends the process and the caller sees that.

With --api N, every Nth input also goes through the public API (wsync.apply_state) as a whole payload: a
delta-v2 segment holding the input's parts, its stored-bytes checksum, its result checksum (of what this
decoder made of the parts) and the manifest's recomputed, so the parts get past every checksum to the
decoder. Those outcomes are ["applied", sha256 of the new tensor] or the exception, as above.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent.parent)]


def digest(sec) -> str:
    h = hashlib.sha256()
    for f in ("table", "gaps", "steps", "escapes"):
        b = np.ascontiguousarray(getattr(sec, f)).tobytes()
        h.update(len(b).to_bytes(8, "little") + b)
    return h.hexdigest()


def outcomes(cases, decode) -> list:
    from wsync import dtypes
    from wsync.errors import WsyncError

    out = []
    for c in cases:
        dt = dtypes.DTYPES[c.dtype]
        old = np.frombuffer(c.base, dt.bits_dtype)
        try:
            out.append(["decoded", digest(decode(old, c.parts, dt))])
        except Exception as e:  # noqa: BLE001 - every refusal is recorded and compared, whatever its type
            out.append([type(e).__name__, str(e), isinstance(e, WsyncError)])
    return out


def as_payload(c, dt, old: np.ndarray, sec) -> bytes:
    """A whole payload whose one delta-v2 segment holds c's parts, with every checksum made to match them.

    sec: what this decoder made of the parts (None: refused); the result checksum is of old with those
    changes, so a payload the decoder takes is applied to the end. Other fields come from a real encode."""
    import wsync
    from wsync.checksum import checksum
    from wsync.codecs import delta_ref
    from wsync.checksum import state_digest
    from wsync.payload import Payload
    from wsync.snapshot import TensorBits

    new = old.copy()
    new[0] = old[0] ^ dt.bits_dtype.type(1)
    p = wsync.encode({"w": TensorBits(dt, old.shape, old)}, {"w": TensorBits(dt, new.shape, new)}, tier="v2")
    spec = p.manifest.tensors[0]
    spec.kind = "delta-v2"  # the encoder may have stored one change another way
    body = b"".join(bytes(c.parts[q]) for q in c.parts)
    spec.parts = {q: len(c.parts[q]) for q in c.parts}
    spec.payload_checksum = checksum(np.frombuffer(body, np.uint8))
    if sec is not None:
        pos, values = delta_ref.decode(old, sec, dt.order)
        new = old.copy()
        new[pos] = values
        spec.checksum = checksum(new)
    m = p.manifest
    m.checksum = state_digest((s.name, s.dtype, (s.numel,), s.checksum) for s in m.tensors)
    return Payload(m, memoryview(body)).to_bytes()


def api_outcomes(cases, decode, backend: str, every: int) -> list:
    import hashlib

    import wsync
    from wsync import dtypes
    from wsync.errors import WsyncError
    from wsync.snapshot import TensorBits

    out = []
    for c in cases[::every]:
        dt = dtypes.DTYPES[c.dtype]
        old = np.frombuffer(c.base, dt.bits_dtype).copy()
        try:
            sec = decode(old, c.parts, dt)
        except Exception:  # noqa: BLE001 - refused: the API must refuse it too
            sec = None
        blob = as_payload(c, dt, old, sec)
        try:
            got = wsync.apply_state({"w": TensorBits(dt, old.shape, old)}, blob, backend=backend)
            out.append(["applied", hashlib.sha256(np.ascontiguousarray(got["w"].bits).tobytes()).hexdigest()])
        except Exception as e:  # noqa: BLE001
            out.append([type(e).__name__, str(e), isinstance(e, WsyncError)])
    return out


def main(corpus: str, dest: str, which: str, module: str | None, api_every: int) -> None:
    if module:
        from asan_driver import load_as_wsync_cpu

        load_as_wsync_cpu(module)
    from make_v2_corpus import unpack

    cases = unpack(Path(corpus).read_bytes())
    if which == "ref":
        from wsync.codecs import v2_ref

        decode = v2_ref.decode
    else:
        from wsync.backends.cpu import CpuKernels

        k = CpuKernels()
        if module:
            assert k._cpu is sys.modules["wsync._cpu"] and k._cpu.__file__ == module, "not the build asked for"
        decode = k.v2_decode
    got = outcomes(cases, decode)
    api = api_outcomes(cases, decode, which, api_every) if api_every else None
    paths = None if which == "ref" else list(k._cpu.v2_paths())
    Path(dest).write_text(json.dumps({"outcomes": got, "api": api, "v2_paths": paths}))


if __name__ == "__main__":
    args, opts = sys.argv[1:], {"--module": None, "--api": 0}
    for flag in opts:
        if flag in args:
            i = args.index(flag)
            opts[flag] = args[i + 1]
            del args[i:i + 2]
    main(*args, opts["--module"], int(opts["--api"]))
