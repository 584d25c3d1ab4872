"""What the command line says: help on every option, the real `wsync` command in a subprocess, exit codes,
one-line errors without tracebacks, the cause of a failed pull, quiet normal shutdowns. Sockets on 127.0.0.1 only."""
from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import wsync
from wsync.checkpoint import Checkpoint, read_checkpoint, write_checkpoint
from wsync.cli import parser
from wsync.shadow import Shadow
from wsync.errors import TransportError
from wsync.snapshot import as_state, digest
from wsync.transports.tcp import auth

from helpers import free_port, settle
from cli_helpers import HANG, Serving, one_line_error, wsync_cli

def _model(path, seed=0):
    state = {"w": np.random.default_rng(seed).standard_normal(1000).astype(np.float32)}
    write_checkpoint(path, Checkpoint(as_state(state), None, {}))
    settle(path)
    return state


# -- `wsync` alone, help texts ---------------------------------------------------------------


@pytest.mark.parametrize("args", [[], ["bench"], ["delta"]])
def test_a_command_alone_prints_its_commands(args):
    r = wsync_cli(*args)
    assert r.returncode == 0, r.stderr
    assert "required" not in r.stderr and "usage: wsync" in r.stdout
    expected = {(): ["serve", "pull", "bench", "delta", "inspect"], ("bench",): ["codec", "transport", "all"],
                ("delta",): ["encode", "apply"]}[tuple(args)]
    assert all(f"    {name}" in r.stdout for name in expected), r.stdout


def _options(p: argparse.ArgumentParser, path: str):
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, child in a.choices.items():
                yield from _options(child, f"{path} {name}")
        elif not isinstance(a, argparse._HelpAction):
            yield path, a


def test_every_option_has_help():
    missing = [f"{cmd} {'/'.join(a.option_strings) or a.dest}" for cmd, a in _options(parser(), "wsync")
               if not a.help]
    assert not missing, missing


def test_help_names_units_and_defaults():
    helps = {(cmd, a.option_strings[0] if a.option_strings else a.dest): a.help for cmd, a in _options(parser(), "wsync")}
    assert "seconds" in helps["wsync pull", "--timeout"] and "default" in helps["wsync pull", "--timeout"]
    assert "seconds" in helps["wsync pull", "--connect-timeout"] and "default 60" in helps["wsync pull", "--connect-timeout"]
    assert "JSON" in helps["wsync inspect", "--json"]
    assert "default 1e-3" in helps["wsync loop", "--lr"] and "default" in helps["wsync loop", "--steps"]
    assert "step_0004" in helps["wsync serve", "src"]


def test_output_into_a_reader_that_left_ends_quietly():
    """`wsync plan transfer --published | head -1`: the pipe's reader is gone before wsync writes."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        r = subprocess.run([sys.executable, "-m", "wsync.cli", "plan", "transfer", "--published"], stdout=write_end,
                           stderr=subprocess.PIPE, text=True, timeout=HANG)
    finally:
        os.close(write_end)
    assert r.returncode == 128 + signal.SIGPIPE and r.stderr == "", r.stderr


def test_a_broken_pipe_that_is_not_stdout_is_an_error(monkeypatch, capsys):
    """A peer's socket that breaks mid-command is reported; only a reader of stdout that left ends quietly."""
    from wsync import cli

    def lost_peer(a):
        raise BrokenPipeError(32, "Broken pipe")

    a = cli.parser().parse_args(["inspect", "x.safetensors"])
    a.fn = lost_peer
    monkeypatch.setattr(cli, "parser", lambda: argparse.Namespace(parse_known_args=lambda argv: (a, [])))
    assert cli.main([]) == 2
    assert capsys.readouterr().err.strip() == "wsync: error: [Errno 32] Broken pipe"


def test_open_publisher_without_token_warns(caplog):
    from wsync.sync import _warn_if_open  # judged from the address alone: no socket on 0.0.0.0 in a test

    with caplog.at_level(logging.WARNING, logger="wsync.sync"):
        _warn_if_open("tcp://0.0.0.0:7070", None)
        _warn_if_open("tcp://10.1.2.3:7070", None)
    assert len(caplog.records) == 2 and all("without a token" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="wsync.sync"):
        _warn_if_open("tcp://0.0.0.0:7070", "secret")
        _warn_if_open("tcp://localhost:7070", None)
        wsync.Publisher("tcp://127.0.0.1:0").close()
    assert not caplog.records


# -- serve a single file ----------------------------------------------------------------------


def test_serve_a_single_file_and_pull_it(tmp_path):
    state = _model(tmp_path / "model.safetensors")
    (tmp_path / "token").write_text(secrets.token_hex(16))
    with Serving(tmp_path / "model.safetensors", "--token-file", tmp_path / "token") as srv:
        r = wsync_cli("pull", srv.address, "-o", tmp_path / "replica", "--token-file", tmp_path / "token")
        assert r.returncode == 0, r.stderr
        assert "holds version 0" in r.stdout
    assert digest(read_checkpoint(tmp_path / "replica").state) == digest(as_state(state))


def test_serve_a_file_that_is_not_safetensors_says_so(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    assert "not a .safetensors file" in one_line_error(wsync_cli("serve", tmp_path / "notes.txt", "--listen",
                                                                 "127.0.0.1:0", "--no-watch"))


# -- nccl on a machine without two GPUs -------------------------------------------------------


def test_nccl_bench_says_why_in_one_line_and_bench_all_says_the_same(monkeypatch):
    from wsync_bench import all as bench_all
    from wsync_bench import transport

    why = transport.nccl_unavailable()
    if why is None:
        pytest.skip("this machine can run the nccl bench")
    line = one_line_error(wsync_cli("bench", "transport", "--transport", "nccl", "--size", "1M"), code=3)
    assert why in line and "needs two CUDA GPUs" in line
    monkeypatch.setattr(transport, "run", lambda *a, **k: {})  # the other rows are not what this checks
    assert bench_all.transport_suite(bench_all.Sizes.small(), ucx=False)["nccl"] == {"skipped": why}


# -- why a pull fails -------------------------------------------------------------------------


RIGHT, WRONG = "a1" * 16, "b2" * 16  # hex, as the command line takes tokens


def test_pull_without_a_token_stops_and_says_so(tmp_path):
    _model(tmp_path / "model.safetensors")
    with Serving(tmp_path / "model.safetensors", "--token", RIGHT) as srv:
        # inf: were this refusal retried forever, this would hang (and HANG turn that into a failure)
        line = one_line_error(wsync_cli("pull", srv.address, "-o", tmp_path / "out", "--connect-timeout", "inf"))
    assert "token" in line
    assert not (tmp_path / "out").exists()


def test_pull_with_a_wrong_token_retries_then_names_it(tmp_path):
    _model(tmp_path / "model.safetensors")
    with Serving(tmp_path / "model.safetensors", "--token", RIGHT) as srv:
        # a wrong token's "no" cannot be told from a stranger's on the path, so it is not final
        line = one_line_error(wsync_cli("pull", srv.address, "-o", tmp_path / "out", "--connect-timeout", "2",
                                        "--token", WRONG))
    assert "within 2s" in line and "prove the shared token" in line
    assert not (tmp_path / "out").exists()


def test_pull_with_nothing_listening_names_the_refusal(tmp_path):
    line = one_line_error(wsync_cli("pull", f"127.0.0.1:{free_port()}", "-o", tmp_path / "out",
                                    "--connect-timeout", "2"))
    assert "announced no version within 2s" in line and "cannot connect" in line


def test_subscriber_error_and_timeout_name_the_cause():
    with wsync.Publisher("tcp://127.0.0.1:0", token=bytes.fromhex(RIGHT)) as pub:
        sub = wsync.Subscriber(pub.address, engine=Shadow(), token=bytes.fromhex(WRONG))
        try:
            with pytest.raises(TimeoutError, match="token"):
                sub.wait_for(0, timeout=2)
            assert isinstance(sub.error, TransportError) and "token" in str(sub.error)
        finally:
            sub.close()
    sub = wsync.Subscriber(f"tcp://127.0.0.1:{free_port()}", engine=Shadow())
    try:
        with pytest.raises(TimeoutError, match="cannot connect"):
            sub.wait_for(0, timeout=1)
        assert sub.error is not None and "cannot connect" in str(sub.error)
    finally:
        sub.close()


def test_a_listener_of_another_protocol_version_is_named():
    """A listener that answers the handshake with another version: the subscriber says which, and stops."""
    srv = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def answer():
        srv.settimeout(0.2)
        while not done.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                conn.recv(auth.HELLO_C.size)
                conn.sendall(auth.HELLO_S.pack(auth.MAGIC, auth.VERSION + 1, 0, bytes(32), bytes(32)))

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    sub = wsync.Subscriber(f"tcp://127.0.0.1:{srv.getsockname()[1]}", engine=Shadow())
    try:
        with pytest.raises(TransportError, match=f"protocol v{auth.VERSION + 1}"):
            sub.wait_announced(timeout=HANG)
    finally:
        sub.close()
        done.set()
        t.join(HANG)
        srv.close()


# -- a normal shutdown is not a failure -------------------------------------------------------


def test_publisher_closing_is_not_logged_as_a_failure(caplog):
    with caplog.at_level(logging.INFO, logger="wsync.sync"):
        pub = wsync.Publisher("tcp://127.0.0.1:0")
        sub = wsync.Subscriber(pub.address, engine=Shadow())
        try:
            pub.publish({"w": np.arange(1000, dtype=np.float32)}, version=0)
            sub.wait_for(0, timeout=HANG)
            pub.close()
            deadline = time.monotonic() + HANG
            while sub.error is None and time.monotonic() < deadline:  # it redialled, and found no one
                time.sleep(0.05)
            assert sub.error is not None
        finally:
            sub.close()
    said = [r for r in caplog.records if r.name == "wsync.sync"]
    assert not [r.getMessage() for r in said if r.levelno >= logging.WARNING]
    assert any("closed" in r.getMessage() for r in said)  # said, at info


def test_a_successful_pull_prints_no_failure(tmp_path):
    _model(tmp_path / "model.safetensors")
    with Serving(tmp_path / "model.safetensors") as srv:
        r = wsync_cli("pull", srv.address, "-o", tmp_path / "out")
        assert r.returncode == 0, r.stderr
    assert "digest verified" in r.stdout
    assert not any(word in r.stderr for word in ("lost", "redialling", "refused", "Traceback")), r.stderr
