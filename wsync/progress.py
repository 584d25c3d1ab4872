"""Progress bars for long work, and the one place that decides whether they show.

Snapshot generation, `bench codec`, `bench all` and `pull` can run for minutes;
a newcomer needs to see that they move, how fast, and when they will end. A bar
redrawn with `\\r` is noise in a log file or a pipe, so bars show only when
stderr is a terminal, and never with `--quiet` or `--json` (whose output
another program reads). `WSYNC_PROGRESS=1` forces them on (to watch a run
whose stderr is piped, and for the tests), `WSYNC_PROGRESS=0` off.

Callers use `bar()` / `write()` / `pull_bar()` and never import tqdm: with
bars off every call here is a no-op, so the code that does the work reads the
same either way.
"""
from __future__ import annotations

import os
import sys
import time

_quiet = False  # set by configure() from --quiet / --json


def configure(*, quiet: bool = False) -> None:
    """Called once by a command line after parsing its flags."""
    global _quiet
    _quiet = bool(quiet)


def enabled() -> bool:
    """Whether bars show: off when quiet, else WSYNC_PROGRESS decides, else whether stderr is a terminal."""
    if _quiet:
        return False
    forced = os.environ.get("WSYNC_PROGRESS", "").strip().lower()
    if forced in ("1", "true", "yes", "on"):
        return True
    if forced in ("0", "false", "no", "off"):
        return False
    return sys.stderr.isatty()


class _Off:
    """What bar() returns when bars are off: accepts the same calls and does nothing."""

    n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_description_str(self, s: str) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def bar(total: int | float | None, desc: str, *, unit: str = "it", unit_scale: bool = False, leave: bool = True):
    """A tqdm bar on stderr (rate and ETA included) when enabled(), else a silent stand-in."""
    if not enabled():
        return _Off()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, leave=leave, file=sys.stderr,
                dynamic_ncols=True, smoothing=0.1)


def write(text: str, *, file=None) -> None:
    """Print a line without tearing a bar that is being drawn (tqdm clears and redraws it)."""
    file = file or sys.stdout
    if enabled():
        from tqdm import tqdm

        tqdm.write(text, file=file)
    else:
        print(text, file=file, flush=True)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n} B"  # not reached


class PullBar:
    """Subscriber's `progress(version, bucket, buckets, bytes)` callback drawn as one bar per version.

    The publisher does not announce a version's size, only its bucket count, so
    the percentage is of buckets; bytes so far and MB/s sit beside it.
    """

    def __init__(self):
        self._bar = None
        self._version = None
        self._t0 = time.monotonic()

    def __call__(self, version: int, bucket: int, count: int, nbytes: int) -> None:
        if version != self._version or bucket == 1:
            self.close()
            self._version, self._t0 = version, time.monotonic()
            self._bar = bar(count, f"version {version}", unit="bucket")
        rate = nbytes / max(time.monotonic() - self._t0, 1e-9)
        self._bar.update(bucket - self._bar.n)
        self._bar.set_postfix_str(f"{human_bytes(nbytes)}, {human_bytes(rate)}/s")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def pull_bar():
    """The `progress` callback `wsync pull` hands its Subscriber, or None when bars are off."""
    return PullBar() if enabled() else None
