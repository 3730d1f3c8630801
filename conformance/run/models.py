"""check_model: every invariant on a real model (a Target), with Hypothesis
drawing freeze masks, wrap policies, FSDP2 groupings, registered methods,
checkpoint plans and training schedules over the model. The CLI
(`fsdp-conformance model`), the Python API (`conformance.check_model`) and
the pytest plugin's fixture all run through here.

An invariant that cannot apply to a model is SKIP with its reason: its
area's ``model_cases`` (conformance.areas.common.area.Area), or the tier's
(the fake tier's collectives carry no data: the areas that compare values
or world sizes, ``needs_ranks``, do not run there). The invariants one
scenario observes run together, one Hypothesis test per scenario and API,
on the target's natural configurations first (explicit examples:
strategies.targets.natural_model_cases), then ``examples`` drawn ones."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import seed as hseed
from hypothesis import strategies as st

from conformance.areas import AREAS, area_of, select
from conformance.case.target import check_target
from conformance.run.runner import plan_scenarios
from conformance.run.session import InvariantFailed, Session
from conformance.strategies.targets import model_cases, natural_model_cases

# Invariants no model case is checked on: their area says why (Area.model_cases).
NOT_FOR_MODELS = tuple(inv.id for area in AREAS if area.model_cases for inv in area.invariants)
TIERS = ("fake", "gloo", "nccl")
# the tier check_model and the fsdp_model marker run on by default: real
# collectives, so that value invariants compare values
DEFAULT_TIERS = ("gloo",)
# What a scenario's cases carry besides the plan (conformance.strategies.targets.LIFECYCLES).
LIFECYCLE = {"ckpt-full": "full", "ckpt-ties": "ties", "ckpt-roundtrip": "roundtrip", "schedule": "schedule"}
FAKE_TIER = "the fake tier's collectives carry no data: values and world sizes are compared on real ranks only (gloo, nccl)"
ONE_RANK = "one in-process rank has nothing to disagree with"


@dataclass
class ModelRun:
    """What check_model found: per (invariant, tier) the first failure
    Hypothesis reported (its message, smallest case and repro path), the
    invariants it skipped and why, and the Session with every tally and
    finding (KNOWN ones included)."""

    target: str
    session: object
    failures: list[dict] = field(default_factory=list)  # {invariant, tier, message, case, repro}
    checked: list[tuple[str, str]] = field(default_factory=list)  # (invariant, tier)
    skipped: list[dict] = field(default_factory=list)  # {invariant, tier, reason}
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures

    def skip_records(self) -> list[dict]:
        """The skips as the report's test records (conformance.report.data.build)."""
        return [{"nodeid": f"check_model[{s['invariant']}-{s['tier']}]", "outcome": "skipped", "invariant": s["invariant"],
                 "tier": s["tier"], "message": s["reason"]} for s in self.skipped]

    def summary(self) -> str:
        lines = [f"{self.target}: {len(self.checked)} invariant/tier checks, {len(self.failures)} failing, {len(self.skipped)} skipped"]
        for t in self.session.tallies.values():
            known = sorted({f.known_failure for f in t.findings.values() if f.known_failure})
            checked = t.examples - t.verdicts.get("UNCHECKED", 0)
            lines.append(f"  {t.invariant:18} {t.api:6} {t.tier:5} {_verdict(t):5} {t.examples:4} examples {checked:4} checked"
                         + (f"  KNOWN {', '.join(known)}" if known else ""))
        for s in self.skipped:
            lines.append(f"  {s['invariant']:18} {'':6} {s['tier']:5} SKIP   {s['reason']}")
        for f in self.failures:
            lines.append(f"FAIL {f['invariant']}/{f['tier']}: {f['message']}")
            if f.get("case"):
                lines.append("  case (paste into Python):\n" + "\n".join("    " + x for x in f["case"].rstrip().splitlines()))
            if f.get("repro"):
                lines.append(f"  repro: {f['repro']}")
        return "\n".join(lines)


def _verdict(t) -> str:
    """A tally's verdict, SKIP where it compared nothing on any example."""
    v = t.verdict
    if v == "PASS" and t.examples == t.verdicts.get("UNCHECKED", 0):
        return "SKIP"
    return v


def model_invariants(ids_or_areas: list[str] | None = None) -> list:
    """The catalog's invariants selected by ID, group or area (all: none
    named); UnknownInvariant for a name that is none of these. Whether each
    applies to a model, and on which tier: skip_reason."""
    return list(select(ids_or_areas))


def skip_reason(inv, tier: str) -> str | None:
    """Why ``inv`` is not checked on a model on ``tier``, or None."""
    area = area_of(inv.id)
    if area.model_cases:
        return f"not checked on a real model: {area.model_cases}"
    if tier == "fake" and area.needs_ranks:
        return FAKE_TIER
    if tier == "fake" and inv.id == "RANKS-AGREE":
        return ONE_RANK
    return None


def model_case_strategy(target: str, scenario: str, apis: tuple[str, ...]):
    """The ModelCases a scenario's invariants are checked on."""
    return model_cases(target, apis=st.sampled_from(apis), lifecycle=LIFECYCLE.get(scenario))


def natural_cases(target: str, scenario: str, apis: tuple[str, ...]) -> list:
    """The target's natural configurations for a scenario (its explicit examples)."""
    return natural_model_cases(target, apis, LIFECYCLE.get(scenario))


def groups(invs: list) -> list[tuple[str, tuple[str, ...], list[str]]]:
    """(scenario, APIs, invariant IDs): the invariants one run of a scenario
    serves (runner.plan_scenarios), apart by the APIs they are stated for,
    in the catalog's order."""
    by_api: dict[str, list[str]] = {}
    for inv in invs:
        by_api.setdefault(inv.api, []).append(inv.id)
    out = []
    for api, ids in by_api.items():
        for scenario, sids in plan_scenarios(ids).items():
            out.append((scenario, tuple(api.split("|")), sids))
    order = {inv.id: i for i, inv in enumerate(invs)}
    return sorted(out, key=lambda g: min(order[i] for i in g[2]))


def make_engine(tier: str, *, world_size: int = 2, fake_world_size: int = 4, deadline: float = 120.0, wait: bool = True):
    if tier == "fake":
        from conformance.engine.fake import FakeEngine

        eng = FakeEngine(world_size=fake_world_size)
    else:
        from conformance.engine.pool import RankPool

        eng = RankPool(world_size=world_size, backend=tier, deadline=deadline, wait=wait)
    eng.tier = tier
    return eng


def check_model(
    target: str,
    *,
    invariants: list[str] | None = None,
    tiers: tuple[str, ...] | list[str] = DEFAULT_TIERS,
    examples: int = 10,
    seed: int | None = None,
    world_size: int = 2,
    fake_world_size: int = 4,
    deadline: float = 120.0,
    repro_dir: str | Path | None = None,
    engines: dict | None = None,
    session=None,
    progress=None,
    natural: bool = True,
) -> ModelRun:
    """Run every invariant (or those named) on ``target``
    ("package.module:attr") on each tier: the target's natural
    configurations (``natural``), then ``examples`` drawn cases, for each
    scenario. Default tier: gloo (real collectives: values are compared);
    "fake" is the in-process tier (structure only).

    Raises TargetError (one line naming the target and what is wrong) before
    anything runs when the target cannot be used, UnknownInvariant for a bad
    name. ``engines`` (tier -> engine, or a Worlds over one, which then also
serves the scenarios that load on other world sizes) lets a caller reuse its own; the ones
    made here are closed before returning, so no rank process outlives the
    call. ``progress(line)`` hears one line per invariant and tier done."""
    bad = [t for t in tiers if t not in TIERS]
    if bad:
        raise ValueError(f"unknown tier {bad[0]!r}; choose from {', '.join(TIERS)}")
    t0 = time.perf_counter()
    own: list = []
    # a pool's fork server imports torch while this process imports the
    # target and runs the tiers before the pool's (its ranks fork when its
    # tier starts); closed with the rest, a bad target or name included
    early = {tier: make_engine(tier, world_size=world_size, deadline=deadline, wait=False)
             for tier in tiers if tier != "fake" and (engines or {}).get(tier) is None}
    own.extend(early.values())
    try:
        check_target(target)
        invs = model_invariants(invariants)
        if session is None:
            session = Session(repro_dir=Path(repro_dir) if repro_dir else None)
        run = ModelRun(target, session)
        for tier in tiers:
            runnable = []
            for inv in invs:
                why = skip_reason(inv, tier)
                if why:
                    run.skipped.append({"invariant": inv.id, "tier": tier, "reason": why})
                    if progress is not None:
                        progress(f"{inv.id:18} {tier:5} SKIP  {why}")
                else:
                    runnable.append(inv)
            if not runnable:
                continue
            eng = (engines or {}).get(tier)
            worlds = None
            if eng is not None and hasattr(eng, "base") and hasattr(eng, "engine"):
                # a caller's Worlds (engine.worlds): its pools serve the
                # save / load-elsewhere scenarios, its base the others
                worlds, eng = eng, eng.base
            if eng is None and tier in early:
                eng = early[tier]
                eng.wait_ready()  # its ranks forked and in their group, or PoolStartError, as make_engine raises it
            if eng is None:
                eng = make_engine(tier, world_size=world_size, fake_world_size=fake_world_size, deadline=deadline)
                own.append(eng)
            for scenario, apis, ids in groups(runnable):
                engine = eng
                if scenario in LIFECYCLE and scenario.startswith("ckpt"):
                    if worlds is None:  # saved on one world size, loaded on another
                        from conformance.engine.worlds import Worlds

                        worlds = Worlds(eng)
                        own.append(worlds)
                    engine = worlds
                _run_group(run, session, target, tier, engine, scenario, apis, ids, examples, seed, natural, progress)
    finally:
        for e in reversed(own):
            e.close()
    run.seconds = time.perf_counter() - t0
    return run


def _run_group(run, session, target, tier, engine, scenario, apis, ids, examples, seed, natural, progress) -> None:
    config = settings(max_examples=examples, database=None, deadline=None, derandomize=seed is None,
                      suppress_health_check=list(HealthCheck), print_blob=False)
    one = _hypothesis_test(session, ids, engine, tier, model_case_strategy(target, scenario, apis),
                           natural_cases(target, scenario, apis) if natural else [], config)
    if seed is not None:
        one = hseed(seed)(one)
    run.checked += [(i, tier) for i in ids]
    t_group = time.perf_counter()
    failed: set[str] = set()
    try:
        one()
    except BaseException as e:  # noqa: BLE001 - the shrunk failures (a group of them), or an error of the run
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        if isinstance(e, pytest.skip.Exception):  # an API this torch lacks here (session.skip_if_unavailable)
            run.skipped += [{"invariant": i, "tier": tier, "reason": str(e.msg)} for i in ids]
            run.checked = [c for c in run.checked if not (c[1] == tier and c[0] in ids)]
            if progress is not None:
                for i in ids:
                    progress(f"{i:18} {tier:5} SKIP  {e.msg}")
            return
        for f in _failures(e, ids, tier):
            if f["invariant"] not in failed:  # the first (shrunk) failure of each invariant
                failed.add(f["invariant"])
                run.failures.append(f)
    if progress is not None:
        share = (time.perf_counter() - t_group) / len(ids)
        for i in ids:
            tallies = [t for (inv, tr, *_), t in session.tallies.items() if inv == i and tr == tier]
            verdict = "FAIL" if i in failed else ("KNOWN" if any(t.verdict == "KNOWN" for t in tallies) else
                                                  "PASS" if any(_verdict(t) == "PASS" for t in tallies) else "SKIP")
            n = sum(t.examples for t in tallies)
            checked = n - sum(t.verdicts.get("UNCHECKED", 0) for t in tallies)
            progress(f"{i:18} {tier:5} {verdict:5} {n:3} examples {checked:3} checked {share:7.1f}s")


def _failures(e: BaseException, ids: list[str], tier: str) -> list[dict]:
    """One record per failure in ``e`` (an InvariantFailed, or a group of
    them): the invariant, the violation lines, the case as Python and the
    repro path (from the session's notes); any other exception fails every
    invariant of the group with its type and message."""
    if isinstance(e, BaseExceptionGroup):
        return [f for sub in e.exceptions for f in _failures(sub, ids, tier)]
    notes = list(getattr(e, "__notes__", []))
    case = next((n.partition("\n")[2] for n in notes if n.startswith("Case (paste into Python):")), "")
    repro = next((n.partition(": ")[2] for n in notes if n.startswith("Standalone torch-only repro:")), "")
    if isinstance(e, InvariantFailed):
        lines = str(e).splitlines()
        # "INV: FAIL" then the violations, indented: the violations are the message
        message = "\n".join(x.strip() for x in lines[1:]) or lines[0] if lines else type(e).__name__
        return [{"invariant": e.invariant, "tier": tier, "message": message, "case": case, "repro": repro}]
    text = f"{type(e).__name__}: {e}".strip()
    return [{"invariant": i, "tier": tier, "message": text, "case": case, "repro": repro} for i in ids]


def _hypothesis_test(session, invariants: list[str], engine, tier: str, cases, naturals: list, config):
    """One Hypothesis test: ``invariants`` (one scenario's) on the natural
    cases, then on every drawn case, on ``engine``."""

    def test(case):
        if tier == "nccl" and case.ckpt is not None:
            import torch
            from hypothesis import assume

            # one GPU per rank: a checkpoint world this machine cannot hold is not drawn here
            assume(max(case.ckpt.save_world, case.ckpt.load_world) <= max(torch.cuda.device_count(), 1))
        session.check_example(invariants, case, engine, tier)

    test = given(case=cases)(test)
    for case in reversed(naturals):  # example() decorators run in the order they are written
        test = example(case=case)(test)
    return config(test)
