"""The real `wsync` command in a subprocess, as a user runs it: one command, or `serve` kept running."""
from __future__ import annotations

import os
import subprocess
import sys

HANG = 60  # seconds: only to turn a hang into a failure, never a measurement


def environment(extra: dict | None = None) -> dict:
    """This process's environment without any wsync token (a developer's own would change what is tested),
    plus extra."""
    return {k: v for k, v in os.environ.items() if not k.startswith("WSYNC_TOKEN")} | (extra or {})


def wsync_cli(*args, timeout=HANG, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wsync.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=environment(env), **kw)


def one_line_error(r: subprocess.CompletedProcess, code: int = 2) -> str:
    """The run failed with `code` and said why in its last stderr line, with no traceback; returns that line."""
    assert r.returncode == code, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("wsync: "), r.stderr
    return last


class Serving:
    """`wsync serve ...` in a subprocess, on 127.0.0.1:0; .address once it says where, .stderr once it ended."""

    def __init__(self, *args, env: dict | None = None):
        self.proc = subprocess.Popen([sys.executable, "-m", "wsync.cli", "serve", *map(str, args),
                                      "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=environment(env))
        line = self.proc.stdout.readline()  # "serving SRC at tcp://127.0.0.1:PORT"
        assert " at tcp://" in line, (line, self.proc.stderr.read() if self.proc.poll() is not None else "")
        self.address = line.split(" at ")[1].strip()
        self.stderr = ""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        _, self.stderr = self.proc.communicate(timeout=HANG)
