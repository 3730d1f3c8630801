"""The commands that check one case (check, repro): reading a CaseSpec, a
report or a finding, and checking it against invariants on an engine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from conformance.case.model_case import ModelCase, case_from_json
from conformance.case.spec import SpecError
from conformance.cli.common import make_engine
from conformance.cli.errors import UsageError
from conformance.engine.errors import EngineError, ExampleFailed
from conformance.report import data


def load_spec(path: str):

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None
    try:
        return valid_case(case_from_json(text))
    except SpecError as e:
        raise UsageError(f"{path}: {e}") from None


def valid_case(case):
    """A ModelCase names its target: that target must import and have every
    name the case uses (TargetError: one line, exit 2)."""
    if isinstance(case, ModelCase):
        from conformance.case.target import TargetError, check_case

        try:
            check_case(case)
        except TargetError as e:
            raise UsageError(str(e)) from None
    return case


def load_case(path: str, finding_id: str | None):
    """(spec, invariant or None, finding or None) from a CaseSpec JSON, a
    report JSON (with --finding, or its only failing finding), or one finding
    object copied out of a report."""

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    finding = None
    if isinstance(obj, dict) and "schema" in obj:
        try:
            report = data.validate(obj, f"report {path}")
            if finding_id:
                finding = data.finding_by_id(report, finding_id)
            else:
                failing = [f for f in report.get("findings", []) if f.get("kind") != "KNOWN"]
                if len(failing) != 1:
                    ids = ", ".join(f["id"] for f in report.get("findings", [])) or "none"
                    raise UsageError(f"{path} has {len(failing)} failing findings: pick one with --finding ID (findings: {ids})")
                finding = failing[0]
        except data.ReportError as e:
            raise UsageError(str(e)) from None
    elif isinstance(obj, dict) and "spec" in obj and "invariant" in obj:
        finding = obj
    if finding is not None:
        try:
            spec = valid_case(case_from_json(json.dumps(finding["spec"])))
        except (SpecError, KeyError, TypeError) as e:
            raise UsageError(f"{path}: the finding's case is not a valid CaseSpec ({e})") from None
        return spec, finding.get("invariant"), finding
    if finding_id:
        raise UsageError(f"{path} is not a report: --finding needs a report JSON")
    return load_spec(path), None, None


def load_history(finding: dict | None, path: str) -> list[tuple[str, object, dict | None]]:
    """A CRASH finding's ``engine.history``: the examples its crashed ranks
    ran before it, oldest first, as (scenario, case, args). The pool keeps
    them for a crash that did not follow its case on fresh ranks, and only
    that sequence may reproduce it (RankPool._replay_history)."""
    entries = ((finding or {}).get("engine") or {}).get("history") or []
    if not isinstance(entries, list):
        raise UsageError(f"{path}: the finding's engine.history is not a list")
    out = []
    for k, e in enumerate(entries, 1):
        try:
            out.append((str(e["scenario"]), valid_case(case_from_json(e["spec"])), e.get("args")))
        except (SpecError, KeyError, TypeError, ValueError) as err:
            raise UsageError(f"{path}: example {k} of the finding's engine.history is not a case to run ({err})") from None
    return out


def replay_history(engine, history, out) -> int:
    """Run ``history`` on ``engine``'s ranks, in order, before the case:
    0 when every example ran (its own verdict does not matter: only what it
    leaves in the rank processes), 1 when one crashed or hung (printed)."""
    from conformance.engine.errors import RankCrash, RankHang

    n = len(history)
    print(f"replaying the {n} example(s) the crashed ranks ran before the case (engine.history), in order", file=out)
    for k, (scenario, case, args) in enumerate(history, 1):
        try:
            engine.run(scenario, case, args=args, replay=False)
        except (RankCrash, RankHang) as e:
            print(f"{e.verdict} at example {k} of {n} of the history ({scenario}), before the case ran\n  {e}", file=out)
            return 1
        except EngineError as e:  # a scenario this installation does not have
            raise UsageError(f"example {k} of the history cannot run here: {str(e).splitlines()[0]}") from None
    return 0


def applicable(inv, spec) -> bool:
    """Whether ``spec`` is a case of ``inv``'s area (Area.applies, the one
    place that says so): a case without a checkpoint plan has nothing for the
    checkpoint invariants, one without a CommPlan nothing for COMM-*."""
    # torch and the areas: imported by the commands that need them (the CLI parses, and rejects bad input, without)
    from conformance.areas import area_of

    return area_of(inv.id).applies(spec)


def check_case_file(spec, selected, backend: str, world_size: int, history=(), *, known: bool = True, engine=None) -> int:
    """Check ``spec`` against ``selected`` on a fresh engine (a pool, or the
    fake tier), or on ``engine`` (start_engine's pool, started early); with
    ``history`` (load_history), those examples run first on the same ranks.
    Prints each invariant's verdict; 1 if any failed. ``known=False``:
    against the oracle alone, the known failures unread, so a recorded
    finding's deviation fails too (a repro's verdict). Closes the engine."""

    # torch and the areas: imported by the commands that need them (the CLI parses, and rejects bad input, without)
    from conformance.run import known as known_mod
    from conformance.run.runner import FAIL, check_example, known_engine_failure, plan_scenarios
    if getattr(spec, "ckpt", None) is not None or getattr(spec, "schedule", None) is not None:
        if backend == "fake":  # values and world sizes: the suite runs these on real ranks only
            raise UsageError("a checkpoint or training-schedule case needs real ranks: use --backend gloo (or nccl)")
    base = engine = engine if engine is not None else make_engine(backend, world_size)
    if hasattr(base, "wait_ready"):  # a pool: its ranks joined the group, or one line
        try:
            base.wait_ready()
        except EngineError as e:
            base.close()
            raise UsageError(str(e)) from None
    mb = getattr(spec, "microbatch", None)
    if backend != "fake" and (any(getattr(spec, f, None) is not None for f in ("ckpt", "hsdp", "tp"))
                              or (mb is not None and mb.mesh is not None)):
        # a save world and a load world, phase by phase; an HSDP or TP case,
        # or a microbatch sequence on a 2-D mesh, on as many ranks as its
        # mesh has, whatever --world-size says
        from conformance.engine.worlds import Worlds

        engine = Worlds(base)
    try:
        if history and replay_history(base, history, sys.stdout):
            return 1
        # as `run` checks an example: the known failures read once, each
        # scenario the invariants need run once and every invariant of it
        # checked on that observation (a HANG or CRASH is each one's verdict)
        known_failures = known_mod.load() if known else []
        ids = [inv.id for inv in selected]
        got: dict = {}
        for group in plan_scenarios(ids).values():
            try:
                got.update((res.invariant, res) for res in check_example(group, spec, engine, known_failures))
            except ExampleFailed as e:  # KNOWN where a finding describes it, as `run` records it
                got.update((i, known_engine_failure(i, spec, e, known_failures) or e) for i in group)
        worst = 0
        for i in ids:
            res = got[i]
            if isinstance(res, ExampleFailed):
                print(f"{i}: {res.verdict}\n  {res}")
                worst = 1
                continue
            print(res.describe())
            worst = max(worst, 1 if res.verdict == FAIL else 0)
        return worst
    finally:
        engine.close()
        if base is not engine:
            base.close()
