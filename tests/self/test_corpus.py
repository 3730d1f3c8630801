"""The regression corpus: every known finding has a minimal case, the
conformance tests check each case first (as explicit examples), a case that
still deviates is KNOWN and one whose deviation is patched away is FIXED."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from conformance.report import data
from conformance.run import corpus, known
from conformance.run.runner import KNOWN, PASS, check_case
from conformance.run.session import Session
from tests.self import cases
from tests.self.test_faults import _dropping_last_target

pytestmark = [pytest.mark.selfcheck, pytest.mark.fake]

SUITE = "conformance.suite"


def test_every_known_failure_has_a_corpus_case_and_every_case_a_finding():
    ids = {k.id for k in known.load() if not k.no_corpus}  # no_corpus: the entry says why
    findings = {c.finding for c in corpus.load()}
    assert ids - findings == set(), "known failures without a corpus case (add one: conformance/corpus/)"
    assert findings - {k.id for k in known.load()} - {None} == set(), "corpus cases naming no known failure"
    from conformance.areas import CATALOG

    for c in corpus.load():
        assert set(c.invariants) <= set(CATALOG), c.name


def _explicit_specs() -> list:
    out = []
    pkg = importlib.import_module(SUITE)
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"{SUITE}.{info.name}")
        for obj in vars(mod).values():
            for ex in getattr(obj, "hypothesis_explicit_examples", ()):
                out.append(ex.kwargs.get("spec"))
    return out


def test_the_conformance_tests_check_every_corpus_case():
    attached = {corpus.spec_digest(s) for s in _explicit_specs() if s is not None}
    missing = [c.name for c in corpus.load() if c.digest not in attached]
    assert not missing, f"corpus cases no conformance test runs: {missing}"


def _skip_outside_its_range(case) -> None:
    k = next(k for k in known.load() if k.id == case.finding)
    if not known.in_range(torch.__version__, k.torch):
        pytest.skip(f"{k.id} is recorded for torch {k.torch}, not {torch.__version__}")


@pytest.mark.parametrize("case", [c for c in corpus.load() if c.tier == "fake" and c.finding], ids=lambda c: c.name)
def test_a_corpus_case_reproduces_its_finding(case, fake_engine):
    _skip_outside_its_range(case)
    res = check_case(case.invariants[0], case.spec, fake_engine)
    assert (res.verdict, case.finding) in {(KNOWN, fid) for _, fid in res.known}, res.describe()


SYNTHETIC = """
[[root_cause]]
id = "synthetic"
explanation = "a deliberate regression"
source = "-"

[[finding]]
id = "synthetic-dropped-unit"
title = "[FSDP1] synthetic"
torch = ">=2.0"
class = "bug"
evidence = "a self-test of the corpus"
root_cause = "synthetic"
upstream_searched = "-"
summary = "a deliberate regression standing in for a torch finding: ModuleWrapPolicy drops its last target"
repro = "-"
[[finding.match]]
invariant = "WRAP-UNITS"
when = ["kind:missing-unit"]
"""


def _synthetic_corpus(tmp_path, monkeypatch, known_text: str, finding: str, spec):
    """known_failures.toml ``known_text`` and a corpus of one case (for
    ``finding``, WRAP-UNITS, fake tier) in tmp_path; returns the TOML's path.
    The caller clears corpus.load's cache when done."""
    known_path = tmp_path / "known.toml"
    known_path.write_text(known_text)
    corpus.write(tmp_path / "corpus", finding, spec, ["WRAP-UNITS"], finding, "fake", "test")
    monkeypatch.setenv(corpus.ENV_VAR, str(tmp_path / "corpus"))
    corpus.load.cache_clear()
    return known_path


def _report(session: Session, tier: str = "fake", world_size: int = 4) -> dict:
    return data.build(
        partials=[session.to_dict()],
        run={"tiers": [{"tier": tier, "backend": tier, "world_size": world_size}]},
        known=session.known,
        environment={"suite": {}, "torch": {"version": torch.__version__}, "platform": {}},
    )


def _fixed_only_by_its_own_run(report: dict, known_path, spec, fake_engine) -> None:
    """``report`` turned nothing FIXED; the case's own run (WRAP-UNITS on the
    fake tier) does."""
    assert [k["status"] for k in report["known_failures"]] != ["fixed"]
    assert all(x["verdict"] != "FIXED" for x in report["results"]), [x for x in report["results"] if x["verdict"] == "FIXED"]
    s = Session(known_path=known_path)
    assert s.check("WRAP-UNITS", spec, fake_engine, "fake").verdict == PASS
    assert [k["status"] for k in _report(s)["known_failures"]] == ["fixed"]


def test_a_known_finding_turns_fixed_when_its_deviation_is_patched_away(tmp_path, monkeypatch, fake_engine):
    """The stand-in finding: a monkeypatched ModuleWrapPolicy that drops a
    unit, recorded as known with its corpus case. While the fault is in,
    the case is KNOWN; once it is patched away, the report says FIXED and
    warns of nothing."""
    spec = cases.two_blocks()
    known_path = _synthetic_corpus(tmp_path, monkeypatch, SYNTHETIC, "synthetic-dropped-unit", spec)
    try:
        with monkeypatch.context() as m:
            m.setattr(ModuleWrapPolicy, "_run_policy", _dropping_last_target(ModuleWrapPolicy._run_policy))
            s = Session(known_path=known_path)
            assert s.check("WRAP-UNITS", spec, fake_engine, "fake").verdict == KNOWN
            r = _report(s)
            assert [k["status"] for k in r["known_failures"]] == ["matched"]
            assert [(c["outcome"], c["finding_status"]) for c in r["corpus"]] == [("reproduced", "matched")]
            assert next(x for x in r["results"] if x["invariant"] == "WRAP-UNITS")["verdict"] == KNOWN

        s = Session(known_path=known_path)
        assert s.check("WRAP-UNITS", spec, fake_engine, "fake").verdict == PASS
        r = _report(s)
        assert [k["status"] for k in r["known_failures"]] == ["fixed"]
        assert [(c["outcome"], c["finding_status"]) for c in r["corpus"]] == [("PASS", "fixed")]
        assert next(x for x in r["results"] if x["invariant"] == "WRAP-UNITS")["verdict"] == "FIXED"
        assert r["warnings"] == []
        assert r["status"] == "complete" and r["complete"]
    finally:
        corpus.load.cache_clear()


def test_a_corpus_case_passing_an_invariant_it_does_not_list_fixes_nothing(tmp_path, monkeypatch, fake_engine):
    """The corpus case is listed for WRAP-UNITS; its finding also matches
    WRAP-FQNS. Checked on WRAP-FQNS alone (a run that selects only that
    one: the case runs as its area's explicit example), it passes, which
    says nothing of the finding: not FIXED (it once was)."""
    spec = cases.two_blocks()
    text = SYNTHETIC + '[[finding.match]]\ninvariant = "WRAP-FQNS"\nwhen = ["kind:never-produced"]\n'
    known_path = _synthetic_corpus(tmp_path, monkeypatch, text, "synthetic-dropped-unit", spec)
    try:
        s = Session(known_path=known_path)
        assert s.check("WRAP-FQNS", spec, fake_engine, "fake").verdict == PASS
        _fixed_only_by_its_own_run(_report(s), known_path, spec, fake_engine)
    finally:
        corpus.load.cache_clear()


def test_a_fake_corpus_case_passing_on_the_gloo_pool_fixes_nothing(tmp_path, monkeypatch, fake_engine):
    """A corpus case recorded on the fake tier (4 ranks) is evidence there
    only: on the 2-rank gloo pool it is another world, and its PASS there is
    no FIXED (the release matrix's gloo rows called
    fsdp2-frozen-int-reshard-group-not-last-backward FIXED on 2.12.1 and
    2.13.0, whose repro deviates on 4 ranks)."""
    spec = cases.two_blocks()
    known_path = _synthetic_corpus(tmp_path, monkeypatch, SYNTHETIC, "synthetic-dropped-unit", spec)
    try:
        s = Session(known_path=known_path)
        assert s.check("WRAP-UNITS", spec, fake_engine, "gloo").verdict == PASS  # recorded as run on the pool
        _fixed_only_by_its_own_run(_report(s, "gloo", 2), known_path, spec, fake_engine)
    finally:
        corpus.load.cache_clear()


def test_a_corpus_case_of_one_api_fixes_no_row_of_the_other(tmp_path, monkeypatch, fake_engine):
    """The synthetic case is FSDP1's: its PASS turns the FSDP1 row FIXED and
    leaves another API's row of the same invariant PASS (the 2.9.1 gloo
    matrix row had PARITY fsdp1 and CLIP-NORM fsdp1 FIXED by
    fsdp2-list-group-reentered-loses-grad's FSDP2 case)."""
    spec = cases.two_blocks()
    known_path = _synthetic_corpus(tmp_path, monkeypatch, SYNTHETIC, "synthetic-dropped-unit", spec)
    try:
        s = Session(known_path=known_path)
        assert s.check("WRAP-UNITS", spec, fake_engine, "fake").verdict == PASS
        other = s.tally("WRAP-UNITS", "fake", "fsdp2", None)  # a row of another API, as PARITY has
        other.examples, other.verdicts = 1, {PASS: 1}
        rows = {(x["invariant"], x["api"]): x["verdict"] for x in _report(s)["results"] if x["invariant"] == "WRAP-UNITS"}
        assert rows == {("WRAP-UNITS", "fsdp1"): "FIXED", ("WRAP-UNITS", "fsdp2"): PASS}, rows
    finally:
        corpus.load.cache_clear()


MASKING = SYNTHETIC + """
[[finding]]
id = "synthetic-masked"
title = "[FSDP1] synthetic"
torch = ">=2.0"
class = "bug"
evidence = "a self-test of the corpus"
root_cause = "synthetic"
upstream_searched = "-"
summary = "a finding whose corpus case now stops at another finding first"
repro = "-"
[[finding.match]]
invariant = "WRAP-UNITS"
when = ["kind:never-produced"]
"""


def test_a_corpus_case_stopped_by_another_finding_is_masked_not_fixed(tmp_path, monkeypatch, fake_engine):
    """The corpus case of one finding shows only another: the report says
    the case no longer isolates its finding (status masked, a warning), and
    no row turns FIXED."""
    spec = cases.two_blocks()
    known_path = _synthetic_corpus(tmp_path, monkeypatch, MASKING, "synthetic-masked", spec)
    try:
        monkeypatch.setattr(ModuleWrapPolicy, "_run_policy", _dropping_last_target(ModuleWrapPolicy._run_policy))
        s = Session(known_path=known_path)
        assert s.check("WRAP-UNITS", spec, fake_engine, "fake").verdict == KNOWN
        r = _report(s)
        status = {k["id"]: k["status"] for k in r["known_failures"]}
        assert status == {"synthetic-dropped-unit": "matched", "synthetic-masked": "masked"}
        assert [c["finding_status"] for c in r["corpus"]] == ["masked"]
        assert next(x for x in r["results"] if x["invariant"] == "WRAP-UNITS")["verdict"] == KNOWN
        assert any("synthetic-masked" in w and "synthetic-dropped-unit" in w for w in r["warnings"]), r["warnings"]
    finally:
        corpus.load.cache_clear()


def test_a_case_outside_the_corpus_is_not_recorded_as_one(fake_engine):
    s = Session()
    s.check("WRAP-UNITS", cases.two_blocks(), fake_engine, "fake")
    assert s.to_dict()["corpus"] == []


@pytest.mark.gloo
def test_a_one_rank_pool_does_not_check_a_rank_corpus_case():
    """The NCCL check on one GPU (world size 1) reported RANKS-AGREE FIXED: the
    corpus case of a rank-dependent finding cannot deviate with one rank."""
    from conformance.engine.pool import RankPool

    case = next(c for c in corpus.load() if c.finding == "fsdp1-size-policy-rank-dependent-units")
    for world, recorded in ((1, False), (2, True)):
        s = Session()
        with RankPool(world, "gloo", deadline=60.0) as pool:
            s.check("RANKS-AGREE", case.spec, pool, "gloo")
        assert bool(s.to_dict()["corpus"]) == recorded, world


_RANK_CASES = [c for c in corpus.load() if c.tier == "ranks" and c.finding]


@pytest.fixture(scope="module")
def rank_worlds():
    """A two-rank gloo pool, behind Worlds for the checkpoint cases (their
    save and load worlds)."""
    from conformance.engine.pool import RankPool
    from conformance.engine.worlds import Worlds

    pool = RankPool(2, "gloo", deadline=60.0)
    pool.tier = "gloo"
    worlds = Worlds(pool)
    yield pool, worlds
    worlds.close()
    pool.close()


@pytest.mark.gloo
@pytest.mark.parametrize("case", _RANK_CASES, ids=lambda c: c.name)
def test_a_rank_corpus_case_reproduces_its_finding_under_each_invariant(case, rank_worlds):
    """A corpus case stands for its finding: on a torch inside the finding's
    range it shows that finding under every invariant it lists, not only
    another one that stops the case first (the report would call the finding
    FIXED: the case of dcp-get-state-dict-initializes-optim-state once hit
    fsdp2-frozen-root-forward-leaves-params-unsharded before the save)."""
    from conformance.areas.checkpoint.adapter import missing_api

    _skip_outside_its_range(case)
    if getattr(case.spec, "ckpt", None) is not None and missing_api(case.spec):
        pytest.skip(missing_api(case.spec))
    pool, worlds = rank_worlds
    engine = worlds if getattr(case.spec, "ckpt", None) is not None else pool
    for inv in case.invariants:
        res = check_case(inv, case.spec, engine)
        assert case.finding in {fid for _, fid in res.known}, f"{inv}: {res.describe()}"
