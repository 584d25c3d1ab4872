"""The shared token: where it comes from, how strong it must be, and how to name it without revealing it.

Every tcp connection proves the token with HMAC-SHA256 over fresh nonces
(transports/tcp/auth.py). A peer that connects without the token still gets
the listener's proof, an HMAC over a nonce it chose, and can test guesses
against it offline as fast as it can hash; so the token's entropy is all that
protects it. A token of fewer than ``MIN_BYTES`` bytes is refused wherever one
is given (``check``): 16 random bytes put guessing out of reach, a word does
not. Make one with ``python -c 'import secrets; print(secrets.token_hex(16))'``.

Outside Python (environment, files, command line) a token is written in hex,
as ``secrets.token_hex`` prints it, and decoded to its bytes; so
``WSYNC_TOKEN`` means the same secret to ``wsync serve``, ``wsync pull`` and
every framework integration. In Python, ``token=`` takes bytes, or a str whose
UTF-8 bytes are the secret; ``wsync.tokens.load()`` reads the hex forms.

Tokens stay off the command line: ``--token`` puts the secret in ``ps`` and
shell history, so the CLI reads ``--token-file``, ``WSYNC_TOKEN`` or
``WSYNC_TOKEN_FILE`` first and says so when ``--token`` is used.
"""
from __future__ import annotations

import hashlib
import os
import sys

from .errors import WsyncError

__all__ = ["MIN_BYTES", "TOKEN_ENV", "TOKEN_FILE_ENV", "check", "engine_token", "load", "token_id"]

TOKEN_ENV, TOKEN_FILE_ENV = "WSYNC_TOKEN", "WSYNC_TOKEN_FILE"  # hex token, or a file holding it
MIN_BYTES = 16
HOW = "python -c 'import secrets; print(secrets.token_hex(16))'"


def check(token) -> bytes | None:
    """The token's bytes (None stays None); ValueError if it is not bytes or str, or shorter than MIN_BYTES."""
    if token is None:
        return None
    if isinstance(token, str):
        token = token.encode()
    if not isinstance(token, (bytes, bytearray)):
        raise ValueError(f"a token is bytes or str, not {type(token).__name__}")
    if len(token) < MIN_BYTES:
        raise ValueError(f"the token is {len(token)} bytes; at least {MIN_BYTES} are needed, since a stranger who "
                         f"connects can test guesses offline. Make one with {HOW}")
    return bytes(token)


def _hex(text: str, where: str) -> bytes:
    try:
        token = bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError(f"the token in {where} must be hex (make one with {HOW})") from None
    if len(token) < MIN_BYTES:
        raise ValueError(f"the token in {where} is {len(token)} bytes; at least {MIN_BYTES} are needed "
                         f"({2 * MIN_BYTES} hex digits). Make one with {HOW}")
    return token


def _read_file(path: str, where: str) -> str:
    try:
        with open(path) as f:
            return f.read(4096)
    except OSError as e:
        raise ValueError(f"cannot read the token file {path} ({where}): {e.strerror or e}") from None


def load(token: str | bytes | None = None, *, token_file: str | None = None) -> bytes | None:
    """The shared token, from the first of: `token` (bytes as given; a str is hex), the file `token_file`
    names (hex), WSYNC_TOKEN (hex), the file WSYNC_TOKEN_FILE names (hex); None when none is set."""
    if isinstance(token, (bytes, bytearray)):
        return check(token)
    if token:
        return _hex(token, "the token given")
    if token_file:
        return _hex(_read_file(token_file, "--token-file"), token_file)
    if os.environ.get(TOKEN_ENV):
        return _hex(os.environ[TOKEN_ENV], TOKEN_ENV)
    if os.environ.get(TOKEN_FILE_ENV):
        path = os.environ[TOKEN_FILE_ENV]
        return _hex(_read_file(path, TOKEN_FILE_ENV), path)
    return None


def token_id(token: bytes | None) -> str | None:
    """A fingerprint of the token, safe to send and log: it names the token without revealing it."""
    if token is None:
        return None
    return hashlib.sha256(b"wsync token id\0" + token).hexdigest()[:16]


def engine_token(expected_id: str | None) -> bytes | None:
    """The engine's side of a control plane that carried only token_id: its own token, checked against the id."""
    if expected_id is None:
        return None
    token = load()
    if token is None:
        raise WsyncError(f"the trainer's publisher wants a token (id {expected_id}); give this engine the same "
                         f"token in {TOKEN_ENV} (hex) or a file named by {TOKEN_FILE_ENV}")
    if token_id(token) != expected_id:
        raise WsyncError(f"this engine's token (id {token_id(token)}) is not the trainer's (id {expected_id})")
    return token


def add_cli_options(parser, what: str) -> None:
    """--token-file and --token on a command; `what` says whose secret it is."""
    parser.add_argument("--token-file", metavar="PATH",
                        help=f"a file holding {what} in hex (default: {TOKEN_ENV}, then the file {TOKEN_FILE_ENV} "
                             "names; make one with: python -c 'import secrets; print(secrets.token_hex(16))')")
    parser.add_argument("--token", metavar="HEX",
                        help=f"{what} itself, in hex: other users of this machine can read it (ps, shell history), "
                             f"so prefer --token-file or {TOKEN_ENV}")


def from_cli(args) -> bytes | None:
    """The token a command was given (add_cli_options): --token, else --token-file, else the environment."""
    if args.token:
        print(f"wsync: --token is visible to other users of this machine (ps, shell history); "
              f"prefer --token-file or {TOKEN_ENV}", file=sys.stderr)
    return load(args.token, token_file=args.token_file)
