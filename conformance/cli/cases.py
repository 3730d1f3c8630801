"""The commands that check one case (check, repro): reading a CaseSpec, a
report or a finding, and checking it against invariants on an engine."""

from __future__ import annotations

import json
from pathlib import Path

from conformance.case.model_case import ModelCase, case_from_json
from conformance.case.spec import SpecError
from conformance.cli.common import make_engine
from conformance.cli.errors import UsageError
from conformance.engine.errors import ExampleFailed
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


def applicable(inv, spec) -> bool:
    """Whether ``spec`` is a case of ``inv``'s area (Area.applies, the one
    place that says so): a case without a checkpoint plan has nothing for the
    checkpoint invariants, one without a CommPlan nothing for COMM-*."""
    # torch and the areas: imported by the commands that need them (the CLI parses, and rejects bad input, without)
    from conformance.areas import area_of

    return area_of(inv.id).applies(spec)


def check_case_file(spec, selected, backend: str, world_size: int) -> int:

    # torch and the areas: imported by the commands that need them (the CLI parses, and rejects bad input, without)
    from conformance.run import known as known_mod
    from conformance.run.runner import FAIL, check_example, plan_scenarios
    if getattr(spec, "ckpt", None) is not None or getattr(spec, "schedule", None) is not None:
        if backend == "fake":  # values and world sizes: the suite runs these on real ranks only
            raise UsageError("a checkpoint or training-schedule case needs real ranks: use --backend gloo (or nccl)")
    base = engine = make_engine(backend, world_size)
    if backend != "fake" and any(getattr(spec, f, None) is not None for f in ("ckpt", "hsdp", "tp")):
        # a save world and a load world, phase by phase; an HSDP or TP case
        # on as many ranks as its mesh has, whatever --world-size says
        from conformance.engine.worlds import Worlds

        engine = Worlds(base)
    try:
        # as `run` checks an example: the known failures read once, each
        # scenario the invariants need run once and every invariant of it
        # checked on that observation (a HANG or CRASH is each one's verdict)
        known = known_mod.load()
        ids = [inv.id for inv in selected]
        got: dict = {}
        for group in plan_scenarios(ids).values():
            try:
                got.update((res.invariant, res) for res in check_example(group, spec, engine, known))
            except ExampleFailed as e:
                got.update((i, e) for i in group)
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
