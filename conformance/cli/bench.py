"""`fsdp-conformance bench`: the suite's speed, as figures from one run."""

from __future__ import annotations

import os
import sys

from conformance.cli.common import need_distributed
from conformance.cli.errors import UsageError
from conformance.engine.errors import BenchError, EngineError
from conformance.run import bench


def cmd_bench(ns) -> int:
    # torch and the areas: imported by the commands that need them (the CLI parses, and rejects bad input, without)
    from conformance.areas import AREAS
    from conformance.case.target import TargetError, check_target

    names = [a.name for a in AREAS]
    areas = [a for a in ns.area.split(",") if a] if ns.area != "all" else names
    bad = [a for a in areas if a not in names]
    if bad:
        raise UsageError(f"unknown area {bad[0]!r}; choose from {', '.join(names)} or all")
    tiers = tuple(t for t in ns.tiers.split(",") if t)
    if not tiers or any(t not in bench.TIERS for t in tiers):
        raise UsageError(f"--tiers: one or more of {', '.join(bench.TIERS)}")
    for name in ("examples", "world_size", "fake_world_size"):
        v = getattr(ns, name)
        if v is not None and v < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    need_distributed()
    if ns.target:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # a user's target, as `fsdp-conformance model` finds it
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
        for t in ns.target:
            try:
                check_target(t)
            except TargetError as e:
                raise UsageError(str(e)) from None
    try:
        results = bench.run(areas, tiers=tiers, engines=ns.engines, examples=ns.examples, world_size=ns.world_size,
                            fake_world_size=ns.fake_world_size, seed=ns.seed, json_path=ns.json, targets=ns.target or ())
    except (EngineError, BenchError) as e:  # e.g. a spawned rank past its deadline on a loaded machine
        print(f"fsdp-conformance: bench could not measure: {e}", file=sys.stderr)
        return 2
    failed = bench.failed_rows(results)
    if failed:
        rows = ", ".join(f"{r['area']} ({r['tier']})" for r in failed)
        print(f"fsdp-conformance: bench: a test failed in {rows}: those rows measure shrinking, not the run", file=sys.stderr)
        return 1
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="per area and tier: examples/s of the conformance tests as `run` runs them, FSDP's share "
                                     "of the wall time, the pool's overhead; --engines compares the engines")
    p.add_argument("--area", default="all", help="areas to measure, comma-separated (default all)")
    p.add_argument("--tiers", default="fake,gloo", help="fake, gloo or both (default)")
    p.add_argument("--examples", type=int, default=None, help=f"examples per test (default {bench.DEFAULT_EXAMPLES}; "
                                                              f"--engines: {bench.DEFAULT_ENGINE_EXAMPLES} cases)")
    p.add_argument("--world-size", type=int, default=2, help="ranks of the gloo pool (default 2)")
    p.add_argument("--fake-world-size", type=int, default=4, help="world size of the fake process group (default 4)")
    p.add_argument("--seed", type=int, default=0, help="Hypothesis seed of the drawn cases (default 0)")
    p.add_argument("--engines", action="store_true", help="also spawn-per-example vs pool vs fake on the same cases")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--target", action="append", default=None, metavar="TARGET",
                   help="a real model ('package.module:attr', repeatable): its conformance tests (test_models.py) instead of drawn trees")
    p.set_defaults(fn=cmd_bench)
