"""`fsdp-conformance bench`: the suite's speed, as figures."""

from __future__ import annotations
from conformance.cli.errors import UsageError
from conformance.cli.common import need_distributed
import os
import sys


def cmd_bench(ns) -> int:
    from conformance.run import bench

    apis = [a for a in ns.api.split(",") if a] if ns.api != "all" else list(bench.APIS)
    bad = [a for a in apis if a not in bench.APIS]
    if bad:
        raise UsageError(f"unknown API {bad[0]!r}; choose from {', '.join(bench.APIS)} or all")
    for name in ("examples", "world_size", "fake_world_size"):
        v = getattr(ns, name)
        if v is not None and v < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    need_distributed()
    from conformance.engine.errors import EngineError
    from conformance.case.target import TargetError

    if ns.target and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a user's target, as `fsdp-conformance model` finds it
    try:
        bench.run(apis, engines=ns.engines, examples=ns.examples, world_size=ns.world_size,
                  fake_world_size=ns.fake_world_size, seed=ns.seed, json_path=ns.json, targets=ns.target or ())
    except TargetError as e:
        raise UsageError(str(e)) from None
    except (EngineError, bench.BenchError) as e:  # e.g. a spawned rank past its deadline on a loaded machine
        print(f"fsdp-conformance: bench could not measure: {e}", file=sys.stderr)
        return 2
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="examples/s of the checks per FSDP API next to the time inside FSDP; --engines compares the engines")
    p.add_argument("--api", default="all", help="fsdp1 (fake tier) | fsdp2 (gloo pool) | checkpoint (save/reshard/load on worlds 1-3) | all (default), comma-separated")
    p.add_argument("--examples", type=int, default=None, help="drawn examples per benchmark (default: fsdp1 500, fsdp2 100, checkpoint 30, engines 200)")
    p.add_argument("--world-size", type=int, default=2, help="ranks of the gloo pool (default 2)")
    p.add_argument("--fake-world-size", type=int, default=4, help="world size of the fake process group (default 4)")
    p.add_argument("--seed", type=int, default=0, help="Hypothesis seed of the drawn cases (default 0)")
    p.add_argument("--engines", action="store_true", help="also spawn-per-example vs pool vs fake on the same cases")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--target", action="append", default=None, metavar="TARGET",
                   help="a real model ('package.module:attr', repeatable): per API (--api fsdp1 and/or fsdp2), fsdp1 on the fake tier and fsdp2 on the gloo pool (default 20 examples)")
    p.set_defaults(fn=cmd_bench)
