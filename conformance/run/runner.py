"""Run one case for one invariant: oracle and engine, rank agreement, check,
known-failure matching. Returns a CaseResult (pure data)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from conformance.areas import SCENARIOS, area_of, get, scenario_of
from conformance.case.spec import CaseSpec
from conformance.run import known as known_mod
from conformance.case.violation import Violation

PASS, FAIL, KNOWN = "PASS", "FAIL", "KNOWN"


@dataclass
class CaseResult:
    invariant: str
    spec: CaseSpec
    verdict: str
    violations: list[Violation] = field(default_factory=list)  # unexplained
    known: list[tuple[Violation, str]] = field(default_factory=list)  # (violation, finding id)

    def describe(self) -> str:
        lines = [f"{self.invariant}: {self.verdict}"]
        lines += [f"  {v}" for v in self.violations]
        lines += [f"  KNOWN {fid}: {v}" for v, fid in self.known]
        return "\n".join(lines)


class ScenarioFailed(RuntimeError):
    """The adapter itself raised inside a rank: a bug in the suite or an FSDP
    failure outside wrapping; reported as a failure with the rank's traceback."""


def observations(engine, spec: CaseSpec, scenario: str = "fsdp1", parse: Callable[[dict], Any] | None = None) -> list:
    """Every rank's observation of ``scenario`` on ``spec``, read as its
    area's observation type (``parse``: a test scenario's)."""
    parse = parse or SCENARIOS[scenario][1].observation.from_dict
    out = []
    for rec in engine.run(scenario, spec):
        if not rec.get("ok"):
            err = rec.get("error") or {}
            raise ScenarioFailed(
                f"rank {rec.get('rank')} raised {err.get('type')}: {err.get('message')}\n{err.get('traceback', '')}"
            )
        out.append(parse(rec["value"]))
    return out


def evaluate(invariant_id: str, spec: CaseSpec, obs: list, known: list | None = None) -> CaseResult:
    inv = get(invariant_id)
    sc = scenario_of(invariant_id)
    pred = sc.predict(spec)
    # every example also checks that the ranks agree: a rank-dependent FSDP
    # structure breaks every other invariant's premise
    violations = sc.ranks_disagree(spec, pred, obs)
    if invariant_id != "RANKS-AGREE":
        violations += inv.check(spec, pred, obs if inv.all_ranks else obs[0])
    known = known_mod.load() if known is None else known
    res = CaseResult(invariant_id, spec, PASS)
    for v in violations:
        k = known_mod.match(v, known, torch.__version__)
        if k is None:
            res.violations.append(v)
        else:
            res.known.append((v, k.id))
    res.verdict = FAIL if res.violations else KNOWN if res.known else PASS
    return res


def check_case(invariant_id: str, spec: CaseSpec, engine, known: list | None = None) -> CaseResult:
    return evaluate(invariant_id, spec, observe_for(invariant_id, spec, engine), known)


def observe_for(invariant_id: str, spec: CaseSpec, engine) -> list:
    """The observations ``invariant_id`` is checked on: its scenario on every
    rank. The last example's are kept, so that several invariants checked on
    one example (FSDP2, forward methods) run it once."""
    scenario = get(invariant_id).scenario
    if area_of(invariant_id).name == "autowrap":
        return observations(engine, spec, scenario)
    key = (id(engine), scenario, spec.to_json())
    if _LAST.get("key") != key:
        _LAST.clear()
        _LAST["obs"] = observations(engine, spec, scenario)
        _LAST["key"] = key
    return _LAST["obs"]


_LAST: dict = {}


def clear_cache() -> None:
    """Forget the kept observations (a test that patches torch between two checks)."""
    _LAST.clear()
