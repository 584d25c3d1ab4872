"""The `wsync` command line.

    wsync delta encode BASE NEW -o OUT.wsd [--tier sparse|packed]
    wsync delta apply BASE DELTA -o OUT
    wsync inspect FILE [--json]
    wsync bench SUITE ...   (the suites of wsync-bench: pip install -e ./benchmarks)
    wsync backend
    wsync --version
    wsync serve SRC --listen HOST:PORT / wsync pull ADDRESS -o OUT   (serve.py)

BASE, NEW and OUT are .safetensors files or Hugging Face checkpoint folders.
`wsync` (or `wsync bench`, ...) alone prints the list of commands.
Exit status: 0 done; 2 an error, said in one line (also a usage error);
3 this machine lacks what the command needs (BackendUnavailable: a GPU, NCCL,
an optional package), said in one line; 130 interrupted (Ctrl-C).
Nothing is written unless every check passed.
An OUT folder must be new, empty, or one wsync wrote (it holds .wsync-output.json
listing wsync's files, and nothing else): wsync never empties a folder of yours.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import select
import signal
import stat
import sys
import time
from pathlib import Path

from .errors import BackendUnavailable, WsyncError


def _delta_encode(a) -> None:
    from .api import encode, inspect

    t = time.perf_counter()
    payload = encode(a.base, a.new, codec=a.codec, tier=a.tier, version=a.version, base_version=a.base_version, level=a.level)
    payload.write(a.output)
    s = inspect(payload)
    print(f"wrote {a.output}: {s['payload_bytes']:,} bytes, {s['ratio']:.1f}x smaller than raw, "
          f"{s['density']:.3%} changed, {time.perf_counter() - t:.2f}s")


def _delta_apply(a) -> None:
    from .api import apply_to_checkpoint
    from .checkpoint import prepare_output

    t = time.perf_counter()
    prepare_output(a.output)  # refuse before the work, not after it
    apply_to_checkpoint(a.base, a.delta, a.output)
    print(f"wrote {a.output} (all checksums verified), {time.perf_counter() - t:.2f}s")


def _inspect(a) -> None:
    from .api import inspect

    s = inspect(a.file)
    if a.json:
        print(json.dumps(s, indent=2))
        return
    print(f"codec     {s['codec']}" + (f" ({s['tier']})" if s["tier"] else ""))
    print(f"version   {s['version']}  base {s['base_version']}")
    print(f"tensors   {s['tensors']}  ({', '.join(f'{k}: {v}' for k, v in s['kinds'].items())})")
    print(f"elements  {s['elements']:,}  changed {s['changed']:,} ({s['density']:.4%})")
    print(f"size      {s['payload_bytes']:,} bytes vs {s['model_bytes']:,} raw: {s['ratio']:.2f}x")
    if s["bits_per_changed"] is not None:
        print(f"          {s['bits_per_changed']:.2f} bits per changed element")
    print(f"header    {s['header_bytes']:,} bytes")
    for part, n in s["parts"].items():
        print(f"  {part:<9} {n:>14,} bytes")


def _bench_missing(a) -> None:
    raise BackendUnavailable("wsync bench needs wsync-bench, which is not installed: "
                             "pip install -e ./benchmarks (from a wsync checkout)")


def _backend(a) -> None:
    from .backends import backend

    print(backend())


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line like every other error (the usage block of a command with many options
    buries the line that says what was wrong); subcommand parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} -h` lists the options)\n")


def version() -> str:
    """The installed distribution's version; the package's own where wsync runs from a checkout not installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("wsync")
    except PackageNotFoundError:
        from . import __version__

        return __version__


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="wsync", description="Move trainer weights into rollout engines, bit-exact.",
                epilog="wsync COMMAND -h describes each command and its options.")
    p.add_argument("--version", action="version", version=f"wsync {version()}", help="print wsync's version and exit")
    sub = p.add_subparsers(dest="cmd", title="commands", metavar="COMMAND")

    delta = sub.add_parser("delta", help="encode or apply a delta between checkpoints").add_subparsers(
        dest="op", title="commands", metavar="COMMAND")
    e = delta.add_parser("encode", help="encode NEW against BASE")
    e.add_argument("base", type=Path, help="the checkpoint the engine holds: a .safetensors file or a checkpoint folder")
    e.add_argument("new", type=Path, help="the checkpoint to send, same tensor names, shapes and dtypes")
    e.add_argument("-o", "--output", type=Path, required=True, help="payload file to write (.wsd)")
    e.add_argument("--tier", choices=["sparse", "packed", "v2"], default="packed",
                   help="packed: small, for TCP/WAN; v2: about 1.5x smaller than packed, 3x slower to apply "
                        "(slow links; docs/codec_v2.md); sparse: fixed width, fastest to apply (default packed)")
    e.add_argument("--codec", choices=["delta", "raw"], default="delta",
                   help="delta: only what changed; raw: all of NEW, applies without BASE (default delta)")
    e.add_argument("--version", type=int, help="version number recorded in the payload (default: none)")
    e.add_argument("--base-version", type=int, help="version number of BASE recorded in the payload (default: none)")
    e.add_argument("--level", type=int, default=1, help="zstd level of the packed tier (default 1)")
    e.set_defaults(fn=_delta_encode)
    ap = delta.add_parser("apply", help="apply DELTA to BASE and write OUT")
    ap.add_argument("base", type=Path, help="the checkpoint the delta was made against")
    ap.add_argument("delta", type=Path, help="payload file from `wsync delta encode`")
    ap.add_argument("-o", "--output", type=Path, required=True,
                    help="checkpoint to write: a new or empty folder, one wsync wrote, or a .safetensors file")
    ap.set_defaults(fn=_delta_apply)

    i = sub.add_parser("inspect", help="describe a payload file")
    i.add_argument("file", type=Path, help="payload file (.wsd)")
    i.add_argument("--json", action="store_true", help="print the description as JSON on stdout instead of text")
    i.set_defaults(fn=_inspect)

    bench = sub.add_parser("bench", help="benchmarks (wsync-bench: pip install -e ./benchmarks)")
    adders = _commands_of("bench")
    if adders:
        suites = bench.add_subparsers(dest="suite", title="benchmarks", metavar="BENCHMARK")
        for add in adders:
            add(suites)
    else:  # any arguments go to the one line that says what to install
        bench.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        bench.set_defaults(fn=_bench_missing)

    b = sub.add_parser("backend", help="which codec backend runs, and why")
    b.set_defaults(fn=_backend)
    for mod in EXTENSIONS:
        importlib.import_module(mod).add_parsers(sub)
    _help_when_incomplete(p)
    return p


def _commands_of(command: str) -> list:
    """What other distributions add to `command` (entry point group `wsync.commands`, named after the command
    they extend; each a function taking its subparsers): wsync-bench adds the suites of `wsync bench` so.
    Empty where none is installed, or one is installed but its package does not import."""
    from importlib.metadata import entry_points

    adders, seen = [], set()
    for ep in entry_points(group="wsync.commands", name=command):
        if ep.value in seen:  # the same distribution found twice on sys.path (a checkout and a build of it)
            continue
        seen.add(ep.value)
        try:
            adders.append(ep.load())
        except ModuleNotFoundError as e:
            if not e.name or not (ep.module == e.name or ep.module.startswith(e.name + ".")):
                raise  # the package is there but needs another that is not: its traceback is worth seeing
    return adders


def _help_when_incomplete(p: argparse.ArgumentParser) -> None:
    """`wsync`, `wsync bench`, ... alone print their help (the commands they take), not a usage error."""
    p.set_defaults(parser_of=p)  # the chosen command's own wins: what an unrecognized argument is reported by
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            action.required = False
            p.set_defaults(fn=None, help_of=p)  # a chosen command's own defaults override these
            for child in action.choices.values():
                _help_when_incomplete(child)


# Modules that add their own commands with add_parsers(subparsers). They must
# import nothing heavy at module level: the parser is built on every call.
EXTENSIONS = ["wsync.serve", "wsync.channels.cli", "wsync.demo", "wsync.plan.cli", "trainer.cli"]


# Optional packages and the extra of pyproject.toml that brings each: a command that needs one that does not
# import here says what to install (exit 3) rather than ending in a traceback.
EXTRAS = {"torch": "torch", "transformers": "hf", "safetensors": "hf", "ucxx": "ucx", "cupy": "cuda",
          "prometheus_client": "metrics", "ray": "ray"}


def _missing_extra(e: ModuleNotFoundError, a) -> str | None:
    """`wsync loop needs transformers ...: pip install ...` for a missing optional package; None for any
    other missing module (a broken install or a bug: its traceback is worth seeing)."""
    name = (e.name or "").split(".")[0]
    hint = getattr(a, "install_hint", None)  # a command of another distribution names its own extras
    install = hint(name) if hint else None
    if install is None:
        if name not in EXTRAS:
            return None
        install = f'pip install -e ".[{EXTRAS[name]}]"'
    return f"{a.parser_of.prog} needs {name}, which does not import here ({e}): {install}"


def main(argv=None) -> int:
    a, extra = parser().parse_known_args(argv)
    if extra and a.fn is not _bench_missing:
        a.parser_of.error(f"unrecognized arguments: {' '.join(extra)}")
    if a.fn is None:
        a.help_of.print_help()
        return 0
    from . import progress

    # bars off with --quiet, and with a --json flag that puts JSON on stdout (a --json FILE leaves them on)
    progress.configure(quiet=getattr(a, "quiet", False) or getattr(a, "json", None) is True)
    try:
        code = a.fn(a)  # None, or the exit status of a command with more outcomes than done or failed
        sys.stdout.flush()  # here, so a reader that left (`| head`) is seen below and not at interpreter exit
    except BrokenPipeError as e:
        if not _stdout_reader_left():
            print(f"wsync: error: {e}", file=sys.stderr)
            return 2
        # the reader of our output left, as `| head` does: stop quietly, as a filter does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's own flush must not fail again
        return 128 + signal.SIGPIPE
    except BackendUnavailable as e:
        print(f"wsync: unavailable here: {e}", file=sys.stderr)
        return 3
    except ModuleNotFoundError as e:
        why = _missing_extra(e, a)
        if why is None:
            raise
        print(f"wsync: unavailable here: {why}", file=sys.stderr)
        return 3
    except (WsyncError, OSError, TypeError, ValueError) as e:
        print(f"wsync: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("wsync: interrupted", file=sys.stderr)
        return 130
    return code or 0


def _stdout_reader_left() -> bool:
    """Whether stdout is a pipe whose reading end is closed (a broken pipe of a socket is an error to report)."""
    try:
        if not stat.S_ISFIFO(os.fstat(sys.stdout.fileno()).st_mode):
            return False
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poll.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


if __name__ == "__main__":
    sys.exit(main())
