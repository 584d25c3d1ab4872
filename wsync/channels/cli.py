"""`wsync hub`, `wsync promote`, `wsync rollback`, `wsync channels`: channels from the command line.

    wsync hub --follow tcp://trainer:7070 --channel prod --channel canary --control 127.0.0.1:7100 --root ./hub
    wsync promote 127.0.0.1:7100 12 --channel prod --why "eval 0.81 > 0.78"
    wsync rollback 127.0.0.1:7100 --channel prod --to 9 --why "regression in canary traffic"
    wsync channels 127.0.0.1:7100            # what each channel serves, its engines, what it can roll back to

Every command reads the shared token as `wsync serve` does (--token-file, WSYNC_TOKEN, WSYNC_TOKEN_FILE).
"""
from __future__ import annotations

import json
import signal
import sys
import threading
import time


def add_parsers(sub) -> None:
    from .. import tokens

    h = sub.add_parser("hub", help="serve channels (prod, canary, ...) of the versions a trainer's publisher sends")
    h.add_argument("--follow", required=True, help="the trainer's publisher: HOST:PORT or a full address")
    h.add_argument("--channel", action="append", metavar="NAME",
                   help="a channel to serve; repeat for more (default: prod)")
    h.add_argument("--listen", default="127.0.0.1",
                   help="host (or full address, port 0 for a free one) each channel's publisher listens on "
                        "(default 127.0.0.1)")
    h.add_argument("--control", default="127.0.0.1:0",
                   help="HOST:PORT of the control endpoint that `wsync promote` and `rollback` call "
                        "(default 127.0.0.1 on a free port)")
    h.add_argument("--root", help="folder for the kept versions and the records, so a restart resumes them "
                                  "(default: memory only)")
    h.add_argument("--keep", type=int, default=4, help="promoted versions each channel keeps for rollback (default 4)")
    h.add_argument("--candidates", type=int, default=4,
                   help="newest trained versions held for promotion (default 4)")
    tokens.add_cli_options(h, "the shared secret of the trainer's publisher, the channels and the control endpoint")
    h.set_defaults(fn=_hub)
    for name, helptext in (("promote", "make a channel serve a trained version (through its gate)"),
                           ("rollback", "make a channel serve a version it served before")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("address", help="the hub's control endpoint: HOST:PORT or tcp://HOST:PORT")
        if name == "promote":
            p.add_argument("version", type=int, help="the trained version to promote")
        else:
            p.add_argument("--to", type=int, help="the version to go back to (default: the one served before)")
        p.add_argument("--channel", default="prod", help="the channel (default prod)")
        p.add_argument("--why", default="", help="the reason, kept in the records (default: none)")
        p.add_argument("--wait", action="store_true",
                       help="return once every engine on the channel serves it (default: once it is published)")
        tokens.add_cli_options(p, "the hub's shared secret")
        p.set_defaults(fn=_decide, op=name)
    s = sub.add_parser("channels", help="what each channel of a hub serves, to whom, and what it can roll back to")
    s.add_argument("address", help="the hub's control endpoint: HOST:PORT or tcp://HOST:PORT")
    s.add_argument("--json", action="store_true", help="print the status as JSON on stdout instead of text")
    tokens.add_cli_options(s, "the hub's shared secret")
    s.set_defaults(fn=_status)


def _address(s: str) -> str:
    return s if "://" in s else f"tcp://{s}"


def _hub(a) -> None:
    from .. import tokens
    from .control import Control
    from .hub import Channels

    token = tokens.from_cli(a)
    if token is None:
        raise ValueError("wsync hub needs a token (--token-file or WSYNC_TOKEN): its control endpoint decides what "
                         "production serves")
    listen = a.listen if "://" in a.listen else f"tcp://{a.listen}:0"
    # a process manager stops the hub with SIGTERM: close its links as Ctrl-C does, rather than die mid-send.
    # (A hub started from a background job has SIGINT ignored, so SIGTERM may be the only clean way out.)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
    with Channels(a.channel or ["prod"], token=token, listen=listen, keep=a.keep, candidates=a.candidates,
                  root=a.root) as hub, Control(hub, _address(a.control), token=token) as control:
        hub.follow(_address(a.follow))
        print(f"wsync hub: control {control.address}", flush=True)
        for c in hub.channels:
            print(f"wsync hub: channel {c} at {hub.address(c)}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            print("wsync hub: stopped", file=sys.stderr)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _decide(a) -> None:
    from .. import tokens
    from .control import call

    args = {"channel": a.channel, "why": a.why, "wait": a.wait}
    if a.op == "promote":
        args["version"] = a.version
    else:
        args["to"] = a.to
    rec = call(_address(a.address), a.op, token=tokens.from_cli(a), **args)["record"]
    gate = rec.get("gate")
    print(f"{rec['channel']} serves version {rec['version']} (release {rec['release']}, {rec['kind']})"
          + (f"; gate passed in {gate['seconds']:.2f}s" if gate else ""))


def _status(a) -> None:
    from .. import tokens
    from .control import call

    st = call(_address(a.address), "status", token=tokens.from_cli(a))
    if a.json:
        print(json.dumps(st, indent=2))
        return
    print(f"candidates held: {st['candidates'] or 'none'}")
    for name, c in st["channels"].items():
        since = "-" if c["since"] is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c["since"]))
        print(f"{name:<10} version {c['version']} (release {c['release']}) since {since}, "
              f"{c['subscribers']} engines, {len(c['behind'])} behind; can roll back to {c['rollback_to'] or '-'}")
