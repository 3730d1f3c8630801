"""`fsdp-conformance run`: the conformance suite under pytest, and its report."""

from __future__ import annotations

import os
import sys

from conformance import paths
from conformance.cli.errors import Parser, UsageError
from conformance.cli.pytest_run import conformance_args, run_pytest, target_args, use_fsdp_source
from conformance.run import profiles


def cmd_run(ns) -> int:

    # first: a source that cannot be used is bad input, whatever else is asked
    use_fsdp_source(getattr(ns, "fsdp_source", None))

    try:
        profile = profiles.selected(ns.profile)
    except ValueError as e:
        raise UsageError(str(e)) from None
    args, report_dir = conformance_args(ns, profile, paths.default_report_dir())
    args += target_args(ns.target)
    if ns.seed is not None:
        args.append(f"--hypothesis-seed={ns.seed}")
    live = ns.progress == "live" or (ns.progress == "auto" and sys.stdout.isatty() and not os.environ.get("CI"))
    return run_pytest(args, report_dir, live)


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="run the conformance tests (Hypothesis) and write the report")
    p.add_argument("--profile", default=None, help="dev | ci | thorough (default: $FSDP_CONFORMANCE_PROFILE or dev)")
    p.add_argument("--backend", default=None, help="fake | gloo | nccl | auto (auto: nccl with one GPU per rank, else gloo); default: fake and gloo")
    p.add_argument("--tiers", default=None, help="several backends, comma-separated (e.g. fake,gloo)")
    p.add_argument("--world-size", type=int, default=2, help="ranks of the gloo / NCCL pool (default 2)")
    p.add_argument("--fake-world-size", type=int, default=4, help="world size of the fake process group (default 4)")
    p.add_argument("--invariant", action="append", help="invariant ID or area (repeatable); default all")
    p.add_argument("--examples", type=int, default=None, help="Hypothesis examples per test (default: the profile's)")
    p.add_argument("--seed", type=int, default=None, help="Hypothesis seed (the ci profile is derandomized)")
    p.add_argument("-n", "--workers", type=int, default=0, help="pytest-xdist workers (default 0: one process)")
    p.add_argument("--report-dir", default=None, help="where the report goes (default: reports/latest under the current directory)")
    p.add_argument("--baseline", action="append", help="baseline report for FIXED verdicts (repeatable; default auto: the shipped baselines for this torch; 'none')")
    p.add_argument("--deadline", type=float, default=60.0, help="seconds before a pool example is a HANG")
    p.add_argument("--progress", choices=("auto", "live", "quiet"), default="auto", help="live progress (a terminal) or pytest's quiet log (CI, pipes)")
    p.add_argument("--fsdp-source", default=None, metavar="PATH",
                   help="import FSDP (torch/distributed/fsdp/, FSDP1 and FSDP2) from this source tree over the installed torch")
    p.add_argument("--database", default=None, help="keep and replay examples in this Hypothesis example database (a directory, github:OWNER/REPO, redis://HOST:PORT)")
    p.add_argument("--replay", action="store_true", help="draw nothing: only the regression corpus and the database's examples")
    p.add_argument("--target", action="append", default=None, metavar="TARGET",
                   help="also check a real model ('package.module:attr', repeatable): its rows stand beside the synthetic ones")
    p.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    p.set_defaults(fn=cmd_run)


def run_argv(args: list[str]) -> int:
    """``fsdp-conformance run ARGS`` from another command (change)."""
    p = Parser(prog="fsdp-conformance")
    add_parser(p.add_subparsers(dest="cmd", required=True, parser_class=Parser))
    return cmd_run(p.parse_args(["run", *args] if args[:1] != ["run"] else args))
