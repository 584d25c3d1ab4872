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
