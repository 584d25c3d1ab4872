"""Test helpers for tcp://: a loopback proxy that cuts, damages or refuses connections, and a self-signed cert."""
from __future__ import annotations

import datetime
import socket
import subprocess
import threading


class Proxy:
    """Forwards 127.0.0.1:port -> target port. Bytes are counted per direction over all connections:
    "down" is listener -> dialler, "up" the reverse.

    cut_after: when that direction has carried this many bytes, kill every connection (once).
    flip_at: flip one byte at this offset of that direction's traffic (once).
    damage_all: flip a byte in every chunk of >= 4 KiB in that direction (persistent damage).
    refuse: close new connections at once (a path that stays down).
    """

    def __init__(self, target_port: int, *, direction: str = "down", cut_after: int | None = None,
                 flip_at: int | None = None, damage_all: bool = False):
        self.target = target_port
        self.direction, self.cut_after, self.flip_at, self.damage_all = direction, cut_after, flip_at, damage_all
        self.refuse = False
        self.cuts = 0
        self.count = {"up": 0, "down": 0}
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.port = self._srv.getsockname()[1]
        self.address = f"tcp://127.0.0.1:{self.port}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self._closed:
            try:
                c, _ = self._srv.accept()
            except OSError:
                return
            if self.refuse:
                c.close()
                continue
            try:
                u = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                c.close()
                continue
            with self._lock:
                self._pairs.append((c, u))
            threading.Thread(target=self._pump, args=(c, u, "up"), daemon=True).start()
            threading.Thread(target=self._pump, args=(u, c, "down"), daemon=True).start()

    def _pump(self, src, dst, d):
        while True:
            try:
                data = bytearray(src.recv(1 << 16))
            except OSError:
                break
            if not data:
                break
            cut = False
            with self._lock:
                start = self.count[d]
                self.count[d] += len(data)
                if d == self.direction:
                    if self.flip_at is not None and start <= self.flip_at < start + len(data):
                        data[self.flip_at - start] ^= 0x40
                        self.flip_at = None
                    if self.damage_all and len(data) >= 4096:
                        data[len(data) // 2] ^= 0x01
                    if self.cut_after is not None and self.count[d] >= self.cut_after:
                        self.cut_after, cut = None, True
            if cut:
                self.cut_all()
                break
            try:
                dst.sendall(data)
            except OSError:
                break
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut_all(self):
        """Kill every live connection (both ends see it at once)."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
            self.cuts += 1
        for pair in pairs:
            for s in pair:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self):
        self._closed = True
        self._srv.close()
        self.cut_all()


def self_signed(tmp_path, host: str = "127.0.0.1") -> tuple[str, str]:
    """(cert.pem, key.pem) for host: cryptography if installed, else the openssl CLI; skip if neither."""
    import pytest

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        try:
            subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                            "-nodes", "-days", "2", "-subj", f"/CN={host}", "-addext", f"subjectAltName=IP:{host}",
                            "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError) as e:
            pytest.skip(f"no way to make a test certificate (cryptography missing, openssl failed: {e})")
        return str(cert), str(key)
    import ipaddress

    k = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.timezone.utc)
    c = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(k.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=2))
         .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]), critical=False)
         .sign(k, hashes.SHA256()))
    cert.write_bytes(c.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    return str(cert), str(key)


class RecordRelay:
    """A man in the middle on loopback that speaks the tcp:// record format and lacks the token.

    It relays every connection between dialler and listener. Bytes from the
    dialler pass untouched; on the listener -> dialler side it skips the
    handshake (which it cannot forge) and parses the records after it, then
    does `action` once, to the first FRAME record of at least 1 KiB:

    rewrite: change body bytes and recompute the body's and the header's xxh3, as an attacker would;
    drop: leave the record out; repeat: send it twice; swap: send it after the next FRAME record.

    A record MAC it cannot compute, so it passes tags through as they came
    (tag: bytes of each tag, 0 on a link without them).
    """

    def __init__(self, target_port: int, action: str, tag: int = 0):
        from wsync.transports.tcp import auth

        self.target, self.action, self.tag = target_port, action, tag
        self.reply_tag = getattr(auth, "MAC_SIZE", 0)  # handshake v2 ends the server's reply with a MAC
        self.hello = auth.HELLO_S.size
        self.done = False  # the action happened
        self._lock = threading.Lock()
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self._srv.getsockname()[1]}"
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self._srv.accept()
                u = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                return
            self._socks += [c, u]
            threading.Thread(target=self._pass, args=(c, u), daemon=True).start()
            threading.Thread(target=self._records, args=(u, c), daemon=True).start()

    @staticmethod
    def _pass(src, dst):
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        _shut(src, dst)

    def _records(self, src, dst):
        from wsync.transports.tcp import frames as tf

        try:
            dst.sendall(_exact(src, self.hello))
            n = _exact(src, 4)
            dst.sendall(n + _exact(src, int.from_bytes(n, "little") + self.reply_tag))
            held = None  # swap: a record held back until the next FRAME has gone
            while True:
                head = _exact(src, tf.REC_SIZE + self.tag)
                rec = tf.unpack(head[: tf.REC_SIZE])
                body = _exact(src, rec.length + (self.tag if rec.length else 0))
                now = head + body
                if rec.type == tf.FRAME and rec.length >= 1024:
                    now, held = self._act(rec, head, body, held)
                dst.sendall(now)
        except (OSError, EOFError):
            pass
        _shut(src, dst)

    def _act(self, rec, head: bytes, body: bytes, held):
        """(bytes to forward now, a record to hold back) in place of this FRAME record."""
        import xxhash
        from wsync.transports.tcp import frames as tf

        if held is not None:
            return head + body + held, None
        with self._lock:
            first, self.done = not self.done, True
        if not first:
            return head + body, None
        if self.action == "drop":
            return b"", None
        if self.action == "repeat":
            return (head + body) * 2, None
        if self.action == "swap":
            return b"", head + body
        data = bytearray(body[: rec.length])  # rewrite: the values an attacker wants, checksums that agree
        for i in range(0, len(data), 997):
            data[i] ^= 0x5A
        rec.body_sum = xxhash.xxh3_64_intdigest(bytes(data))
        return tf.pack(rec) + head[tf.REC_SIZE:] + bytes(data) + body[rec.length:], None

    def close(self):
        self._srv.close()
        for s in self._socks:
            _shut(s)


def _exact(sock, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _shut(*socks):
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
