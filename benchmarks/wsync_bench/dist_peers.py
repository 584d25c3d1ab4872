"""How others move a whole checkpoint into an engine, timed beside wsync on the same weights.

- ``safetensors``: what ``update_weights_from_disk`` amounts to (SGLang, and the
  checkpoint-reload paths of most RL frameworks): the trainer writes a
  safetensors file, the file is copied to where the engine reads it, the engine
  loads it. Timed from the trainer's tensors in memory to the engine's tensors
  in memory: save + copy + load.
- ``shardcast``: HTTP distribution of a checkpoint file (the `shardcast`
  package; prime-rl uses it to fan weights out to inference workers). The
  trainer writes the safetensors file, shardcast's origin shards and checksums
  it and serves the shards over HTTP (bound to 127.0.0.1 here), a shardcast
  client downloads them with wget, reassembles and verifies the file, and the
  engine loads it.

Every path is checked byte for byte: the tensors the engine ends up with must
equal the trainer's bit patterns. Nothing here is pickle (safetensors only).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from wsync.errors import BackendUnavailable, MismatchError

_TORCH_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def to_torch(state: dict) -> dict:
    """TensorBits -> torch tensors of their real dtype (views of the same bytes)."""
    import torch

    out = {}
    for name, tb in state.items():
        dt = getattr(torch, _TORCH_DTYPES[tb.dtype.name])
        out[name] = torch.from_numpy(np.array(tb.bits)).view(dt).reshape(tb.shape)  # a writable copy
    return out


def _numpy_view(t):
    import torch

    return t.contiguous().view(-1).view(torch.uint8).numpy()


def safetensors_path(tensors: dict, workdir: Path, repeats: int = 3) -> dict:
    """save -> copy -> load, best and median of `repeats`, with each stage's share."""
    from safetensors.torch import load_file, save_file

    rows = []
    for i in range(repeats):
        src, dst = workdir / f"trainer-{i}.safetensors", workdir / f"engine-{i}.safetensors"
        t0 = time.perf_counter()
        save_file(tensors, str(src))
        t1 = time.perf_counter()
        shutil.copyfile(src, dst)
        t2 = time.perf_counter()
        got = load_file(str(dst))
        t3 = time.perf_counter()
        _exact(tensors, got, "safetensors save -> copy -> load")
        rows.append({"save_s": t1 - t0, "copy_s": t2 - t1, "load_s": t3 - t2, "seconds": t3 - t0})
        src.unlink()
        dst.unlink()
    return _summary("safetensors save -> copy -> load", rows, tensors)


def shardcast_unavailable() -> str | None:
    try:
        import shardcast  # noqa: F401
    except ImportError:
        return "the shardcast package is not installed (pip install shardcast)"
    if shutil.which("wget") is None:  # its client downloads with wget (and would try to apt-install it)
        return "shardcast's client needs wget, which is not installed"
    return None


def shardcast_path(tensors: dict, workdir: Path, repeats: int = 3, shard_bytes: int = 50_000_000) -> dict:
    """save -> shard + serve over HTTP on loopback -> download + reassemble + verify -> load."""
    why = shardcast_unavailable()
    if why:
        raise BackendUnavailable(why)
    import logging

    from safetensors.torch import load_file, save_file
    from shardcast import ClientNode
    from shardcast import server as sc_server

    from shardcast.utils import logger as sc_logger

    sc_logger.setLevel(logging.WARNING)  # it logs every shard at INFO
    origin_dir, client_dir = workdir / "origin", workdir / "client"
    origin_dir.mkdir()
    stop = threading.Event()
    http = sc_server.ShardcastServer(("127.0.0.1", 0), str(origin_dir), stop)  # loopback only, a free port
    http.timeout = 0.2  # its loop calls handle_request(); a timeout lets it see the stop event
    thread = threading.Thread(target=sc_server._server_thread, args=(http, stop), daemon=True)
    thread.start()
    origin = _origin_on(http, thread, stop, origin_dir)
    url = f"http://127.0.0.1:{http.server_address[1]}"
    # its client probes each server's bandwidth by fetching data1.bin once, when it is created (untimed)
    (origin_dir / "data1.bin").write_bytes(os.urandom(1 << 20))
    rows = []
    try:
        client = ClientNode([url], output_dir=str(client_dir))
        for i in range(repeats):
            src = workdir / f"trainer-{i}.safetensors"
            t0 = time.perf_counter()
            save_file(tensors, str(src))
            t1 = time.perf_counter()
            version = origin.broadcast(str(src), shard_bytes)
            t2 = time.perf_counter()
            out = client.download_version(version, str(client_dir / f"{i}.st"))
            t3 = time.perf_counter()
            if out is None:
                raise MismatchError(f"shardcast could not download or verify version {version} from {url}")
            got = load_file(out)
            t4 = time.perf_counter()
            _exact(tensors, got, "shardcast")
            rows.append({"save_s": t1 - t0, "shard_s": t2 - t1, "download_s": t3 - t2, "load_s": t4 - t3,
                         "seconds": t4 - t0})
            src.unlink()
            os.unlink(out)
    finally:
        stop.set()  # the server thread closes the socket on its way out
        thread.join(timeout=5.0)
    res = _summary("shardcast HTTP (loopback)", rows, tensors)
    res["shard_bytes"] = shard_bytes
    return res


def _origin_on(http, thread, stop, data_dir: Path):
    """A shardcast OriginServer that serves through our loopback-bound HTTP server (its own binds 0.0.0.0)."""
    from shardcast import OriginServer
    from shardcast.envs import SHARDCAST_DISTRIBUTION_FILE, SHARDCAST_MAX_DISTRIBUTION_FOLDERS

    origin = OriginServer.__new__(OriginServer)
    origin.data_dir, origin.port = str(data_dir), http.server_address[1]
    origin.max_distribution_folders = SHARDCAST_MAX_DISTRIBUTION_FOLDERS
    origin.shutdown_event, origin.http_server, origin.server_thread = stop, http, thread
    (data_dir / SHARDCAST_DISTRIBUTION_FILE).touch()
    return origin


def _exact(sent: dict, got: dict, what: str) -> None:
    if sent.keys() != got.keys():
        raise MismatchError(f"{what}: tensor names differ: {sorted(sent.keys() ^ got.keys())[:5]}")
    for name, t in sent.items():
        b = got[name]
        if t.dtype != b.dtype or t.shape != b.shape or not np.array_equal(_numpy_view(t), _numpy_view(b)):
            raise MismatchError(f"{what}: tensor {name} arrived as {b.dtype}{tuple(b.shape)} with other bytes "
                                f"than the trainer's {t.dtype}{tuple(t.shape)}")


def _summary(name: str, rows: list[dict], tensors: dict) -> dict:
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    secs = sorted(r["seconds"] for r in rows)
    return {"name": name, "bytes": nbytes, "repeats": len(rows), "seconds_best": secs[0],
            "seconds_median": secs[len(secs) // 2], "gbps_median": nbytes / secs[len(secs) // 2] / 1e9,
            "exact": True, "runs": rows}


def run_peers(state: dict, repeats: int = 3) -> dict:
    """Both disk/HTTP paths on one state (TensorBits); a peer that cannot run says why."""
    tensors = to_torch(state)
    out = {}
    with tempfile.TemporaryDirectory(prefix="wsync-peers-") as tmp:
        out["safetensors"] = safetensors_path(tensors, Path(tmp), repeats)
    why = shardcast_unavailable()
    if why:
        out["shardcast"] = {"name": "shardcast HTTP (loopback)", "skipped": why}
    else:
        with tempfile.TemporaryDirectory(prefix="wsync-shardcast-") as tmp:
            out["shardcast"] = shardcast_path(tensors, Path(tmp), repeats)
    return out
