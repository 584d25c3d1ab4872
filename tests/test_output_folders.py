"""Output folders: wsync removes only the regular files it wrote and can recognise, never a folder's contents
wholesale, never through a link; a folder with no marker is never replaced; `delta apply` copies no file from
outside its base folder. Real files in tmp_path, the real command line."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from wsync.checkpoint import Checkpoint, read_checkpoint, write_checkpoint
from wsync.cli import main as cli
from wsync.errors import OutputError
from wsync.fsutil import MARKER, file_record, remove_output
from wsync.serve import pull
from wsync.snapshot import as_state


def _tree(root: Path) -> dict:
    """Every entry under root: a file's bytes, a link's target, a folder as None (links not followed)."""
    out = {}
    for p in sorted(root.rglob("*")):
        key = str(p.relative_to(root))
        out[key] = os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else None
    return out


@pytest.fixture
def pair(tmp_path, rng):
    """A base checkpoint folder, a new one, and the delta between them."""
    base = {"a": rng.standard_normal(300).astype(np.float32)}
    new = {"a": base["a"] + np.float32(1)}
    write_checkpoint(tmp_path / "base", Checkpoint(as_state(base), None, {}))
    write_checkpoint(tmp_path / "new", Checkpoint(as_state(new), None, {}))
    assert cli(["delta", "encode", str(tmp_path / "base"), str(tmp_path / "new"), "-o", str(tmp_path / "d.wsd")]) == 0
    return tmp_path, new


def _apply(root: Path, out: Path, base: Path | None = None) -> int:
    return cli(["delta", "apply", str(base or root / "base"), str(root / "d.wsd"), "-o", str(out)])


def _crafted(out: Path, files: dict) -> None:
    """A marker as a person (or a hostile archive) could write one: any names, any records."""
    (out / MARKER).write_text(json.dumps({"written_by": "wsync", "files": files}))


def test_a_crafted_marker_cannot_make_pull_delete_user_files_or_a_folder(tmp_path):
    out = tmp_path / "out"
    (out / "data").mkdir(parents=True)
    (out / "data" / "shard-0.bin").write_bytes(b"user data" * 100)
    (out / "notes.txt").write_text("mine")
    fake = {"size": 4, "xxh3_128": "0" * 32}
    _crafted(out, {"notes.txt": fake, "data": fake})
    before = _tree(out)
    with pytest.raises(OutputError, match="notes.txt has changed|data is a folder"):
        pull("tcp://127.0.0.1:9", out, connect_timeout=1, progress=False)  # refused before connecting
    assert _tree(out) == before


def test_a_marker_recording_the_true_hash_of_a_folder_entry_still_cannot_remove_it(tmp_path):
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "sub" / "keep.txt").write_text("mine")
    (out / "model.safetensors").write_bytes(b"x" * 64)
    _crafted(out, {"model.safetensors": file_record(out / "model.safetensors"),
                   "sub": {"size": 0, "xxh3_128": "0" * 32}})
    with pytest.raises(OutputError, match="sub is a folder"):
        remove_output(out)
    assert (out / "sub" / "keep.txt").read_text() == "mine" and (out / "model.safetensors").exists()


def test_a_marker_without_file_hashes_is_not_proof(pair, capsys):
    """A list of names, as anyone can write: refused, nothing removed."""
    root, _ = pair
    out = root / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"precious")
    (out / MARKER).write_text(json.dumps({"written_by": "wsync", "files": ["model.safetensors"]}))
    assert _apply(root, out) == 2
    assert "not a wsync output" in capsys.readouterr().err
    assert (out / "model.safetensors").read_bytes() == b"precious"


def test_a_replica_like_folder_with_no_marker_is_refused_by_pull(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"not written by wsync")
    (out / "wsync-version.json").write_text('{"version": 0}')
    before = _tree(out)
    with pytest.raises(OutputError, match="not a wsync output"):
        pull("tcp://127.0.0.1:9", out, connect_timeout=1, progress=False)
    assert _tree(out) == before


def test_a_file_changed_or_swapped_for_a_link_since_wsync_wrote_it_stays(pair, capsys):
    root, new = pair
    out = root / "out"
    assert _apply(root, out) == 0
    marker = json.loads((out / MARKER).read_text())
    assert marker["files"]["model.safetensors"] == file_record(out / "model.safetensors")  # name, size, hash
    outside = root / "outside.bin"
    outside.write_bytes(b"elsewhere")
    (out / "model.safetensors").unlink()
    (out / "model.safetensors").symlink_to(outside)
    assert _apply(root, out) == 2
    assert "symlink" in capsys.readouterr().err
    assert outside.read_bytes() == b"elsewhere" and (out / "model.safetensors").is_symlink()
    (out / "model.safetensors").unlink()
    (out / "model.safetensors").write_bytes(b"edited by a person")
    assert _apply(root, out) == 2
    assert "changed since wsync wrote it" in capsys.readouterr().err
    assert (out / "model.safetensors").read_bytes() == b"edited by a person"


def test_replacing_its_own_output_removes_exactly_what_it_wrote(pair):
    root, new = pair
    out = root / "out"
    assert _apply(root, out) == 0
    assert _apply(root, out) == 0  # its own folder, untouched since: replaced
    got = read_checkpoint(out).state
    assert {n: got[n].bits.tobytes() for n in got} == {n: v.view(np.uint32).tobytes() for n, v in new.items()}
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == []  # no temp litter
    remove_output(out)
    assert not out.exists()


def test_delta_apply_does_not_copy_a_base_file_through_a_link_out_of_the_base(pair, capsys):
    root, _ = pair
    secret = root / "secret.txt"
    secret.write_text("private key material")
    (root / "base" / "config.json").symlink_to(secret)
    (root / "base" / "real_tokenizer.json").write_text("{}")
    (root / "base" / "tokenizer.json").symlink_to(root / "base" / "real_tokenizer.json")  # inside: fine
    out = root / "out"
    assert _apply(root, out) == 0
    assert "not copying config.json" in capsys.readouterr().err
    assert not (out / "config.json").exists()
    assert (out / "tokenizer.json").read_text() == "{}" and not (out / "tokenizer.json").is_symlink()


def test_a_folder_named_like_a_dead_runs_temp_folder_is_emptied_only_of_plain_files(pair):
    """What a killed write leaves (regular files) goes; a sub-folder or a link in it means it is not that, and it
    all stays."""
    import subprocess

    root, _ = pair
    out = root / "out"
    dead = subprocess.Popen(["true"])  # a pid whose process is gone
    dead.wait()
    mine = root / f".out.wsync-tmp-{dead.pid}-abc123"
    (mine / "photos").mkdir(parents=True)
    (mine / "photos" / "cat.jpg").write_bytes(b"meow")
    (mine / "notes.txt").write_text("mine")
    left = root / f".out.wsync-tmp-{dead.pid}-def456"
    left.mkdir()
    (left / "model.safetensors").write_bytes(b"half written")
    assert _apply(root, out) == 0
    assert _tree(mine) == {"photos": None, "photos/cat.jpg": b"meow", "notes.txt": b"mine"}
    assert not left.exists()
