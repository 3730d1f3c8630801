"""One conformance session: runs cases, records verdicts per invariant, API
and tier, keeps the smallest case of every finding, writes repro scripts."""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch
from hypothesis import event

from conformance.areas import CATALOG, area_of, get
from conformance.areas.common import support
from conformance.case.spec import CaseSpec
from conformance.case.tree import walk
from conformance.engine.errors import ExampleFailed
from conformance.run import corpus as corpus_mod
from conformance.run import known as known_mod
from conformance.run.features import case_features
from conformance.run.repro import repro_script
from conformance.run.runner import FAIL, KNOWN, PASS, CaseResult, ScenarioFailed, Timing, check_example, known_engine_failure

EXPECTTEST_HINT = "expected-output snapshots: rerun with EXPECTTEST_ACCEPT=1 to accept new texts"

# Finding kinds. FAIL, HANG, CRASH and ERROR make the invariant's verdict FAIL.
HANG, CRASH, ERROR = "HANG", "CRASH", "ERROR"
FAILING_KINDS = (FAIL, HANG, CRASH, ERROR)


class InvariantFailed(AssertionError):
    """FSDP broke an invariant on an example; one subclass per invariant
    (failure_type), so that Hypothesis tells the invariants' failures apart."""

    invariant = ""


_FAILURE_TYPES: dict[str, type[InvariantFailed]] = {}


def failure_type(invariant_id: str) -> type[InvariantFailed]:
    if invariant_id not in _FAILURE_TYPES:
        name = "InvariantFailed_" + "".join(c if c.isalnum() else "_" for c in invariant_id)
        _FAILURE_TYPES[invariant_id] = type(name, (InvariantFailed,), {"invariant": invariant_id, "__module__": __name__})
    return _FAILURE_TYPES[invariant_id]


def size(spec: CaseSpec) -> tuple[int, int]:
    """How big a case is: modules first, then the length of its JSON (a
    ModelCase: its frozen parameters, then its JSON)."""
    own = getattr(spec, "size", None)
    if own is not None:
        return own()
    return sum(1 for _ in walk(spec.tree)), len(spec.to_json())


def skip_if_unavailable(invariant: str, spec: CaseSpec, tier: str) -> None:
    """An API this torch lacks (or cannot run here) is a SKIP with its reason
    (the area's own check; conformance.areas.common.support), never a crash."""
    area = area_of(invariant)
    reason = support.unavailable(api_of(invariant, spec), get(invariant).scenario, tier) or (area.unavailable(spec) if area.unavailable else None)
    if reason:
        pytest.skip(reason)


def api_of(invariant: str, spec: CaseSpec | None = None) -> str:
    """The FSDP API an example exercised: the spec's plan says, else the catalog."""
    api = getattr(getattr(spec, "plan", None), "api", None)
    if api:
        return api
    inv = CATALOG.get(invariant)
    return inv.api if inv is not None else "?"


def model_of(spec) -> str:
    """The real model an example ran on (a ModelCase's target,
    "package.module:attr"); "" for a synthetic case. A model's examples
    get rows of their own beside the synthetic ones."""
    return getattr(spec, "target", None) or ""


@dataclass
class Finding:
    """One distinct deviation seen for one invariant on one tier: the smallest
    case that showed it, and how often it showed."""

    kind: str  # FAIL | KNOWN | HANG | CRASH | ERROR
    key: str  # unique within its tally: "known:<id>", "FAIL:<kind tags>", "HANG", ...
    spec: CaseSpec
    message: str
    violations: list[dict] = field(default_factory=list)  # {invariant, message, tags}
    known_failure: str | None = None
    count: int = 0
    engine: dict | None = None  # ExampleFailed.to_dict() for HANG / CRASH
    repro: str | None = None  # path of the repro script, once written
    # size(spec), kept: every later example of the finding is compared with it
    # (a JSON dump of the case), and the common KNOWN rows see thousands
    spec_size: tuple[int, int] | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "key": self.key,
            "message": self.message,
            "violations": self.violations,
            "known_failure": self.known_failure,
            "count": self.count,
            "spec": json.loads(self.spec.to_json()),
            "spec_python": self.spec.to_python(),
            "engine": self.engine,
            "repro": self.repro,
        }


@dataclass
class Tally:
    invariant: str
    tier: str
    api: str = "fsdp1"
    model: str = ""  # a real model's target; "" for the synthetic cases
    examples: int = 0
    verdicts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    findings: dict[str, Finding] = field(default_factory=dict)
    features: dict[str, int] = field(default_factory=dict)  # examples per case feature (conformance.run.features)
    unchecked: dict[str, int] = field(default_factory=dict)  # examples that compared nothing, by reason

    @property
    def verdict(self) -> str:
        for v in FAILING_KINDS:
            if self.verdicts.get(v):
                return FAIL
        return KNOWN if self.verdicts.get(KNOWN) else PASS

    def add(self, finding: Finding) -> None:
        old = self.findings.get(finding.key)
        if old is None:
            finding.count = finding.count or 1
            self.findings[finding.key] = finding
            return
        old.count += 1
        if old.spec_size is None:
            old.spec_size = size(old.spec)
        new_size = size(finding.spec)
        if new_size < old.spec_size:
            old.spec, old.message, old.violations, old.engine = finding.spec, finding.message, finding.violations, finding.engine
            old.repro, old.spec_size = None, new_size

    def to_dict(self) -> dict:
        return {
            "invariant": self.invariant,
            "api": self.api,
            "tier": self.tier,
            "model": self.model or None,
            "examples": self.examples,
            "outcomes": dict(self.verdicts),
            "seconds": round(self.seconds, 3),
            "features": dict(self.features),
            "unchecked": dict(self.unchecked),
            "findings": [f.to_dict() for f in self.findings.values()],
        }


def _violation_dict(v) -> dict:
    return {"invariant": v.invariant, "message": v.message, "tags": sorted(v.tags)}


def _fail_key(violations) -> str:
    kinds = sorted({t for v in violations for t in v.tags if t.startswith("kind:")})
    return "FAIL:" + (",".join(kinds) or violations[0].invariant)


def _in_final_replay() -> bool:
    """True outside Hypothesis, or in the replay of the shrunk example that
    Hypothesis reports; False while it is still searching or shrinking."""
    try:
        from hypothesis.control import _current_build_context

        ctx = _current_build_context.value
    except Exception:  # pragma: no cover - older Hypothesis
        return True
    return ctx is None or bool(getattr(ctx, "is_final", True))


class Session:
    def __init__(self, repro_dir: Path | None = None, known_path: Path = known_mod.DEFAULT_PATH):
        self.known = known_mod.load(known_path)
        self.tallies: dict[tuple[str, str, str, str], Tally] = {}  # (invariant, tier, api, model)
        self.repro_dir = repro_dir
        self.on_change: Callable[[], None] | None = None  # called after every example (reports throttle it)
        self.interrupted: str | None = None  # a signal that ended the run: every later example raises KeyboardInterrupt
        self.corpus: dict[tuple[str, str, str], dict] = {}  # (case, invariant, tier) -> outcome of a corpus case
        # a corpus case by its spec: CaseSpec is a frozen dataclass, so equal
        # specs hash alike (cheaper than digesting every example's JSON)
        self._corpus_index = corpus_mod.by_spec()
        # rank tiers run with one rank: their corpus cases (recorded at world
        # size 2) cannot show a rank-dependent deviation, so they check nothing
        self._one_rank_tiers: set[str] = set()
        # the invariants the run selected (--invariant); None: all
        self.selected: set[str] | None = None
        # where each example's time went (the bench reads them); None: not kept
        self.timings: list[Timing] | None = None
        self._last_corpus: tuple[CaseSpec | None, corpus_mod.CorpusCase | None] = (None, None)

    def tally(self, invariant: str, tier: str, api: str | None = None, model: str = "") -> Tally:
        api = api or api_of(invariant)
        return self.tallies.setdefault((invariant, tier, api, model), Tally(invariant, tier, api, model))

    def record(self, res: CaseResult, tier: str, seconds: float) -> None:
        t = self.tally(res.invariant, tier, api_of(res.invariant, res.spec), model_of(res.spec))
        t.examples += 1
        t.seconds += seconds
        t.verdicts[res.verdict] = t.verdicts.get(res.verdict, 0) + 1
        if res.unchecked:
            t.unchecked[res.unchecked] = t.unchecked.get(res.unchecked, 0) + 1
        by_known: dict[str, list] = {}
        for v, fid in res.known:
            by_known.setdefault(fid, []).append(v)
        self._record_corpus(res.invariant, res.spec, tier, res.verdict, sorted(by_known))
        for fid, vs in by_known.items():
            t.add(Finding(KNOWN, f"known:{fid}", res.spec, str(vs[0]), [_violation_dict(v) for v in vs], known_failure=fid))
        if res.violations:
            t.add(Finding(FAIL, _fail_key(res.violations), res.spec, str(res.violations[0]), [_violation_dict(v) for v in res.violations]))
        self._changed()

    def record_failure(self, invariant: str, spec: CaseSpec, tier: str, seconds: float, kind: str, message: str, engine: dict | None = None) -> Finding:
        """An example that gave no verdict: HANG / CRASH from the engine, or
        ERROR (the scenario raised inside a rank)."""
        t = self.tally(invariant, tier, api_of(invariant, spec), model_of(spec))
        t.examples += 1
        t.seconds += seconds
        t.verdicts[kind] = t.verdicts.get(kind, 0) + 1
        t.add(Finding(kind, kind, spec, message, [], engine=engine))
        self._record_corpus(invariant, spec, tier, kind, [])
        self._changed()
        return t.findings[kind]

    def _features(self, invariants: list[str], spec: CaseSpec, engine, tier: str) -> None:
        """Count the example's case features for each invariant's row (and
        report them to Hypothesis as events: ``--hypothesis-show-statistics``)."""
        try:
            feats = case_features(spec, getattr(engine, "world_size", 2))
        except Exception:  # an oracle that rejects the case: no features, the check says why
            feats = []
        for invariant in invariants:
            t = self.tally(invariant, tier, api_of(invariant, spec), model_of(spec))
            for f in feats:
                t.features[f] = t.features.get(f, 0) + 1
        for f in feats:
            try:
                event(f"case: {f}")
            except Exception:  # outside a Hypothesis test (check, repro)
                pass

    def _record_corpus(self, invariant: str, spec: CaseSpec, tier: str, verdict: str, known: list[str]) -> None:
        """Remember what a corpus case gave (the report tells a finding that
        no longer reproduces, FIXED, from one that was not checked)."""
        if not self._corpus_index:
            return
        # every invariant of an example records the same spec: look it up once
        if self._last_corpus[0] is not spec:
            try:
                self._last_corpus = (spec, self._corpus_index.get(spec))
            except TypeError:  # a spec type that does not hash: no corpus case is one
                self._last_corpus = (spec, None)
        case = self._last_corpus[1]
        if case is None or (case.tier == "ranks" and tier in self._one_rank_tiers):
            return
        if invariant not in case.invariants:
            # the example runs every invariant of its area; the case shows its
            # finding only where it says it does: elsewhere its PASS says
            # nothing of whether the finding is fixed
            return
        rec = self.corpus.setdefault((case.name, invariant, tier), {
            "case": case.name, "finding": case.finding, "case_tier": case.tier,
            "invariant": invariant, "tier": tier, "verdicts": {}, "known": [],
        })
        rec["verdicts"][verdict] = rec["verdicts"].get(verdict, 0) + 1
        rec["known"] = sorted(set(rec["known"]) | set(known))

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def check(self, invariant: str, spec: CaseSpec, engine, tier: str) -> CaseResult:
        """One invariant on one example (check_example for that one)."""
        return self.check_example([invariant], spec, engine, tier)[0]

    def check_example(self, invariants: list[str], spec: CaseSpec, engine, tier: str) -> list[CaseResult]:
        """Run one example once for every invariant of ``invariants`` that
        the run selected (each scenario they need once); record a verdict
        per invariant. Raises, when FSDP breaks some of them, one
        InvariantFailed per broken invariant (an ExceptionGroup of them for
        several: Hypothesis keeps each distinct failure apart and shrinks it
        on its own), with the case as Python and the repro path as notes."""
        if self.interrupted:
            raise KeyboardInterrupt(self.interrupted)
        invariants = [i for i in invariants if self.selected is None or i in self.selected]
        if not invariants:
            pytest.skip("no invariant of this test is selected")
        for i in invariants:
            skip_if_unavailable(i, spec, tier)
        if tier != "fake" and getattr(engine, "world_size", 2) < 2:
            self._one_rank_tiers.add(tier)
        self._features(invariants, spec, engine, tier)
        t0 = time.perf_counter()
        try:
            results = check_example(invariants, spec, engine, self.known, self.timings)
        except ExampleFailed as e:
            self._engine_failed(invariants, spec, tier, e, time.perf_counter() - t0)
            return []
        except ScenarioFailed as e:
            first = (str(e).splitlines() or [type(e).__name__])[0]
            share = (time.perf_counter() - t0) / len(invariants)
            for i in invariants:
                self.record_failure(i, spec, tier, share, ERROR, first)
            err = failure_type(invariants[0])(f"{', '.join(invariants)}: {first}")
            self._annotate(err, spec, invariants[0], [first])
            raise err from e
        share = (time.perf_counter() - t0) / len(results)
        for res in results:
            self.record(res, tier, share)
        errors = []
        for res in results:
            if res.verdict == FAIL:
                err = failure_type(res.invariant)(res.describe())
                self._annotate(err, spec, res.invariant, [str(v) for v in res.violations], res)
                errors.append(err)
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise ExceptionGroup(f"{len(errors)} invariants broken: {', '.join(e.invariant for e in errors)}", errors)
        return results

    def _engine_failed(self, invariants: list[str], spec: CaseSpec, tier: str, e, seconds: float) -> None:
        """A HANG or CRASH: none of ``invariants`` got a verdict. Recorded
        KNOWN for each where a known failure describes it, else as the
        engine's verdict; raises unless every one was KNOWN."""
        share = seconds / len(invariants)
        failing = []
        for i in invariants:
            if self._known_engine_failure(i, spec, e, share, tier) is None:
                self.record_failure(i, spec, tier, share, e.verdict, str(e), e.to_dict())
                failing.append(i)
        if failing:
            err = failure_type(failing[0])(f"{', '.join(failing)}: {e}")
            self._annotate(err, spec, failing[0], [str(e)])
            raise err from e

    def _known_engine_failure(self, invariant: str, spec: CaseSpec, e, seconds: float, tier: str) -> CaseResult | None:
        """A HANG / CRASH that a known failure describes (only for invariants
        that register their case tags for it): recorded KNOWN."""
        res = known_engine_failure(invariant, spec, e, self.known)
        if res is not None:
            self.record(res, tier, seconds)
        return res

    def _annotate(self, err: BaseException, spec: CaseSpec, invariant: str, lines: list[str], res: CaseResult | None = None) -> None:
        err.add_note("Case (paste into Python):\n" + spec.to_python())
        # Hypothesis raises many times while it shrinks; only the example it
        # finally reports gets a script.
        if _in_final_replay():
            path = self.write_repro(spec, res) if res is not None else self.write_repro_lines(spec, invariant, lines)
            if path:
                err.add_note(f"Standalone torch-only repro: {path}")

    def write_repro(self, spec: CaseSpec, res: CaseResult) -> Path | None:
        return self.write_repro_lines(spec, res.invariant, [str(v) for v in res.violations] + [f"KNOWN {fid}: {v}" for v, fid in res.known])

    def write_repro_lines(self, spec: CaseSpec, invariant: str, lines: list[str]) -> Path | None:
        if self.repro_dir is None:
            return None
        return write_repro_file(self.repro_dir, spec, invariant, lines)

    def unused_known(self) -> list[known_mod.KnownFailure]:
        """Known failures for this torch whose invariant ran but never matched."""
        ran = {key[0] for key in self.tallies}
        hit = {f.known_failure for t in self.tallies.values() for f in t.findings.values() if f.known_failure}
        return [
            k for k in self.known
            if k.invariants & ran and k.id not in hit and known_mod.in_range(torch.__version__, k.torch)
        ]

    def to_dict(self) -> dict:
        return {"tallies": [t.to_dict() for t in self.tallies.values()], "corpus": list(self.corpus.values())}


def repro_name(spec: CaseSpec, invariant: str) -> str:
    digest = hashlib.sha1(spec.to_json().encode()).hexdigest()[:10]
    return f"{invariant}-{digest}.py"


def write_repro_file(repro_dir: Path, spec: CaseSpec, invariant: str, lines: list[str]) -> Path:
    """Write (atomically) the torch-only repro script of ``spec``; its name is
    the invariant and a digest of the case, so writing it twice is harmless."""
    repro_dir = Path(repro_dir)
    repro_dir.mkdir(parents=True, exist_ok=True)
    path = repro_dir / repro_name(spec, invariant)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(repro_script(spec, lines, title=invariant))
    tmp.replace(path)
    return path
