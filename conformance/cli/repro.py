"""`fsdp-conformance repro PATH`: re-run a finding and write its standalone repro script."""

from __future__ import annotations

import sys
from pathlib import Path

from conformance.cli.cases import applicable, check_case_file, load_case, load_history
from conformance.cli.common import BACKENDS, need_distributed, start_engine
from conformance.cli.errors import UsageError


def cmd_repro(ns) -> int:
    """Re-run one finding (or every invariant of a case) on the pool and
    write its standalone torch-only repro script."""
    spec, inv_id, finding = load_case(ns.spec, ns.finding)  # a malformed case is one line before torch is imported
    history = [] if ns.no_history else load_history(finding, ns.spec)
    recorded = (finding or {}).get("engine") or {}
    world_size = ns.world_size if ns.world_size is not None else (recorded.get("world_size") if history else None) or 2
    if history and ns.backend == "fake":
        raise UsageError("the finding's engine.history runs on real ranks: use --backend gloo (or nccl), or --no-history")
    # its fork server imports torch while this process does (not for --no-run: nothing runs)
    engine = None if ns.no_run else start_engine(ns.backend, world_size)
    try:
        return _repro(ns, spec, inv_id, finding, history, world_size, engine)
    finally:
        if engine is not None:
            engine.close()


def _repro(ns, spec, inv_id, finding, history, world_size, engine) -> int:
    """The script, then the check on ``engine`` (None: the fake tier, or --no-run)."""
    # torch and the areas: imported by the commands that need them (the CLI parses, and rejects bad input, without)
    from conformance import areas as invariants
    from conformance.run.repro import repro_script

    if ns.invariant:
        try:
            selected = invariants.select(ns.invariant)
        except invariants.UnknownInvariant as e:
            raise UsageError(str(e)) from None
    elif inv_id:
        try:
            selected = [invariants.get(inv_id)]
        except invariants.UnknownInvariant as e:
            raise UsageError(str(e)) from None
    else:
        selected = [i for i in invariants.select(None) if spec.plan.api in i.api.split("|") and applicable(i, spec)
                    and not (hasattr(spec, "target") and i.id == "FWD-SUMMON")]
    lines = [v["message"] if isinstance(v, dict) else str(v) for v in (finding or {}).get("violations", [])]
    title = inv_id or Path(ns.spec).stem
    text = repro_script(spec, lines, title=title)
    if ns.output == "-":
        sys.stdout.write(text)
        out = sys.stderr
    else:
        Path(ns.output).write_text(text)
        out = sys.stdout
        print(f"torch-only repro script: {ns.output}", file=out)
    if ns.no_run:
        return 0
    need_distributed()
    if finding is not None:
        print(f"re-running {finding.get('id', inv_id)} (was {finding.get('kind')}) on {ns.backend}, world size {world_size}", file=out)
    stdout = sys.stdout
    sys.stdout = out
    try:
        return check_case_file(spec, selected, ns.backend, world_size, history, engine=engine)
    finally:
        sys.stdout = stdout


def add_parser(sub) -> None:
    p = sub.add_parser("repro", help="re-run a finding (report JSON, finding JSON or CaseSpec JSON) on the pool and write its torch-only repro")
    p.add_argument("spec", metavar="PATH")
    p.add_argument("--finding", default=None, help="finding ID, when PATH is a report with several")
    p.add_argument("--invariant", action="append", help="check these invariants instead of the finding's")
    p.add_argument("--backend", default="auto", choices=BACKENDS, help="default auto: nccl with a GPU per rank, else gloo")
    p.add_argument("--world-size", type=int, default=None,
                   help="default: the finding's world size where it has an engine.history, else 2")
    p.add_argument("-o", "--output", default="-", help="where the script goes (default: stdout)")
    p.add_argument("--no-run", action="store_true", help="only write the script")
    p.add_argument("--no-history", action="store_true",
                   help="a CRASH finding with an engine.history: run its case alone, not after the examples its ranks ran before it")
    p.set_defaults(fn=cmd_repro)
