"""One exception tree for everything wsync raises on purpose.

Callers catch ``WsyncError`` to mean "the update was refused and nothing was
changed"; the subclasses say why, so a subscriber can decide between asking for
a keyframe (VersionError), re-fetching (ChecksumError) or giving up (FormatError).
"""


class WsyncError(Exception):
    """Base of every error wsync raises deliberately."""


class FormatError(WsyncError):
    """Bytes that do not parse: bad magic, unknown version, lengths that lie, truncation."""


class ChecksumError(WsyncError):
    """Bytes that parse but whose checksum does not match what the manifest promised."""


class VersionError(WsyncError):
    """A payload made against another base (version or content) than the one offered."""


class MismatchError(WsyncError):
    """Tensor sets disagree: missing or extra names, or a shape/dtype that differs."""


class TransportError(WsyncError):
    """A connection failed, timed out, or the peer broke the protocol."""


class EngineError(WsyncError):
    """The serving framework failed to take a version (its own exception is the __cause__)."""


class BackendUnavailable(WsyncError):
    """A backend or optional dependency was asked for but cannot be loaded here."""


class SnapshotError(WsyncError):
    """publish() failed while copying a state, so the version it was taking does not exist."""


class OutputError(WsyncError):
    """An output path wsync will not write over: a folder it did not write, a file, a symlink."""


class JSONError(FormatError, ValueError):
    """JSON from a peer or a file that does not parse, or nests deeper or runs longer than wsync allows.

    Also a ValueError, so code that already turns json's own ValueError into its
    error (a TransportError for a bad message header) treats it the same way.
    """


class NotHeld(WsyncError, KeyError):
    """A version asked for that is not (or no longer) held: evicted, never committed, being overwritten; the
    message names the versions that are."""

    def __str__(self) -> str:  # KeyError's own would quote the message
        return str(self.args[0]) if self.args else ""


PEER_TEXT_MAX = 200


def peer_text(text, limit: int = PEER_TEXT_MAX) -> str:
    """Text a peer sent, fit to put in an error or a log line: control characters (a terminal's escapes, line
    breaks that would forge log lines) become spaces, and at most `limit` characters are kept."""
    s = "".join(" " if (ord(c) < 32 or 127 <= ord(c) < 160) else c for c in str(text))
    return s if len(s) <= limit else s[:limit] + "..."
