"""Run one case for one invariant: oracle and engine, rank agreement, check,
known-failure matching. Returns a CaseResult (pure data)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from conformance import known as known_mod
from conformance.invariants import get
from conformance.observations import Observation
from conformance.oracle import predict_fsdp1
from conformance.case.spec import CaseSpec
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


@dataclass(frozen=True)
class Handler:
    """How the invariants of one kind are evaluated: the scenario the engine
    runs, how a rank's value becomes an observation, and the oracle."""

    scenario: str
    parse: Callable[[dict], Any]
    predict: Callable[[CaseSpec], Any]
    # facts of the case and of each rank's observation that a rank
    # disagreement is tagged with, for known failures to match on
    ranks_tags: Callable[[CaseSpec, Any, list], set] | None = None


def _fsdp2_handlers() -> dict[str, Handler]:
    from conformance.invariants.methods import parity_ranks_tags
    from conformance.observations import FSDP2Observation, TrainObservation
    from conformance.oracle.fsdp2 import predict_fsdp2
    from conformance.oracle.methods import predict_parity, predict_summon

    return {
        "fsdp2": Handler("fsdp2", FSDP2Observation.from_dict, lambda spec: predict_fsdp2(spec, torch.__version__)),
        "fsdp1-methods": Handler("fsdp1-methods", FSDP2Observation.from_dict, predict_summon),
        "train": Handler("train", TrainObservation.from_dict, predict_parity, parity_ranks_tags),
        **_schedule_handlers(),
    }


# --- lifecycle (checkpoint) handlers ---
def _ckpt_handlers() -> dict[str, Handler]:
    from conformance.observations.checkpoint import CkptObservation
    from conformance.oracle.checkpoint import predict_ckpt

    return {name: Handler(name, CkptObservation.from_dict, predict_ckpt) for name in ("ckpt-full", "ckpt-ties", "ckpt-roundtrip")}
# --- end lifecycle (checkpoint) handlers ---
def _schedule_handlers() -> dict[str, Handler]:
    # --- training schedules (MP-DTYPES, ACCUM) ---
    from conformance.invariants.training import ranks_tags
    from conformance.observations.schedule import ScheduleObservation
    from conformance.oracle.schedule import predict_schedule

    return {"schedule": Handler("schedule", ScheduleObservation.from_dict, predict_schedule, ranks_tags)}


_HANDLERS: dict[str, Handler] = {}


def handler(invariant_id: str) -> Handler:
    """By the invariant's scenario: the FSDP1 scenarios parse an Observation
    and use predict_fsdp1; FSDP2, forward methods and PARITY their own."""
    if not _HANDLERS:
        _HANDLERS.update(_fsdp2_handlers())
        _HANDLERS.update(_ckpt_handlers())
    scenario = get(invariant_id).scenario
    return _HANDLERS.get(scenario) or Handler(scenario, Observation.from_dict, predict_fsdp1)


def _ranks_agree(obs: list, tags: set | frozenset = frozenset()) -> list[Violation]:
    """Rank agreement for the non-FSDP1 observations (FSDP1's RANKS-AGREE
    check reads FSDP1 predictions); ``tags``: the handler's ranks_tags."""
    first = obs[0].comparable()
    out = []
    for o in obs[1:]:
        mine = o.comparable()
        fields = sorted(k for k in first if first[k] != mine.get(k))
        if fields:
            detail = "; ".join(f"{k}: rank {obs[0].rank} {first[k]!r} vs rank {o.rank} {mine.get(k)!r}" for k in fields)
            # the case's tags, the backend and the fields: a rank-local value verdict
            # (losses_close) that a backend's wrong collective splits is not a
            # structural disagreement
            vtags = {"kind:ranks", f"api:{obs[0].api}", *tags, *(f"differs:{k}" for k in fields)}
            if getattr(obs[0], "backend", None):
                vtags.add(f"backend:{obs[0].backend}")
            out.append(Violation("RANKS-AGREE", f"ranks disagree on {', '.join(fields)} ({detail[:600]})", frozenset(vtags)))
    return out


def observations(engine, spec: CaseSpec, scenario: str = "fsdp1", parse: Callable[[dict], Any] = Observation.from_dict) -> list:
    out = []
    for rec in engine.run(scenario, spec):
        if not rec.get("ok"):
            err = rec.get("error") or {}
            raise ScenarioFailed(
                f"rank {rec.get('rank')} raised {err.get('type')}: {err.get('message')}\n{err.get('traceback', '')}"
            )
        out.append(parse(rec["value"]))
    return out


def evaluate(invariant_id: str, spec: CaseSpec, obs: list[Observation], known: list | None = None) -> CaseResult:
    inv = get(invariant_id)
    h = handler(invariant_id)
    pred = h.predict(spec)
    # every example also checks that the ranks agree: a rank-dependent FSDP
    # structure breaks every other invariant's premise
    if h.parse == Observation.from_dict:
        violations = get("RANKS-AGREE").check(spec, pred, obs)
    else:
        violations = _ranks_agree(obs, h.ranks_tags(spec, pred, obs) if h.ranks_tags else frozenset())
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
    h = handler(invariant_id)
    if h.parse == Observation.from_dict:
        return observations(engine, spec, h.scenario, h.parse)
    key = (id(engine), h.scenario, spec.to_json())
    if _LAST.get("key") != key:
        _LAST.clear()
        _LAST["obs"] = observations(engine, spec, h.scenario, h.parse)
        _LAST["key"] = key
    return _LAST["obs"]


_LAST: dict = {}


def clear_cache() -> None:
    """Forget the kept observations (a test that patches torch between two checks)."""
    _LAST.clear()
