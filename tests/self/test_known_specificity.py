"""A known finding matches its own mechanism only: a different deviation in a
case that carries the finding's tags is a FAIL, never KNOWN.

For every finding with a corpus case that reproduces on the fake tier (its
minimal case: one that carries its tags), the case runs and shows the
finding. Then a different deviation is planted in it: each violation the
case shows is given every other kind of deviation its invariant reports (the
kinds any finding names for it, and one no finding names) that the finding
does not claim for that invariant, and must then match no finding of the
case's. End to end, a registered method that calls self(...) (the territory
of fsdp2-forward-method-calls-self) and returns noise is FAIL on gloo.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conformance.case.spec import (
    CaseSpec,
    ClassSpec,
    ForwardMethod,
    MethodCall,
    MethodStep,
    ModuleSpec,
    ParamSpec,
    ShardGroup,
    WrapPlan,
)
from conformance.run import corpus, known
from conformance.run.runner import FAIL, KNOWN, check_case, evaluate, observations
from tests.self import faults_fsdp2  # noqa: F401  (registers the fault scenarios)

pytestmark = pytest.mark.selfcheck

KNOWN_FAILURES = known.load()
PLANTED = "kind:planted-elsewhere"  # a kind of deviation no finding names


def _kinds() -> dict[str, set[str]]:
    """Invariant -> every kind of deviation some finding names for it."""
    out: dict[str, set[str]] = {}
    for k in KNOWN_FAILURES:
        for m in k.matches_:
            out.setdefault(m.invariant, set()).update(t for t in m.when if t.startswith("kind:"))
    return out


KINDS = _kinds()


def _claimed(k: known.KnownFailure, invariant: str) -> set[str]:
    return {t for m in k.matches_ if m.invariant == invariant for t in m.when if t.startswith("kind:")}


def test_every_match_names_the_kind_of_deviation():
    """The invariant and case tags alone would absorb any deviation of the case."""
    loose = [(k.id, m.invariant, sorted(m.when)) for k in KNOWN_FAILURES for m in k.matches_
             if not any(t.startswith("kind:") for t in m.when)]
    assert not loose, f"matches without a kind: tag: {loose}"


RAISING = ("kind:raised", "kind:backward-raised", "kind:state-dict-raised", "kind:unclear-rejection", "kind:unclear-error")


def test_a_match_on_an_exception_names_the_exception():
    """A finding that raises one error must not absorb another that the same
    case raises: its match names the exception (raised:<Type>, which the
    violation factory derives from the message, or the area's own error:
    classification)."""
    loose = [(k.id, m.invariant, sorted(m.when)) for k in KNOWN_FAILURES for m in k.matches_
             if any(t in m.when for t in RAISING) and not any(t.startswith(("raised:", "error:")) for t in m.when)]
    assert not loose, f"matches on an exception that do not name it: {loose}"


def test_the_violation_factory_names_the_exception():
    from conformance.areas.common.violations import violation

    assert "raised:RuntimeError" in violation("FWD-PARITY", "call 1 raised RuntimeError: mixed", set(), "kind:raised").tags
    assert "raised:ValueError" in violation("FSDP2-TIES", "is rejected without naming the tie: ValueError: x", set(), "kind:unclear-error").tags
    assert not any(t.startswith("raised:") for t in violation("FWD-PARITY", "output differs by 0.1", set(), "kind:output").tags)


def _fake_cases():
    in_range = {k.id for k in KNOWN_FAILURES if known.in_range(torch.__version__, k.torch)}
    return [c for c in corpus.load() if c.tier == "fake" and c.finding in in_range]


@pytest.mark.fake
@pytest.mark.parametrize("case", _fake_cases(), ids=lambda c: c.name)
def test_a_different_deviation_in_the_findings_case_is_not_known(case, fake_engine):
    finding = next(k for k in KNOWN_FAILURES if k.id == case.finding)
    res = check_case(case.invariants[0], case.spec, fake_engine)
    assert (res.verdict, case.finding) in {(KNOWN, fid) for _, fid in res.known}, res.describe()
    shown = [v for v, fid in res.known if fid == finding.id]
    assert shown, res.describe()
    for v in shown:
        kind = next(t for t in v.tags if t.startswith("kind:"))
        for other in (KINDS.get(v.invariant, set()) | {PLANTED}) - _claimed(finding, v.invariant) - {kind}:
            planted = dataclasses.replace(v, tags=frozenset(v.tags - {kind} | {other}))
            hit = known.match(planted, KNOWN_FAILURES, torch.__version__)
            assert hit is None or hit.id != finding.id, (
                f"{finding.id} absorbs a {other} deviation of {v.invariant} in its own case: {sorted(planted.tags)}")


def self_calling(reshard: bool) -> CaseSpec:
    """A root method generate() that calls self(...) and then reads the root's
    own parameter; the root group's reshard_after_forward as given."""
    tree = ModuleSpec("", "Model", (ParamSpec("scale", (3,)),), children=(ModuleSpec("proj", "Linear", (ParamSpec("weight", (3, 3)),)),))
    generate = ForwardMethod("", "generate", (MethodStep("call", ""), MethodStep("param", "scale")))
    return CaseSpec(tree=tree, classes=(ClassSpec("Model"),), plan=WrapPlan(api="fsdp2", groups=(ShardGroup(("",), reshard),)),
                    methods=(generate,), calls=(MethodCall(-1), MethodCall(0)), seed=4)


@pytest.fixture(scope="module")
def pool(fault_pools):
    return fault_pools(2)


@pytest.mark.gloo
def test_a_noisy_self_calling_method_is_a_failure_not_the_self_call_finding(pool):
    from conformance.areas.fully_shard.observation import FSDP2Observation

    spec = self_calling(reshard=False)
    # the case is in the finding's territory: unmodified torch shows it (the
    # inner post-forward reshards the root against reshard_after_forward=False)
    res = evaluate("FWD-RESHARD", spec, observations(pool, spec, "fsdp2"), KNOWN_FAILURES)
    assert {fid for _, fid in res.known} == {"fsdp2-forward-method-calls-self"}, res.describe()
    plain = evaluate("FWD-PARITY", spec, observations(pool, spec, "fsdp2"), KNOWN_FAILURES)
    assert plain.verdict != FAIL, plain.describe()
    # registration that runs FSDP's hooks but returns noise: a different bug
    noisy = observations(pool, spec, "fault:fsdp2:registered-output-noise", FSDP2Observation.from_dict)
    res = evaluate("FWD-PARITY", spec, noisy, KNOWN_FAILURES)
    assert res.verdict == FAIL, res.describe()
    assert any("kind:output" in v.tags and "method-calls-self" in v.tags for v in res.violations), res.describe()


def test_known_failures_are_parsed_once_per_content(tmp_path):
    """known.load parses the file once while it is unchanged (hundreds of
    calls per test process) and again once it is edited."""
    path = tmp_path / "known_failures.toml"
    path.write_text(known.DEFAULT_PATH.read_text())
    first = known.load(path)
    again = known.load(path)
    assert first == again and first is not again and all(a is b for a, b in zip(first, again))
    text = path.read_text()
    fid = first[0].id
    path.write_text(text.replace(f'id = "{fid}"', f'id = "{fid}-edited"', 1))
    assert known.load(path)[0].id == f"{fid}-edited"
