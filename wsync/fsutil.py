"""Writing to disk safely: atomic, durable, inside the folder it was meant for, and only over our own files.

- A reader sees the old file or folder or the whole new one, never a torn one,
  and a power cut after the rename cannot leave a renamed but empty file: data
  is fsynced before the rename, the folder holding the rename after it.
- A name that came from a payload, a peer or another file (a shard name) is a
  plain file name, checked before it becomes a path: it cannot point anywhere
  but into the folder wsync is writing.
- wsync replaces a folder only if it wrote it: its folders carry a marker file
  (``.wsync-output.json``) recording the name, size and hash of each file wsync
  put there. A folder without a valid marker, whatever its files are named, is
  refused, never emptied; so is one holding anything the marker does not
  record as it was written: another file, a changed file, a sub-folder, a
  link. Replacing removes only the recorded regular files (never through a
  link), then the empty folder: never a folder's contents wholesale.
- Temp files and folders are siblings named ``.<name>.wsync-tmp-<pid>-<random>``;
  one whose process is gone (a SIGKILLed pull) is removed by the next write of
  <name>, a folder only if it holds what such a write leaves (regular files).
  Nothing else is ever removed.
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import stat
import sys
import tempfile
import time
from pathlib import Path

import xxhash

from . import safejson
from .errors import FormatError, OutputError

MARKER = ".wsync-output.json"  # in every folder wsync writes: proof that it may replace the folder
TEMP_TAG = ".wsync-tmp-"
MAX_NAME_BYTES = 255  # a longer name is refused by the filesystem anyway; say so before it does
MAX_MARKER = 1 << 20  # a marker longer than this was not written by wsync
HASH_CHUNK = 4 << 20  # hashing reads a file through a buffer this size, never whole into memory


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
    (its pid names no live process on this machine). A temp folder goes only if it
    holds what a killed write leaves: regular files, and an output it had moved
    aside (removed by remove_output's rule); one holding anything else stays."""
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
            if not _remove_temp_folder(p):
                continue
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def _remove_temp_folder(p: Path) -> bool:
    """Remove a dead run's temp folder if it holds only what a write leaves (see clean_stale); False if not."""
    try:
        entries = list(os.scandir(p))
        aside = [e for e in entries if e.name == "old" and e.is_dir(follow_symlinks=False)]
        if any(not e.is_file(follow_symlinks=False) for e in entries if e not in aside):
            return False
        for e in aside:
            remove_output(Path(e.path))  # an output replace_folder had moved aside when it was killed
        for e in entries:
            if e not in aside:
                os.unlink(e.path)
        p.rmdir()
    except (OSError, OutputError):
        return False
    return True


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

def file_record(path) -> dict:
    """What the marker keeps of a file wsync wrote: its size and content hash, read without following a link."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        h, size = xxhash.xxh3_128(), 0
        buf = bytearray(HASH_CHUNK)
        view = memoryview(buf)
        while n := os.readv(fd, [buf]):
            h.update(view[:n])
            size += n
    finally:
        os.close(fd)
    return {"size": size, "xxh3_128": h.hexdigest()}


def check_output(path) -> None:
    """Refuse (OutputError) an output folder path that wsync may not replace.

    Fine: nothing there, an empty folder, or a folder whose marker records
    every entry in it as a regular file wsync wrote, with the size and hash
    it had then. Refused: a symlink, a file, a folder with no valid marker
    (whatever its names look like), and a folder holding anything else: a
    file the marker does not list, a changed file, a sub-folder, a link."""
    _check_owned(Path(path))


def _check_owned(path: Path) -> dict[str, dict] | None:
    """check_output's rule; returns the marker's records (None: nothing there or empty)."""
    if path.is_symlink():
        raise OutputError(f"{path} is a symlink (to {path.resolve()}); wsync writes a folder of its own there. "
                          f"Give the real folder's path, or another one, as -o")
    if not path.exists():
        return None
    if not path.is_dir():
        raise OutputError(f"{path} is a file, not a wsync output folder; choose another path for -o "
                          f"(or remove it yourself)")
    held = sorted(os.scandir(path), key=lambda e: e.name)
    if not held:
        return None
    owned = _owned(path)
    if owned is None:
        raise OutputError(f"{path} is not empty and is not a wsync output (it has no valid {MARKER} recording "
                          f"what wsync wrote there); wsync replaces only folders it wrote. Choose a new or empty "
                          f"folder for -o, or empty this one yourself")
    extra = [e.name for e in held if e.name != MARKER and e.name not in owned]
    if extra:
        raise OutputError(f"{path} is a wsync output but holds files wsync did not write "
                          f"({', '.join(extra[:5])}{', ...' if len(extra) > 5 else ''}); move them out, "
                          f"or choose another folder for -o")
    for e in held:
        if e.name != MARKER and (why := _differs(e, owned[e.name])):
            raise OutputError(f"{path}: {e.name} {why}, so wsync will not remove it; move it out, "
                              f"or choose another folder for -o")
    return owned


def _differs(entry: os.DirEntry, record: dict) -> str | None:
    """Why entry is not the regular file wsync wrote under that name (None: it is)."""
    if entry.is_symlink():
        return "is a symlink, and wsync writes only regular files"
    if entry.is_dir(follow_symlinks=False):
        return "is a folder, and wsync writes only regular files"
    if not entry.is_file(follow_symlinks=False):
        return "is not a regular file"
    if entry.stat(follow_symlinks=False).st_size != record["size"] or file_record(entry.path) != record:
        return "has changed since wsync wrote it"
    return None


def remove_output(path) -> None:
    """Remove a folder wsync wrote (check_output's rule); anything else stays, and OutputError says why.

    Only the regular files its marker records are unlinked (never through a
    link), then the marker, then the empty folder."""
    path = Path(path)
    owned = _check_owned(path)
    if owned is None:
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        return
    _remove_owned(path, owned)


def _remove_owned(path: Path, owned: dict[str, dict]) -> None:
    for name in owned:
        try:
            st = os.lstat(path / name)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            os.unlink(path / name)
    if os.path.lexists(path / MARKER):
        os.unlink(path / MARKER)
    path.rmdir()  # refuses (ENOTEMPTY) if anything appeared meanwhile: it stays


def _owned(path: Path) -> dict[str, dict] | None:
    """The files wsync wrote in the folder, by its marker: name -> {size, xxh3_128} (None: not a wsync output)."""
    try:
        fd = os.open(path / MARKER, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:  # none, or a link
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            doc = safejson.loads(f.read(MAX_MARKER), what=str(path / MARKER))
        files = doc["files"]
        if doc.get("written_by") != "wsync" or not isinstance(files, dict):
            return None
        for name, rec in files.items():
            plain_name(name)
            if not (isinstance(rec, dict) and set(rec) == {"size", "xxh3_128"} and isinstance(rec["size"], int)
                    and isinstance(rec["xxh3_128"], str)):
                return None
    except (ValueError, KeyError, TypeError, OSError, FormatError):
        return None
    return files


def replace_folder(tmp: Path, path: Path) -> None:
    """Make the complete folder tmp (a temp_sibling of path) appear at path, atomically, and durably.

    tmp gets the marker first, recording the name, size and hash of every file
    in it. An existing path is checked again (a person may have added or
    changed a file since) and swapped out in one step where the system can
    (renameat2 RENAME_EXCHANGE); then only the files its marker records are
    removed from it (remove_output's rule)."""
    records = {p.name: file_record(p) for p in sorted(tmp.iterdir())}
    with atomic_write(tmp / MARKER) as f:
        f.write(json.dumps({"written_by": "wsync", "files": records}).encode())
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 would lock out whoever serves the result
    fsync_path(tmp)
    if not os.path.lexists(path):
        os.rename(tmp, path)
    else:
        owned = _check_owned(path) or {}
        if _exchange(tmp, path):
            old = tmp
        else:
            aside = temp_sibling(path, folder=True)
            old = aside / "old"
            os.rename(path, old)  # out of the way; a kill here leaves it to clean_stale
            os.rename(tmp, path)
        try:
            _remove_owned(old, owned)
        except OSError:  # something was added to it while the new folder went in: it is not ours to remove
            kept = path.parent / f"{path.name}.wsync-kept-{os.getpid()}-{time.time_ns()}"
            os.rename(old, kept)
            print(f"wsync: {path} was replaced, but files added to the old one meanwhile are kept in {kept}",
                  file=sys.stderr)
        if old != tmp:
            old.parent.rmdir()
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
