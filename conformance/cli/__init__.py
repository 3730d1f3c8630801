"""fsdp-conformance: run | hunt | model | compare | check | repro | finding | bench | selfcheck | change.

Exit status: 0 when every invariant holds (KNOWN and FIXED included), 1 on a
violation (or a regression, for compare), 2 on bad input or an environment
that cannot run what was asked; 130 / 143 when a run is interrupted by
SIGINT / SIGTERM (its report is written, marked incomplete)."""

from __future__ import annotations

import argparse
import sys

from conformance.cli import bench, change, check, compare, finding, hunt, model, repro, run, selfcheck
from conformance.cli.errors import Parser, UsageError

COMMANDS = (run, hunt, model, compare, check, repro, finding, bench, selfcheck, change)


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="fsdp-conformance", formatter_class=argparse.RawDescriptionHelpFormatter, description=__doc__.splitlines()[0],
               epilog=__doc__.split("\n", 1)[1].strip())
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    for command in COMMANDS:
        command.add_parser(sub)
    ns = p.parse_args(argv)
    try:
        return ns.fn(ns)
    except UsageError as e:
        print(f"fsdp-conformance: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into head and the like: not an error of ours
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("fsdp-conformance: interrupted", file=sys.stderr)
        return 130
