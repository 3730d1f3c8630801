"""check_model: every applicable invariant on a real model (a Target), with
Hypothesis drawing freeze masks, wrap policies, FSDP2 groupings and
registered methods over the model. The CLI (`fsdp-conformance model`), the
Python API (`conformance.check_model`) and the pytest plugin's fixture all
run through here."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hseed
from hypothesis import strategies as st

from conformance.areas import UnknownInvariant, select
from conformance.case.target import check_target
from conformance.run.session import Session
from strategies.targets import model_cases

# Invariants a model case can be checked on. FWD-SUMMON reads a drawn
# method's steps (which parameters it reads), which a real model's method
# does not declare.
NOT_FOR_MODELS = ("FWD-SUMMON",)
TIERS = ("fake", "gloo", "nccl")


@dataclass
class ModelRun:
    """What check_model found: per (invariant, tier) the first failure
    Hypothesis reported (its shrunk case and message), and the Session with
    every tally and finding (KNOWN ones included)."""

    target: str
    session: object
    failures: list[dict] = field(default_factory=list)  # {invariant, tier, message, case}
    checked: list[tuple[str, str]] = field(default_factory=list)  # (invariant, tier)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        lines = [f"{self.target}: {len(self.checked)} invariant/tier checks, {len(self.failures)} failing"]
        for t in self.session.tallies.values():
            known = sorted({f.known_failure for f in t.findings.values() if f.known_failure})
            lines.append(f"  {t.invariant:18} {t.api:6} {t.tier:5} {t.verdict:5} {t.examples:4} examples"
                         + (f"  KNOWN {', '.join(known)}" if known else ""))
        for f in self.failures:
            lines.append(f"FAIL {f['invariant']}/{f['tier']}: {f['message'].splitlines()[0][:300]}")
        return "\n".join(lines)


def model_invariants(ids_or_areas: list[str] | None = None) -> list:
    """The catalog's invariants that apply to model cases (by ID or area)."""

    # the lifecycle invariants need a checkpoint plan or a training schedule,
    # which model cases do not draw (yet)
    chosen = [inv for inv in select(ids_or_areas) if inv.id not in NOT_FOR_MODELS
              and not inv.scenario.startswith("ckpt") and inv.scenario != "schedule"]
    if not chosen:
        raise UnknownInvariant(", ".join(ids_or_areas or []) + " (none applies to a model)")
    return chosen


def _apis(inv) -> tuple[str, ...]:
    return tuple(inv.api.split("|"))


def make_engine(tier: str, *, world_size: int = 2, fake_world_size: int = 4, deadline: float = 120.0):
    if tier == "fake":
        from conformance.engine.fake import FakeEngine

        eng = FakeEngine(world_size=fake_world_size)
    else:
        from conformance.engine.pool import RankPool

        eng = RankPool(world_size=world_size, backend=tier, deadline=deadline)
    eng.tier = tier
    return eng


def check_model(
    target: str,
    *,
    invariants: list[str] | None = None,
    tiers: tuple[str, ...] | list[str] = ("fake",),
    examples: int = 10,
    seed: int | None = None,
    world_size: int = 2,
    fake_world_size: int = 4,
    deadline: float = 120.0,
    repro_dir: str | Path | None = None,
    engines: dict | None = None,
    session=None,
    progress=None,
) -> ModelRun:
    """Run every applicable invariant (or those named) on ``target``
    ("package.module:attr"), ``examples`` drawn cases each, on each tier.

    Raises TargetError (one line naming the target and what is wrong) before
    anything runs when the target cannot be used, UnknownInvariant for a bad
    name. ``engines`` (tier -> engine) lets a caller reuse its own; the ones
    made here are closed before returning, so no rank process outlives the
    call. ``progress(line)`` hears one line per invariant and tier done."""


    check_target(target)
    invs = model_invariants(invariants)
    bad = [t for t in tiers if t not in TIERS]
    if bad:
        raise ValueError(f"unknown tier {bad[0]!r}; choose from {', '.join(TIERS)}")
    if session is None:
        session = Session(repro_dir=Path(repro_dir) if repro_dir else None)
    run = ModelRun(target, session)
    t0 = time.perf_counter()
    own: dict = {}
    try:
        for tier in tiers:
            eng = (engines or {}).get(tier)
            if eng is None:
                eng = own[tier] = make_engine(tier, world_size=world_size, fake_world_size=fake_world_size, deadline=deadline)
            for inv in invs:
                if inv.id == "RANKS-AGREE" and tier == "fake":
                    continue  # one in-process rank has nothing to disagree with
                apis = _apis(inv)

                one = _hypothesis_test(
                    session, inv.id, eng, tier, model_cases(target, apis=st.sampled_from(apis)),
                    settings(max_examples=examples, database=None, deadline=None, derandomize=seed is None,
                             suppress_health_check=list(HealthCheck), print_blob=False),
                )
                if seed is not None:
                    one = hseed(seed)(one)
                run.checked.append((inv.id, tier))
                t_inv = time.perf_counter()
                failed = len(run.failures)
                try:
                    one()
                except Exception as e:  # the shrunk failure (or Hypothesis's group of them)
                    notes = "\n".join(getattr(e, "__notes__", []))
                    run.failures.append({"invariant": inv.id, "tier": tier, "message": f"{e}\n{notes}".strip() if isinstance(e, AssertionError) else f"{type(e).__name__}: {e}\n{notes}".strip()})
                if progress is not None:
                    tallies = [t for (i, tr, *_), t in session.tallies.items() if i == inv.id and tr == tier]
                    verdict = "FAIL" if len(run.failures) > failed else ("KNOWN" if any(t.verdict == "KNOWN" for t in tallies) else "PASS")
                    n = sum(t.examples for t in tallies)
                    progress(f"{inv.id:18} {tier:5} {verdict:5} {n:3} examples {time.perf_counter() - t_inv:7.1f}s")
    finally:
        for eng in own.values():
            eng.close()
    run.seconds = time.perf_counter() - t0
    return run


def _hypothesis_test(session, invariant: str, engine, tier: str, cases, config):
    """One Hypothesis test: ``invariant`` on every drawn case, on ``engine``."""

    @config
    @given(case=cases)
    def test(case):
        session.check(invariant, case, engine, tier)

    return test


