"""Writing to disk safely: atomic, durable, inside the folder it was meant for, and only over our own files.

- A reader sees the old file or folder or the whole new one, never a torn one,
  and a power cut after the rename cannot leave a renamed but empty file: data
  is fsynced before the rename, the folder holding the rename after it.
- A name that came from a payload, a peer or another file (a shard name) is a
  plain file name, checked before it becomes a path: it cannot point anywhere
  but into the folder wsync is writing.
- wsync replaces a folder only if it wrote it: its folders carry a marker file
  (``.wsync-output.json``) listing the files wsync put there. A folder without
  one, or holding files the marker does not list, is refused, never emptied.
- Temp files and folders are siblings named ``.<name>.wsync-tmp-<pid>-<random>``;
  one whose process is gone (a SIGKILLed pull) is removed by the next write of
  <name>. Nothing else is ever removed.
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from . import safejson
from .errors import FormatError, OutputError

MARKER = ".wsync-output.json"  # in every folder wsync writes: proof that it may replace the folder
TEMP_TAG = ".wsync-tmp-"
MAX_NAME_BYTES = 255  # a longer name is refused by the filesystem anyway; say so before it does
# A replica written by `wsync pull` before folders carried the marker: exactly these files.
LEGACY_PULL = frozenset({"model.safetensors", "wsync-version.json"})


def plain_name(name, what: str = "file name") -> str:
    """name, if it is a plain file name: the only kind a name from outside may be when it becomes a path."""
    why = None
    if not isinstance(name, str) or not name:
        why = "it is empty or not a string"
    elif name in (".", "..") or name.startswith("."):
        why = "it starts with '.' (a parent folder, or a hidden name wsync keeps for its own files)"
    elif any(c in name for c in "/\\\0"):
        why = "it holds a path separator or a NUL"
    elif len(name.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
        why = f"it is longer than {MAX_NAME_BYTES} bytes"
    if why:
        raise FormatError(f"{what} {name!r} refused: {why}; only plain file names are written")
    return name


def child(folder, name, what: str = "file name") -> Path:
    """folder / name, after checking name is plain and the result (links resolved) stays in folder."""
    folder = Path(folder)
    path = folder / plain_name(name, what)
    if path.resolve().parent != folder.resolve():
        raise FormatError(f"{what} {name!r} refused: {path} resolves outside {folder}")
    return path


def check_inside(root, path) -> Path:
    """path, if it resolves (symlinks followed) to root or somewhere below it."""
    real, top = Path(path).resolve(), Path(root).resolve()
    if real != top and top not in real.parents:
        raise FormatError(f"{path} is a symlink to {real}, outside {root}: refused, as a link out of the folder "
                          f"is followed only when asked (wsync serve --follow-symlinks)")
    return Path(path)


# -- temp files and cleaning up after a killed run ---------------------------------------------------

def temp_sibling(path, *, folder: bool = False) -> Path:
    """A new temp file or folder beside path, named so that a later run can tell it is ours and whose."""
    path = Path(path)
    prefix = f".{path.name}{TEMP_TAG}{os.getpid()}-"
    if folder:
        return Path(tempfile.mkdtemp(dir=path.parent, prefix=prefix))
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=prefix, suffix=".tmp")
    os.close(fd)
    return Path(tmp)


def clean_stale(path) -> list[Path]:
    """Remove the temp siblings of path left by wsync processes that no longer run; returns them.

    Only names temp_sibling makes are touched, and only when their process is gone
    (its pid names no live process on this machine)."""
    path = Path(path)
    pattern = re.compile(re.escape(f".{path.name}{TEMP_TAG}") + r"(\d+)-[A-Za-z0-9_]+(\.tmp)?")
    removed = []
    try:
        siblings = list(path.parent.iterdir())
    except FileNotFoundError:
        return removed
    for p in siblings:
        m = pattern.fullmatch(p.name)
        if m is None or _alive(int(m.group(1))):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    except OverflowError:
        return False
    return True


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def fsync_path(path) -> None:
    """fsync a file or a folder by name (a folder's fsync makes the renames in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class atomic_write:
    """Open a temp file beside `path`; fsync and rename it over `path` only if the block succeeds."""

    def __init__(self, path):
        self.path = Path(path)

    def __enter__(self):
        clean_stale(self.path)
        self.tmp = temp_sibling(self.path)
        self.f = open(self.tmp, "wb")
        return self.f

    def __exit__(self, exc_type, *_):
        try:
            if exc_type is None:
                self.f.flush()
                os.fsync(self.f.fileno())
        finally:
            self.f.close()
        if exc_type is not None:
            self.tmp.unlink(missing_ok=True)
            return
        os.chmod(self.tmp, 0o666 & ~_umask())  # mkstemp's 0600 would surprise whoever reads the result
        os.replace(self.tmp, self.path)
        fsync_path(self.path.parent)


# -- folders wsync owns --------------------------------------------------------------------------

def check_output(path) -> None:
    """Refuse (OutputError) an output folder path that wsync may not replace.

    Fine: nothing there, an empty folder, or a folder whose marker lists every
    file in it. Refused: a symlink, a file, any other non-empty folder."""
    path = Path(path)
    if path.is_symlink():
        raise OutputError(f"{path} is a symlink (to {path.resolve()}); wsync writes a folder of its own there. "
                          f"Give the real folder's path, or another one, as -o")
    if not path.exists():
        return
    if not path.is_dir():
        raise OutputError(f"{path} is a file, not a wsync output folder; choose another path for -o "
                          f"(or remove it yourself)")
    held = {p.name for p in path.iterdir()}
    if not held:
        return
    owned = _owned(path)
    if owned is None:
        raise OutputError(f"{path} is not empty and is not a wsync output (it has no {MARKER}); wsync replaces "
                          f"only folders it wrote. Choose a new or empty folder for -o, or empty this one yourself")
    extra = sorted(held - owned)
    if extra:
        raise OutputError(f"{path} is a wsync output but holds files wsync did not write "
                          f"({', '.join(extra[:5])}{', ...' if len(extra) > 5 else ''}); move them out, "
                          f"or choose another folder for -o")


def remove_output(path) -> None:
    """Remove a folder wsync wrote (check_output's rule: its marker lists everything in it); anything else
    stays, and OutputError says why."""
    path = Path(path)
    if not path.exists():
        return
    check_output(path)
    shutil.rmtree(path)


def _owned(path: Path) -> set[str] | None:
    """The names wsync wrote in the folder, by its marker (None: not a wsync output)."""
    marker = path / MARKER
    if not marker.is_file() or marker.is_symlink():
        held = {p.name for p in path.iterdir()}
        return set(LEGACY_PULL) if held == LEGACY_PULL else None
    try:
        with open(marker, "rb") as f:
            doc = safejson.loads(f.read(1 << 20), what=str(marker))
        files = doc["files"]
        if doc.get("written_by") != "wsync" or not all(isinstance(n, str) for n in files):
            return None
    except (ValueError, KeyError, TypeError, OSError):
        return None
    return set(files) | {MARKER}


def replace_folder(tmp: Path, path: Path) -> None:
    """Make the complete folder tmp (a temp_sibling of path) appear at path, atomically, and durably.

    tmp gets the marker first. An existing path is checked again (a person may
    have added a file since) and swapped out in one step where the system can
    (renameat2 RENAME_EXCHANGE), then removed: it held only what wsync wrote."""
    names = sorted(p.name for p in tmp.iterdir())
    with atomic_write(tmp / MARKER) as f:
        f.write(json.dumps({"written_by": "wsync", "files": names}).encode())
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 would lock out whoever serves the result
    fsync_path(tmp)
    if not os.path.lexists(path):
        os.rename(tmp, path)
    else:
        check_output(path)
        if not _exchange(tmp, path):
            old = temp_sibling(path, folder=True)
            os.rename(path, old / "old")  # out of the way; a kill here leaves it to clean_stale
            os.rename(tmp, path)
            tmp = old
        shutil.rmtree(tmp)
    fsync_path(path.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2); False where the system or filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))
