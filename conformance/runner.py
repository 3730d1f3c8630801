"""Run one case for one invariant: oracle and engine, rank agreement, check,
known-failure matching. Returns a CaseResult (pure data)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from conformance import known as known_mod
from conformance.invariants import get
from conformance.observation import Observation
from conformance.oracle import predict_fsdp1
from conformance.spec import CaseSpec
from conformance.violation import Violation

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


def observations(engine, spec: CaseSpec, scenario: str = "fsdp1") -> list[Observation]:
    out = []
    for rec in engine.run(scenario, spec):
        if not rec.get("ok"):
            err = rec.get("error") or {}
            raise ScenarioFailed(
                f"rank {rec.get('rank')} raised {err.get('type')}: {err.get('message')}\n{err.get('traceback', '')}"
            )
        out.append(Observation.from_dict(rec["value"]))
    return out


def evaluate(invariant_id: str, spec: CaseSpec, obs: list[Observation], known: list | None = None) -> CaseResult:
    inv = get(invariant_id)
    pred = predict_fsdp1(spec)
    # every example also checks that the ranks agree: a rank-dependent FSDP
    # structure breaks every other invariant's premise
    violations = get("RANKS-AGREE").check(spec, pred, obs)
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
    return evaluate(invariant_id, spec, observations(engine, spec), known)
