"""Tokens: strong enough to resist offline guessing, read off the command line, and only a verified "no" is final."""
from __future__ import annotations

import json
import socket
import threading
import time

import numpy as np
import pytest

import wsync
from wsync import tokens
from wsync.checkpoint import Checkpoint, read_checkpoint, write_checkpoint
from wsync.shadow import Shadow
from wsync.errors import TransportError, peer_text
from wsync.snapshot import as_state, digest
from wsync.transports import connect, listen
from wsync.transports.tcp import auth

from cli_helpers import HANG, Serving, wsync_cli
from helpers import TOKEN, TOKEN_HEX


# -- strength ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("short", ["T", "s3cret", b"fifteen-bytes!!", "sync-test-token"])
def test_a_short_token_is_refused_everywhere_one_is_given(short):
    with pytest.raises(ValueError, match="at least 16"):
        wsync.Publisher("tcp://127.0.0.1:0", token=short)
    with pytest.raises(ValueError, match="at least 16"):
        wsync.Subscriber("tcp://127.0.0.1:9", engine=Shadow(), token=short)
    with pytest.raises(ValueError, match="at least 16"):
        listen("tcp://127.0.0.1:0", token=short)
    with pytest.raises(ValueError, match="at least 16"):
        connect("tcp://127.0.0.1:9", token=short, timeout=1)


def test_hex_tokens_from_text_need_sixteen_bytes(monkeypatch, tmp_path):
    monkeypatch.delenv(tokens.TOKEN_FILE_ENV, raising=False)
    monkeypatch.setenv(tokens.TOKEN_ENV, "ab" * 15)
    with pytest.raises(ValueError, match="15 bytes"):
        tokens.load()
    monkeypatch.setenv(tokens.TOKEN_ENV, TOKEN_HEX)
    assert tokens.load() == TOKEN
    (tmp_path / "t").write_text("not hex at all")
    with pytest.raises(ValueError, match="must be hex"):
        tokens.load(token_file=str(tmp_path / "t"))
    assert tokens.check("x" * 16) == b"x" * 16 and tokens.check(None) is None


# -- the command line reads tokens from files and the environment ---------------------------------------------------


def _model(path):
    state = {"w": np.arange(4096, dtype=np.float32)}
    write_checkpoint(path, Checkpoint(as_state(state), None, {}))
    return state


def test_serve_and_pull_read_the_token_from_the_environment_and_files(tmp_path):
    state = _model(tmp_path / "model.safetensors")
    (tmp_path / "token").write_text(TOKEN_HEX + "\n")
    with Serving(tmp_path / "model.safetensors", env={tokens.TOKEN_ENV: TOKEN_HEX}) as srv:
        # the publisher holds the token it found in WSYNC_TOKEN: a pull without one is turned away
        r = wsync_cli("pull", srv.address, "-o", tmp_path / "none", "--connect-timeout", "inf")
        assert r.returncode != 0 and "token" in r.stderr.strip().splitlines()[-1]
        r = wsync_cli("pull", srv.address, "-o", tmp_path / "by-file", env={tokens.TOKEN_FILE_ENV: str(tmp_path / "token")})
        assert r.returncode == 0, r.stderr
        r = wsync_cli("pull", srv.address, "-o", tmp_path / "by-flag", "--token-file", tmp_path / "token")
        assert r.returncode == 0, r.stderr
        assert "visible to other users" not in r.stderr
    for out in ("by-file", "by-flag"):
        assert digest(read_checkpoint(tmp_path / out).state) == digest(as_state(state))
    assert not (tmp_path / "none").exists()


def test_a_token_on_the_command_line_works_and_says_it_is_visible(tmp_path):
    _model(tmp_path / "model.safetensors")
    with Serving(tmp_path / "model.safetensors", "--token", TOKEN_HEX) as srv:
        r = wsync_cli("pull", srv.address, "-o", tmp_path / "out", "--token", TOKEN_HEX)
    assert r.returncode == 0, r.stderr
    assert "visible to other users" in r.stderr and "visible to other users" in srv.stderr


def test_a_short_token_on_the_command_line_is_refused_with_how_to_make_one(tmp_path):
    _model(tmp_path / "model.safetensors")
    r = wsync_cli("serve", tmp_path / "model.safetensors", "--listen", "127.0.0.1:0", "--no-watch", "--token", "ab12")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "at least 16" in r.stderr and "token_hex(16)" in r.stderr


# -- only a MAC-verified refusal is final ----------------------------------------------------------------------------


def _fake_listener(answer) -> tuple[str, threading.Thread]:
    """A listener that reads one client hello and answers with answer(client_nonce) (bytes), then hangs up."""
    srv = socket.create_server(("127.0.0.1", 0))

    def run():
        conn, _ = srv.accept()
        with conn, srv:
            hello = auth.read_exact(conn, auth.HELLO_C.size, "test", _soon())
            conn.sendall(answer(auth.HELLO_C.unpack(hello)[2], conn))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return srv.getsockname()[1], t


def _soon() -> float:
    return time.monotonic() + HANG


def _handshake(port: int, token):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        return auth.client_handshake(s, token, {"op": "open"}, "peer", _soon())


def _hello(magic=auth.MAGIC, version=auth.VERSION, token=TOKEN):
    def answer(nc, conn):
        ns = bytes(32)
        mac = auth._mac(token, b"wsync-server", nc, ns) if token else bytes(32)
        return auth.HELLO_S.pack(magic, version, token is not None, ns, mac)
    return answer


ESCAPE = "\x1b[2J\x1b[Hforged\nwsync: all good"


def _refusal(mac: bool, token=TOKEN):
    """A hello that proves `token`, then {"ok": false} with a MAC (the publisher's) or without (anyone's)."""
    def answer(nc, conn):
        ns = bytes(32)
        hello = auth.HELLO_S.pack(auth.MAGIC, auth.VERSION, token is not None, ns,
                                  auth._mac(token, b"wsync-server", nc, ns) if token else bytes(32))
        conn.sendall(hello)
        proof_len = auth.MAC_SIZE
        auth.read_exact(conn, proof_len, "test", _soon())
        (n,) = auth.LEN.unpack(auth.read_exact(conn, auth.LEN.size, "test", _soon()))
        auth.read_exact(conn, n + auth.MAC_SIZE, "test", _soon())
        body = json.dumps({"ok": False, "error": ESCAPE * 20}).encode()
        tag = auth.Keys(token, nc, ns).tag(b"wsync-reply", body) if (mac and token) else bytes(32)
        return auth.LEN.pack(len(body)) + body + tag
    return answer


@pytest.mark.parametrize("answer", [_hello(magic=b"HTTP"), _hello(version=auth.VERSION + 1), _hello(token=None),
                                    _hello(token=b"someone-elses-token"), _refusal(mac=False)],
                         ids=["magic", "version", "no-auth", "no-proof", "unsigned-no"])
def test_with_a_token_an_unverified_refusal_is_transient(answer):
    port, t = _fake_listener(answer)
    with pytest.raises(TransportError) as e:
        _handshake(port, TOKEN)
    assert not isinstance(e.value, auth.Refused)  # retried by every caller, not taken as final
    t.join(HANG)


def test_a_verified_refusal_is_final_and_its_text_is_made_safe():
    port, t = _fake_listener(_refusal(mac=True))
    with pytest.raises(auth.Refused) as e:
        _handshake(port, TOKEN)
    t.join(HANG)
    text = str(e.value)
    assert "\x1b" not in text and "\n" not in text and "forged" in text
    assert len(text) < 400  # the peer's part is cut to PEER_TEXT_MAX characters


def test_without_a_token_a_refusal_is_believed_but_its_text_is_made_safe():
    port, t = _fake_listener(_refusal(mac=False, token=None))
    with pytest.raises(auth.Refused) as e:
        _handshake(port, None)
    t.join(HANG)
    assert "\x1b" not in str(e.value) and "\n" not in str(e.value)


def test_peer_text_strips_control_characters_and_cuts():
    assert peer_text("a\x1b[2Jb\r\nc\x7f\x9bd") == "a [2Jb  c  d"
    assert peer_text("x" * 500) == "x" * 200 + "..."


class _ForgingRelay:
    """Forwards to a publisher, but on its first `forge` connections replaces the publisher's reply with a forged
    {"ok": false}: what a relay on the path without the token can do."""

    def __init__(self, port: int, forge: int):
        self.port, self.forge, self.forged = port, forge, 0
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.srv.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            u = socket.create_connection(("127.0.0.1", self.port))
            if self.forged < self.forge:
                self.forged += 1
                threading.Thread(target=self._forge, args=(c, u), daemon=True).start()
            else:
                for a, b in ((c, u), (u, c)):
                    threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a, b):
        try:
            while data := a.recv(1 << 16):
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    @staticmethod
    def _forge(c, u):
        inf = _soon()
        with c, u:
            u.sendall(auth.read_exact(c, auth.HELLO_C.size, "c", inf))
            c.sendall(auth.read_exact(u, auth.HELLO_S.size, "u", inf))
            head = auth.read_exact(c, auth.MAC_SIZE + auth.LEN.size, "c", inf)
            (n,) = auth.LEN.unpack(head[auth.MAC_SIZE:])
            u.sendall(head + auth.read_exact(c, n + auth.MAC_SIZE, "c", inf))
            body = json.dumps({"ok": False, "error": ESCAPE}).encode()
            c.sendall(auth.LEN.pack(len(body)) + body + bytes(auth.MAC_SIZE))

    def close(self):
        self.srv.close()


def test_a_relay_forging_refusals_does_not_stop_a_subscriber_with_the_token():
    state = {"w": np.arange(1000, dtype=np.float32)}
    with wsync.Publisher("tcp://127.0.0.1:0", token=TOKEN) as pub:
        relay = _ForgingRelay(int(pub.address.rsplit(":", 1)[1]), forge=6)
        engine = Shadow()
        sub = wsync.Subscriber(relay.address, engine=engine, token=TOKEN, retry_s=0.05)
        try:
            pub.publish(state, version=1)
            assert sub.wait_for(1, timeout=HANG) == 1  # more forged refusals than GIVE_UP: none was taken as final
            assert relay.forged == 6
            assert engine.state["w"].bits.tobytes() == state["w"].tobytes()
        finally:
            sub.close()
            relay.close()


def test_token_reaches_no_log_or_error(caplog):
    secret = "do-not-print-this-token"
    with pytest.raises(ValueError) as e:
        tokens.load(secret)
    assert secret not in str(e.value)
    with pytest.raises(ValueError) as e:
        tokens.check(secret[:8])
    assert secret[:8] not in str(e.value)
