"""The ``gradcompress`` command (also ``python -m gradcompress``).

Subcommands:

* ``gradcompress demo``  — every scheme on the same small task (the digits MLP, or ``--task lm``: a
  byte-level transformer), 4 local workers; prints a
  table and writes ``results.json`` and ``report.png`` (see :mod:`gradcompress.cli.demo`);
* ``gradcompress train`` — one run with one scheme (either task), locally or under ``torchrun``
  (see :mod:`gradcompress.cli.train`);
* ``gradcompress bench`` — encode/decode speed, compression ratio and error of every
  codec on one gradient-sized tensor (see :mod:`gradcompress.cli.bench`);
* ``gradcompress netbench`` — step time and real interface bytes per scheme over emulated
  hosts (network namespaces, links shaped with tc; root) (see :mod:`gradcompress.cli.netbench`);
* ``gradcompress plan`` — predicted step time per scheme from an alpha-beta model
  (see :mod:`gradcompress.cli.plan`).

Errors in the arguments are reported as one line on stderr (exit code 2); a worker
that fails stops the run and its error is printed (exit code 1).
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from .common import CLIError

__all__ = ["main"]


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``prog: error: message (see prog --help)``)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    from . import bench, demo, netbench, plan, train

    parser = Parser(prog="gradcompress", description="Gradient compression for data-parallel PyTorch training: "
                    "a demo comparing every scheme (demo), single training runs (train), a codec benchmark "
                    "(bench), step time and bytes over emulated shaped links (netbench), and predicted step "
                    "times for your model and network (plan).",
                    formatter_class=argparse.RawDescriptionHelpFormatter,
                    epilog="Every command takes its schemes with --schemes (';'-separated: specs contain commas).\n"
                           "Run 'gradcompress COMMAND --help' for the options of a command.")
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"gradcompress {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for module in (demo, train, bench, netbench, plan):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code (0 ok, 1 run failed, 2 bad arguments)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # --help, --version, or a usage error (already printed)
        return stop.code if isinstance(stop.code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    from ..testbed.launch import WorkerError

    try:
        return int(args.run(args) or 0)
    except CLIError as err:
        print(f"gradcompress {args.command}: error: {err}", file=sys.stderr)
        return 2
    except WorkerError as err:
        text = err.text.rstrip()
        last = text.splitlines()[-1].strip() if text else "no details"
        print(f"gradcompress {args.command}: error: worker {err.rank} failed: {last}", file=sys.stderr)
        if "\n" in text:  # the worker's traceback, for the record
            print(f"worker {err.rank}'s traceback:\n{text}", file=sys.stderr)
        return 1
    except FloatingPointError as err:  # training diverged (torchrun path; local workers raise WorkerError)
        print(f"gradcompress {args.command}: error: {err}", file=sys.stderr)
        return 1
    except TimeoutError as err:
        print(f"gradcompress {args.command}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"gradcompress {args.command}: interrupted", file=sys.stderr)
        return 130
