"""Files: names from a payload never become paths outside -o, wsync never deletes what it
did not write, a killed write leaves nothing behind for long, reserved tensor names are refused, and
serve does not follow symlinks out of its folder unless told to.

Everything runs the real CLI on real files in tmp_path.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import wsync
from wsync.checkpoint import Checkpoint, read_checkpoint, write_checkpoint, write_safetensors
from wsync.cli import main as cli
from wsync.errors import FormatError
from wsync.snapshot import as_state

from conftest import rewrite_manifest
from helpers import settle

ENV = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))


def _states(rng):
    base = {"a": rng.standard_normal(300).astype(np.float32), "b": np.arange(40, dtype=np.int32)}
    new = {"a": base["a"] + np.float32(1), "b": base["b"] + 1}
    return base, new


@pytest.fixture
def pair(tmp_path, rng):
    """A base and a new checkpoint folder (two shards) and the delta between them, as files."""
    base, new = _states(rng)
    files = {"a": "model-1.safetensors", "b": "model-2.safetensors"}
    write_checkpoint(tmp_path / "base", Checkpoint(as_state(base), files, {}))
    write_checkpoint(tmp_path / "new", Checkpoint(as_state(new), files, {}))
    assert cli(["delta", "encode", str(tmp_path / "base"), str(tmp_path / "new"), "-o", str(tmp_path / "d.wsd")]) == 0
    return tmp_path, new


def _with_files(src: Path, dst: Path, files: dict) -> Path:
    """The delta at src with its manifest's output-file layout replaced by files (header re-sealed)."""
    dst.write_bytes(rewrite_manifest(src.read_bytes(), lambda doc: doc.update(files=files)))
    return dst


def _tree(root: Path) -> dict:
    """Every file under root with its bytes (symlinks not followed)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# -- names from a payload never become paths outside -o ------------------------------------------

BAD_NAMES = ["../../victim.safetensors", "../victim.safetensors", "/ABS/victim.safetensors",
             "sub/model.safetensors", "..\\victim.safetensors", "model\x00.safetensors", "",
             ".", "..", "config.json", "model.safetensors.index.json", ".hidden.safetensors"]


@pytest.mark.parametrize("bad", BAD_NAMES)
def test_delta_apply_refuses_layout_names_that_are_not_plain_shard_files(pair, capsys, bad):
    root, _ = pair
    victim_dir = root / "elsewhere"
    victim_dir.mkdir()
    (victim_dir / "victim.safetensors").write_bytes(b"precious")
    bad = bad.replace("/ABS", str(victim_dir))
    delta = _with_files(root / "d.wsd", root / "bad.wsd", {"a": bad, "b": "model-2.safetensors"})
    before = _tree(root.parent)
    out = root / "deep" / "er" / "out"
    assert cli(["delta", "apply", str(root / "base"), str(delta), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "file name" in err and "wsync: error" in err
    assert _tree(root.parent) == before  # nothing written anywhere, nothing overwritten
    assert not out.exists()


def test_sharded_index_naming_a_path_is_refused(pair, capsys):
    """A checkpoint's own index is a file too: its shard names are checked the same way."""
    root, _ = pair
    index = root / "base" / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["a"] = ".."
    index.write_text(json.dumps(doc))
    assert cli(["delta", "apply", str(root / "base"), str(root / "d.wsd"), "-o", str(root / "out")]) == 2
    assert "file name" in capsys.readouterr().err


def test_output_that_is_a_symlink_is_refused(pair, capsys):
    root, _ = pair
    target = root / "target"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    (root / "link").symlink_to(target)
    assert cli(["delta", "apply", str(root / "base"), str(root / "d.wsd"), "-o", str(root / "link")]) == 2
    assert "symlink" in capsys.readouterr().err
    assert (root / "link").is_symlink() and (target / "keep.txt").read_text() == "mine"


def test_delta_apply_writes_only_below_output(pair):
    root, new = pair
    before = {p for p in root.iterdir()}
    out = root / "out"
    assert cli(["delta", "apply", str(root / "base"), str(root / "d.wsd"), "-o", str(out)]) == 0
    assert {p for p in root.iterdir()} == before | {out}
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700
    got = read_checkpoint(out).state
    assert {n: got[n].bits.tobytes() for n in got} == {n: v.tobytes() for n, v in new.items()}


# -- never delete what wsync did not write ------------------------------------------------------

def test_delta_apply_refuses_a_folder_it_did_not_write(pair, capsys):
    root, _ = pair
    out = root / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("do not delete")
    assert cli(["delta", "apply", str(root / "base"), str(root / "d.wsd"), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "not a wsync output" in err and "choose a new or empty folder" in err.lower()
    assert _tree(out) == {"notes.txt": b"do not delete"}


def test_delta_apply_to_dot_leaves_cwd_alone(pair):
    root, _ = pair
    cwd = root / "work"
    cwd.mkdir()
    (cwd / "train.py").write_text("print('hi')")
    r = subprocess.run([sys.executable, "-m", "wsync.cli", "delta", "apply", str(root / "base"), str(root / "d.wsd"),
                        "-o", "."], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "not a wsync output" in r.stderr
    assert _tree(cwd) == {"train.py": b"print('hi')"}


def test_pull_refuses_a_folder_it_did_not_write_before_connecting(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("do not delete")
    r = subprocess.run([sys.executable, "-m", "wsync.cli", "pull", "127.0.0.1:9", "-o", str(out), "--timeout", "5"],
                       env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "not a wsync output" in r.stderr
    assert _tree(out) == {"notes.txt": b"do not delete"}


def test_wsync_output_is_replaced_but_a_file_added_to_it_is_not_deleted(pair, capsys):
    root, new = pair
    out = root / "out"
    assert cli(["delta", "apply", str(root / "base"), str(root / "d.wsd"), "-o", str(out)]) == 0
    assert (out / ".wsync-output.json").is_file()  # how wsync knows the folder is its own
    assert cli(["delta", "apply", str(root / "base"), str(root / "d.wsd"), "-o", str(out)]) == 0  # replaced
    got = read_checkpoint(out).state
    assert {n: got[n].bits.tobytes() for n in got} == {n: v.tobytes() for n, v in new.items()}
    (out / "notes.txt").write_text("added by a person")
    capsys.readouterr()
    assert cli(["delta", "apply", str(root / "base"), str(root / "d.wsd"), "-o", str(out)]) == 2
    assert "notes.txt" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "added by a person"
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # no temp litter


def test_a_folder_named_like_a_replica_but_without_a_marker_is_refused(pair, rng, capsys):
    """Exactly model.safetensors and wsync-version.json, no marker: names prove nothing, so it stays."""
    root, _ = pair
    out = root / "old-replica"
    out.mkdir()
    write_safetensors(out / "model.safetensors", as_state(_states(rng)[0]))
    (out / "wsync-version.json").write_text('{"version": 0}')
    before = _tree(out)
    assert cli(["delta", "apply", str(root / "base"), str(root / "d.wsd"), "-o", str(out)]) == 2
    assert "not a wsync output" in capsys.readouterr().err
    assert _tree(out) == before


def test_an_empty_folder_is_written_and_a_file_in_the_way_is_refused(pair, capsys):
    root, _ = pair
    (root / "empty").mkdir()
    assert cli(["delta", "apply", str(root / "base"), str(root / "d.wsd"), "-o", str(root / "empty")]) == 0
    (root / "afile").write_text("not a folder")
    assert cli(["delta", "apply", str(root / "base"), str(root / "d.wsd"), "-o", str(root / "afile")]) == 2
    assert "not a wsync output" in capsys.readouterr().err
    assert (root / "afile").read_text() == "not a folder"


# -- a killed write is cleaned up on the next run; files and folders are fsynced ---------------

def _orphan(out: Path) -> Path:
    """A temp folder exactly as a wsync writing `out` leaves it when SIGKILLed: made in a child that dies."""
    code = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from wsync.fsutil import temp_sibling
        tmp = temp_sibling(Path({str(out)!r}), folder=True)
        (tmp / "model.safetensors").write_bytes(b"x" * 1000)
        print(tmp, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGKILL, r.stderr
    tmp = Path(r.stdout.strip())
    assert tmp.is_dir() and tmp.parent == out.parent
    return tmp


def test_next_run_cleans_a_killed_runs_temp_folder_and_nothing_else(pair):
    root, _ = pair
    out = root / "out"
    orphan = _orphan(out)
    from wsync.fsutil import temp_sibling

    live = temp_sibling(out, folder=True)  # this process is alive: its temp folder is still in use
    (root / ".out.backup").mkdir()  # a person's own hidden folder, named like out
    r = subprocess.run([sys.executable, "-m", "wsync.cli", "delta", "apply", str(root / "base"), str(root / "d.wsd"),
                        "-o", str(out)], env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert not orphan.exists()
    assert live.is_dir() and (root / ".out.backup").is_dir()
    live.rmdir()


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace to see the fsync calls")
def test_every_file_and_the_folders_are_fsynced_before_the_rename(pair):
    root, _ = pair
    out, log = root / "out", root / "strace.txt"
    cmd = ["strace", "-f", "-qq", "-o", str(log), "-e", "trace=openat,fsync,fdatasync,rename,renameat,renameat2",
           sys.executable, "-m", "wsync.cli", "delta", "apply", str(root / "base"), str(root / "d.wsd"), "-o", str(out)]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "ptrace" in r.stderr:
        pytest.skip(f"strace cannot trace here: {r.stderr[:200]}")
    assert r.returncode == 0, r.stderr
    fds, synced, moved = {}, [], None  # synced: (line number, path)
    for i, line in enumerate(log.read_text().splitlines()):
        if "openat(" in line and " = " in line and '"' in line:
            fds[line.rsplit(" = ", 1)[1].split()[0]] = line.split('"')[1]
        elif "sync(" in line:
            synced.append((i, fds.get(line.split("sync(")[1].split(")")[0])))
        elif "rename" in line and f'"{out}"' in line and " = 0" in line:
            moved = i  # the new folder took out's place
    assert moved is not None
    before = {Path(p).name for i, p in synced if p and i < moved}
    for f in out.iterdir():  # each file, under its own name or the temp name it was renamed from
        assert f.name in before or any(n.startswith(f".{f.name}.wsync-tmp-") for n in before), (f.name, before)
    assert any(n.startswith(".out.wsync-tmp-") for n in before)  # the new folder itself
    assert any(p == str(root) for i, p in synced if i > moved)  # and its parent, after the rename


# -- reserved tensor names ---------------------------------------------------------------------

def test_publish_refuses_a_tensor_named_metadata():
    from wsync.sync import Publisher

    pub = Publisher("tcp://127.0.0.1:0")
    try:
        with pytest.raises(FormatError, match="__metadata__.*reserved"):
            pub.publish({"__metadata__": np.zeros(4, np.float32), "w": np.ones(4, np.float32)}, version=0)
    finally:
        pub.close()


def test_writing_safetensors_refuses_reserved_names(tmp_path):
    with pytest.raises(FormatError, match="reserved"):
        write_safetensors(tmp_path / "x.safetensors", {"__metadata__": wsync.snapshot.to_bits(np.zeros(2, np.float32))})
    assert not list(tmp_path.iterdir())


# -- serve does not follow symlinks out of its folder ------------------------------------------

def test_serve_refuses_symlinks_out_of_the_served_folder(tmp_path, rng, capsys):
    base, new = _states(rng)
    src, outside = tmp_path / "src", tmp_path / "outside"
    write_checkpoint(src / "step_0000", Checkpoint(as_state(base), None, {}))
    write_checkpoint(outside / "secret", Checkpoint(as_state(new), None, {}))
    (src / "step_0001").mkdir()
    (src / "step_0001" / "model.safetensors").symlink_to(outside / "secret" / "model.safetensors")
    (src / "step_0002").symlink_to(outside / "secret")
    (src / "step_0003").mkdir()  # a link that stays inside the folder is fine
    (src / "step_0003" / "model.safetensors").symlink_to(src / "step_0000" / "model.safetensors")
    settle(src)
    settle(outside)
    nobody = ["--no-watch", "--flush-timeout", "0.1"]  # nobody pulls here: serve says so and exits 2
    assert cli(["serve", str(src), "--listen", "127.0.0.1:0", *nobody]) == 2
    lines = capsys.readouterr().out
    assert "published version 0 " in lines and "published version 3 " in lines
    assert "published version 1 " not in lines and "published version 2 " not in lines
    assert lines.count("symlink") >= 2 and "--follow-symlinks" in lines
    assert cli(["serve", str(src), "--listen", "127.0.0.1:0", *nobody, "--follow-symlinks"]) == 2
    lines = capsys.readouterr().out
    assert all(f"published version {v} " in lines for v in range(4))
