"""fsdp-conformance: run | check | repro | bench | selfcheck."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class UsageError(Exception):
    """Bad input: printed as one line, exit status 2."""


def _pytest(args: list[str]) -> int:
    return subprocess.call([sys.executable, "-m", "pytest", *args], cwd=ROOT)


def cmd_run(ns) -> int:
    from conformance import invariants, profiles

    try:
        profiles.selected(ns.profile)
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        selected = invariants.select(ns.invariant)
    except invariants.UnknownInvariant as e:
        raise UsageError(str(e)) from None
    args = ["tests/conformance", f"--conformance-profile={ns.profile}", f"--tiers={ns.tiers}", f"--world-size={ns.world_size}", f"--report-dir={ns.report_dir}", "-q", "-rfE"]
    if ns.invariant:
        args += ["-k", " or ".join(i.id for i in selected)]
    if ns.workers:
        args += ["-n", str(ns.workers)]
    return _pytest(args)


def _load_spec(path: str):
    from conformance.spec import CaseSpec, SpecError

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None
    try:
        return CaseSpec.from_json(text)
    except SpecError as e:
        raise UsageError(f"{path}: {e}") from None


def cmd_check(ns) -> int:
    """Check one CaseSpec JSON against invariants on the fake tier or the pool."""
    from conformance import invariants
    from conformance.runner import FAIL, check_case

    spec = _load_spec(ns.spec)
    try:
        selected = invariants.select(ns.invariant)
    except invariants.UnknownInvariant as e:
        raise UsageError(str(e)) from None
    engine = _engine(ns.backend, ns.world_size)
    try:
        worst = 0
        for inv in selected:
            if inv.api != spec.plan.api:
                continue
            res = check_case(inv.id, spec, engine)
            print(res.describe())
            worst = max(worst, 1 if res.verdict == FAIL else 0)
        return worst
    finally:
        engine.close()


def _engine(backend: str, world_size: int):
    from conformance.engine.errors import EngineError

    try:
        if backend == "fake":
            from conformance.engine.fake import FakeEngine

            return FakeEngine(world_size=world_size)
        from conformance.engine.pool import RankPool, resolve_backend

        return RankPool(world_size=world_size, backend=resolve_backend(backend, world_size))
    except EngineError as e:
        raise UsageError(str(e)) from None


def cmd_repro(ns) -> int:
    """Write the standalone torch-only repro script for a CaseSpec JSON."""
    from conformance.report.repro import repro_script

    spec = _load_spec(ns.spec)
    text = repro_script(spec, title=Path(ns.spec).stem)
    if ns.output == "-":
        sys.stdout.write(text)
    else:
        Path(ns.output).write_text(text)
        print(ns.output)
    return 0


def cmd_bench(ns) -> int:
    from conformance.bench import bench_fake

    bench_fake(examples=ns.examples, world_size=ns.world_size, seed=ns.seed)
    if ns.engines:
        from conformance.engine.bench import main as engine_bench

        engine_bench(["--examples", str(min(ns.examples, 200))])
    return 0


def cmd_selfcheck(ns) -> int:
    return _pytest(["tests/self", "-q"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fsdp-conformance", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the conformance tests (Hypothesis) and report")
    r.add_argument("--profile", default=os.environ.get("FSDP_CONFORMANCE_PROFILE", "dev"), help="dev | ci | thorough")
    r.add_argument("--tiers", default="fake,gloo", help="engines: fake,gloo")
    r.add_argument("--world-size", type=int, default=2)
    r.add_argument("--invariant", action="append", help="invariant ID or area (repeatable); default all")
    r.add_argument("-n", "--workers", type=int, default=0, help="pytest-xdist workers")
    r.add_argument("--report-dir", default=str(ROOT / "reports" / "latest"))
    r.set_defaults(fn=cmd_run)
    c = sub.add_parser("check", help="check one CaseSpec JSON file")
    c.add_argument("spec")
    c.add_argument("--invariant", action="append")
    c.add_argument("--backend", default="fake", help="fake | gloo | nccl | auto")
    c.add_argument("--world-size", type=int, default=4)
    c.set_defaults(fn=cmd_check)
    rp = sub.add_parser("repro", help="write a standalone torch-only repro for a CaseSpec JSON")
    rp.add_argument("spec")
    rp.add_argument("-o", "--output", default="-")
    rp.set_defaults(fn=cmd_repro)
    b = sub.add_parser("bench", help="examples/s of the fake-tier FSDP1 checks; --engines adds the pool")
    b.add_argument("--examples", type=int, default=500)
    b.add_argument("--world-size", type=int, default=4)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--engines", action="store_true", help="also spawn-per-example vs pool vs fake (issue: engine)")
    b.set_defaults(fn=cmd_bench)
    s = sub.add_parser("selfcheck", help="run the suite's own tests")
    s.set_defaults(fn=cmd_selfcheck)
    ns = p.parse_args(argv)
    try:
        return ns.fn(ns)
    except UsageError as e:
        print(f"fsdp-conformance: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fsdp-conformance: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
