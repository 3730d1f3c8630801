"""Run one example for the invariants of an area: each scenario they need
once, on every rank; the oracle's prediction once; rank agreement; every
invariant's check on those observations; known-failure matching. Returns
one CaseResult per invariant (pure data)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from conformance.areas import SCENARIOS, get, scenario_of
from conformance.areas.common.catalog import NotChecked
from conformance.case.spec import CaseSpec
from conformance.case.violation import Violation
from conformance.engine.errors import ExampleFailed
from conformance.run import known as known_mod

PASS, FAIL, KNOWN = "PASS", "FAIL", "KNOWN"
# an example on which the invariant compared nothing (with the reason)
UNCHECKED = "UNCHECKED"


@dataclass
class CaseResult:
    invariant: str
    spec: CaseSpec
    verdict: str
    violations: list[Violation] = field(default_factory=list)  # unexplained
    known: list[tuple[Violation, str]] = field(default_factory=list)  # (violation, finding id)
    unchecked: str = ""  # why the invariant compared nothing (verdict UNCHECKED)

    def describe(self) -> str:
        lines = [f"{self.invariant}: {self.verdict}" + (f" ({self.unchecked})" if self.unchecked else "")]
        lines += [f"  {v}" for v in self.violations]
        lines += [f"  KNOWN {fid}: {v}" for v, fid in self.known]
        return "\n".join(lines)


class ScenarioFailed(RuntimeError):
    """The adapter itself raised inside a rank: a bug in the suite or an FSDP
    failure outside wrapping; reported as a failure with the rank's traceback."""


@dataclass
class Timing:
    """Where one scenario run's time went, for the bench: the driver's wall
    time of the engine call, the slowest rank's time inside the scenario
    function, and the slowest rank's time inside FSDP (the area's measure)."""

    scenario: str
    engine: float = 0.0  # the engine's run() alone: on a pool, sending the case and waiting for every record
    in_rank: float = 0.0
    fsdp: float = 0.0
    # the driver's reading of the records as observations, then its oracle,
    # rank agreement, checks and matching (the fake tier reads them the same way)
    check: float = 0.0
    # HANG or CRASH: the example gave no records (``engine`` is then the
    # wait until the engine declared it: a deadline, an idle window, a death);
    # ERROR: a rank's scenario raised (ScenarioFailed)
    failed: str = ""


def observations(engine, spec: CaseSpec, scenario: str = "fsdp1", parse: Callable[[dict], Any] | None = None,
                 timing: Timing | None = None) -> list:
    """Every rank's observation of ``scenario`` on ``spec``, read as its
    area's observation type (``parse``: a test scenario's)."""
    parse = parse or SCENARIOS[scenario][1].observation.from_dict
    t0 = time.perf_counter()
    try:
        records = engine.run(scenario, spec)
    except ExampleFailed as e:
        if timing is not None:
            timing.engine, timing.failed = time.perf_counter() - t0, e.verdict or type(e).__name__
        raise
    t1 = time.perf_counter()
    if timing is not None:
        timing.engine = t1 - t0
        timing.in_rank = max((r.get("seconds", 0.0) for r in records), default=0.0)
    out = []
    for rec in records:
        if not rec.get("ok"):
            err = rec.get("error") or {}
            if timing is not None:
                timing.failed = "ERROR"
            raise ScenarioFailed(
                f"rank {rec.get('rank')} raised {err.get('type')}: {err.get('message')}\n{err.get('traceback', '')}"
            )
        out.append(parse(rec["value"]))
    if timing is not None:
        timing.check = time.perf_counter() - t1
        measure = SCENARIOS[scenario][1].fsdp_seconds if scenario in SCENARIOS else None
        timing.fsdp = max((measure(o) for o in out), default=0.0) if measure else 0.0
    return out


def evaluate(invariant_id: str, spec: CaseSpec, obs: list, known: list | None = None, *, prediction=None,
             disagreements: list[Violation] | None = None) -> CaseResult:
    """One invariant's verdict on one example's observations. ``prediction``
    and ``disagreements`` (the example's RANKS-AGREE violations) when the
    caller has them already: several invariants checked on one run."""
    inv = get(invariant_id)
    sc = scenario_of(invariant_id)
    pred = sc.predict(spec) if prediction is None else prediction
    # every example also checks that the ranks agree: a rank-dependent FSDP
    # structure breaks every other invariant's premise
    violations = list(sc.ranks_disagree(spec, pred, obs) if disagreements is None else disagreements)
    unchecked = ""
    if invariant_id == "RANKS-AGREE":
        if len(obs) < 2:
            unchecked = "one rank has nothing to disagree with"
    else:
        got = inv.check(spec, pred, obs if inv.all_ranks else obs[0])
        if isinstance(got, NotChecked):
            unchecked = got.reason
        else:
            violations += got
    known = known_mod.load() if known is None else known
    res = CaseResult(invariant_id, spec, PASS, unchecked=unchecked)
    for v in violations:
        k = known_mod.match(v, known, torch.__version__)
        if k is None:
            res.violations.append(v)
        else:
            res.known.append((v, k.id))
    res.verdict = FAIL if res.violations else KNOWN if res.known else UNCHECKED if unchecked else PASS
    return res


def plan_scenarios(invariant_ids: list[str]) -> dict[str, list[str]]:
    """Scenario -> the invariants it is run for: one run per scenario, and a
    scenario that observes a superset of another's (``covers``) serves
    that one's invariants too."""
    by: dict[str, list[str]] = {}
    for i in invariant_ids:
        by.setdefault(get(i).scenario, []).append(i)
    for name in list(by):
        covering = next((s for s in by if s != name and name in SCENARIOS[s][1].covers), None)
        if covering is not None:
            by[covering] = by.pop(name) + by[covering]
    return by


def known_engine_failure(invariant: str, spec: CaseSpec, e: ExampleFailed, known_failures: list) -> CaseResult | None:
    """A HANG / CRASH of ``invariant`` on ``spec`` that a known failure
    describes, as a KNOWN result (only for areas that register their case
    tags for it: AreaScenario.failure_tags); None: a failure."""
    sc = scenario_of(invariant)
    if sc.failure_tags is None:
        return None
    v = Violation(invariant, str(e).splitlines()[0], frozenset(sc.failure_tags(spec, sc.predict(spec), e.world_size) | {f"kind:{e.verdict.lower()}"}))
    k = known_mod.match(v, known_failures, torch.__version__)
    return None if k is None else CaseResult(invariant, spec, KNOWN, known=[(v, k.id)])


def check_example(invariant_ids: list[str], spec: CaseSpec, engine, known: list | None = None,
                  timings: list[Timing] | None = None) -> list[CaseResult]:
    """Every invariant of ``invariant_ids`` on one example: each scenario
    they need run once (plan_scenarios), predicted once; results in the
    order given. Raises ScenarioFailed or the engine's ExampleFailed (HANG,
    CRASH) for the scenario that could not give observations."""
    known = known_mod.load() if known is None else known
    results: dict[str, CaseResult] = {}
    for scenario, ids in plan_scenarios(invariant_ids).items():
        timing = Timing(scenario)
        try:
            obs = observations(engine, spec, scenario, timing=timing)
        except (ExampleFailed, ScenarioFailed):
            if timings is not None:  # its wait is the run's time too (the bench says how much)
                timings.append(timing)
            raise
        t0 = time.perf_counter()
        sc = SCENARIOS[scenario][1]
        pred = sc.predict(spec)
        disagreements = sc.ranks_disagree(spec, pred, obs)
        for i in ids:
            results[i] = evaluate(i, spec, obs, known, prediction=pred, disagreements=disagreements)
        timing.check += time.perf_counter() - t0
        if timings is not None:
            timings.append(timing)
    return [results[i] for i in invariant_ids]


def check_case(invariant_id: str, spec: CaseSpec, engine, known: list | None = None) -> CaseResult:
    """One invariant on one example (its scenario run for it alone)."""
    return check_example([invariant_id], spec, engine, known)[0]
