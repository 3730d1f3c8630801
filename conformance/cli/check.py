"""`fsdp-conformance check CASE.json`: one case against invariants."""

from __future__ import annotations

from conformance.cli.cases import applicable, check_case_file, load_spec
from conformance.cli.common import BACKENDS, need_distributed, start_engine
from conformance.cli.errors import UsageError


def cmd_check(ns) -> int:
    """Check one CaseSpec JSON against invariants on the fake tier or the pool."""
    spec = load_spec(ns.spec)  # a malformed case is one line before torch is imported
    # as `run` has them: a report's gloo / NCCL finding came from 2 ranks, a fake-tier one from 4
    world_size = ns.world_size if ns.world_size is not None else (4 if ns.backend == "fake" else 2)
    engine = start_engine(ns.backend, world_size)  # its fork server imports torch while this process does
    try:
        # torch and the areas: imported by the commands that need them (the CLI parses, and rejects bad input, without)
        from conformance import areas as invariants
        from conformance.run.models import NOT_FOR_MODELS

        try:
            selected = invariants.select(ns.invariant)
        except invariants.UnknownInvariant as e:
            raise UsageError(str(e)) from None
        need_distributed()

        selected = [i for i in selected if not (hasattr(spec, "target") and i.id in NOT_FOR_MODELS)]
        return check_case_file(spec, [i for i in selected if spec.plan.api in i.api.split("|") and applicable(i, spec)], ns.backend,
                               world_size, known=not ns.no_known, engine=engine)
    finally:
        if engine is not None:
            engine.close()


def add_parser(sub) -> None:
    p = sub.add_parser("check", help="check one CaseSpec JSON file against invariants")
    p.add_argument("spec")
    p.add_argument("--invariant", action="append")
    p.add_argument("--backend", default="fake", choices=BACKENDS)
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks (default: run's, 4 on the fake tier and 2 on a pool; an HSDP, TP or 2-D-mesh microbatch case takes its mesh's)")
    p.add_argument("--no-known", action="store_true",
                   help="against the oracle alone: a recorded finding's deviation is a FAIL (exit 1), as a repro's verdict needs")
    p.set_defaults(fn=cmd_check)
