"""The report: rows and verdicts from a session, merging xdist partials,
FIXED against a baseline, known-failure states, the schema check, and the
rendered Markdown / JUnit (expecttest snapshots: EXPECTTEST_ACCEPT=1)."""

from __future__ import annotations

import dataclasses
import json
import xml.etree.ElementTree as ET

import expecttest
import pytest
from packaging.specifiers import SpecifierSet

from conformance.areas.common.catalog import Invariant
from conformance.case.violation import Violation
from conformance.report import compare, data, junit, markdown, write
from conformance.run.known import KnownFailure, Match, RootCause, Upstream
from conformance.run.runner import CaseResult
from conformance.run.session import Session
from tests.self import cases

pytestmark = pytest.mark.selfcheck

# A catalog of its own, so that new invariants elsewhere leave these snapshots be.
CATALOG = {
    i.id: i
    for i in (
        Invariant("WRAP-UNITS", "wrap", "fsdp1", "The units are the policy's targets plus the root.", "doc", None),
        Invariant("TIES", "ties", "fsdp1", "A tied parameter is managed once.", "spec 000", None),
        Invariant("FROZEN-CLEAN", "frozen", "fsdp1", "No error or warning for uniform units.", "spec 000", None),
        Invariant("FSDP2-GROUPS", "fsdp2", "fsdp2", "Each group holds the oracle's parameters.", "doc", None),
    )
}
KNOWN = [
    KnownFailure("tie-below-lca", SpecifierSet(">=2.13,<2.14"), (Match("TIES", frozenset({"kind:below-lca"})),), "Ties below the LCA are accepted.", "reports/findings/x.py",
                 cls="limitation", root_cause=RootCause("tie-unchecked", "FSDP1 never checks ties across units.", "_init_utils.py"),
                 upstream=(Upstream("pytorch/pytorch", 104346, "pr", "Move ModuleWrapPolicy", "closed"),), upstream_searched="2026-12-01"),
    KnownFailure("old-bug", SpecifierSet("<2.0"), (Match("WRAP-UNITS", frozenset()),), "Long fixed.", "reports/findings/y.py"),
    KnownFailure("frozen-thing", SpecifierSet(">=2.13"), (Match("FROZEN-CLEAN", frozenset({"kind:spurious"})),), "Not drawn here.", "reports/findings/z.py"),
]
ENV = {
    "suite": {"version": "0.1.0", "git_revision": "0123456789abcdef", "git_dirty": False},
    "torch": {"version": "2.13.0+cpu", "git_version": "fedcba9876543210", "cuda": None, "nccl": None, "distributed": True, "gpus": 0},
    "platform": {"system": "Linux", "release": "6", "machine": "x86_64", "platform": "Linux-6-x86_64", "python": "3.11.7", "cpus": 2},
}
RUN = {"tiers": [{"tier": "fake", "backend": "fake", "world_size": 4}], "profile": "ci", "seed": None, "selection": [], "selected": []}


def big_case():
    return cases.two_blocks()


def small_case():
    return dataclasses.replace(cases.two_blocks(), tree=dataclasses.replace(cases.two_blocks().tree, children=cases.two_blocks().tree.children[:1]))


def session_with_findings() -> Session:
    s = Session(repro_dir=None)
    s.known = KNOWN
    tie = Violation("TIES", "tied a.l.weight lives below the LCA", frozenset({"kind:below-lca"}))
    wrong = Violation("WRAP-UNITS", "module b is a unit but the policy does not target it", frozenset({"kind:extra-unit"}))
    for spec in (big_case(), small_case(), big_case()):
        s.record(CaseResult("TIES", spec, "KNOWN", known=[(tie, "tie-below-lca")]), "fake", 0.25)
        s.record(CaseResult("WRAP-UNITS", spec, "FAIL", violations=[wrong]), "fake", 0.5)
        s.record(CaseResult("FROZEN-CLEAN", spec, "PASS"), "fake", 0.125)
    return s


def build(partials, **kw):
    args = dict(partials=partials, run=RUN, catalog=CATALOG, known=KNOWN, environment=ENV, started_at="2026-01-01T00:00:00+00:00",
                finished_at="2026-01-01T00:01:00+00:00", wall_seconds=60.0)
    args.update(kw)
    return data.build(**args)


def test_rows_verdicts_and_smallest_case():
    report = build([session_with_findings().to_dict()])
    rows = {r["invariant"]: r for r in report["results"]}
    assert {k: r["verdict"] for k, r in rows.items()} == {"WRAP-UNITS": "FAIL", "TIES": "KNOWN", "FROZEN-CLEAN": "PASS", "FSDP2-GROUPS": "SKIP"}
    assert rows["FSDP2-GROUPS"]["api"] == "fsdp2" and rows["FSDP2-GROUPS"]["reason"] == "no test ran it on this tier"
    assert rows["WRAP-UNITS"]["examples"] == 3 and rows["WRAP-UNITS"]["outcomes"] == {"FAIL": 3}
    (fail,) = [f for f in report["findings"] if f["kind"] == "FAIL"]
    assert fail["count"] == 3 and fail["id"] == "WRAP-UNITS/fsdp1/fake/FAIL:kind:extra-unit"
    assert fail["spec"] == json.loads(small_case().to_json())  # the smallest of the three
    assert report["summary"]["failed"] and report["summary"]["exit_status"] == 1
    assert report["summary"]["verdicts"] == {"PASS": 1, "FAIL": 1, "KNOWN": 1, "FIXED": 0, "SKIP": 1}
    states = {k["id"]: k["status"] for k in report["known_failures"]}
    assert states == {"tie-below-lca": "matched", "old-bug": "other-torch", "frozen-thing": "unmatched"}
    assert report["warnings"] == ["known failure frozen-thing (FROZEN-CLEAN) matched nothing in this run"]
    assert data.validate(json.loads(json.dumps(report))) is not None
    # the matched finding's class is counted apart, its root cause listed with its forms
    (known,) = [f for f in report["findings"] if f["kind"] == "KNOWN"]
    assert known["known_class"] == "limitation"
    assert report["summary"]["known_by_class"] == {"bug": 0, "implicit": 0, "diagnostic": 0, "limitation": 1, "enhancement": 0}
    assert report["summary"]["root_causes_matched"] == 1
    rc = {r["id"]: r for r in report["root_causes"]}
    assert rc["tie-unchecked"]["forms"] == ["tie-below-lca"] and rc["tie-unchecked"]["matched"] == ["tie-below-lca"]
    (k,) = [k for k in report["known_failures"] if k["id"] == "tie-below-lca"]
    assert k["upstream"][0]["url"] == "https://github.com/pytorch/pytorch/pull/104346"


def test_partials_of_xdist_workers_merge():
    a, b = session_with_findings().to_dict(), session_with_findings().to_dict()
    report = build([a, b])
    rows = {r["invariant"]: r for r in report["results"]}
    assert rows["TIES"]["examples"] == 6 and rows["TIES"]["seconds"] == 1.5
    (known,) = [f for f in report["findings"] if f["kind"] == "KNOWN"]
    assert known["count"] == 6 and known["spec"] == json.loads(small_case().to_json())


def test_fixed_needs_a_known_baseline_row_and_as_many_examples():
    base = build([session_with_findings().to_dict()])
    s = Session(repro_dir=None)
    s.known = KNOWN
    for _ in range(3):
        s.record(CaseResult("TIES", small_case(), "PASS"), "fake", 0.1)
    new = build([s.to_dict()], baselines=[base], baseline_paths=["base.json"])
    assert {r["invariant"]: r["verdict"] for r in new["results"]}["TIES"] == "FIXED"
    assert {k["id"]: k["status"] for k in new["known_failures"]}["tie-below-lca"] == "fixed"
    assert not new["summary"]["failed"]
    s.tallies.clear()
    s.record(CaseResult("TIES", small_case(), "PASS"), "fake", 0.1)  # fewer examples than the baseline: not FIXED
    fewer = build([s.to_dict()], baselines=[base])
    assert {r["invariant"]: r["verdict"] for r in fewer["results"]}["TIES"] == "PASS"


def test_skip_reasons_and_failed_tests():
    tests = [
        {"nodeid": "t.py::test[RANKS]", "outcome": "skipped", "invariant": "FSDP2-GROUPS", "tier": None, "message": "needs several real ranks", "snapshot": False},
        {"nodeid": "t.py::test_msg", "outcome": "failed", "invariant": None, "tier": None, "message": "AssertionError: texts differ", "snapshot": True},
    ]
    report = build([], tests=tests)
    rows = {r["invariant"]: r for r in report["results"]}
    assert rows["FSDP2-GROUPS"]["reason"] == "needs several real ranks"
    assert report["summary"]["failed"] and report["snapshots"]["failed"] == ["t.py::test_msg"]
    assert "EXPECTTEST_ACCEPT=1 python -m pytest t.py::test_msg" in report["snapshots"]["hint"]
    sel = build([], run={**RUN, "selection": ["wrap"], "selected": ["WRAP-UNITS"]})
    assert {r["invariant"]: r["reason"] for r in sel["results"]}["TIES"] == "not selected"


def test_a_skipped_model_test_gives_no_reason_to_the_synthetic_rows():
    """Without --target every real model's test skips ("no --target
    given"); a synthetic row no synthetic test ran on its tier (a gloo-only
    invariant's fake row in a two-tier run) says so instead."""
    tests = [
        {"nodeid": "conformance/suite/test_models.py::test_model_natural[fake-no-target-TIES]", "outcome": "skipped",
         "invariants": ["TIES", "FSDP2-GROUPS"], "tier": "fake", "message": "no --target given", "snapshot": False},
        {"nodeid": "conformance/suite/test_fully_shard.py::test_groups[fake]", "outcome": "skipped",
         "invariants": ["FSDP2-GROUPS"], "tier": "fake", "message": "needs several real ranks", "snapshot": False},
    ]
    rows = {r["invariant"]: r for r in build([], tests=tests)["results"]}
    assert rows["TIES"]["reason"] == "no test ran it on this tier"
    assert rows["FSDP2-GROUPS"]["reason"] == "needs several real ranks"


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda r: [], "must be a JSON object"),
        (lambda r: {**r, "schema": "x"}, "not an fsdp-conformance report"),
        (lambda r: {**r, "schema_version": 99}, "schema_version 99"),
        (lambda r: {**r, "results": [{"invariant": "X"}]}, "lacks 'api'"),
        (lambda r: {**r, "results": [{**r["results"][0], "verdict": "MAYBE"}]}, "unknown verdict"),
    ],
)
def test_validate_rejects_malformed_reports(mutate, needle):
    report = build([session_with_findings().to_dict()])
    with pytest.raises(data.ReportError, match=needle):
        data.validate(mutate(report))


def test_compare_lists_regressions_fixes_and_changes():
    base = build([session_with_findings().to_dict()])
    s = Session(repro_dir=None)
    s.known = KNOWN
    for _ in range(3):
        s.record(CaseResult("WRAP-UNITS", small_case(), "PASS"), "fake", 0.1)
        s.record(CaseResult("TIES", small_case(), "FAIL", violations=[Violation("TIES", "duplicated", frozenset({"kind:duplicated"}))]), "fake", 0.1)
    new = build([s.to_dict()], catalog={k: v for k, v in CATALOG.items() if k != "FSDP2-GROUPS"})
    c = compare.compare(base, new)
    assert [(x.invariant, x.base, x.new) for x in c.regressions] == [("TIES", "KNOWN", "FAIL")]
    assert [(x.invariant, x.base, x.new) for x in c.fixes] == [("WRAP-UNITS", "FAIL", "PASS")]
    assert [(x.invariant, x.base, x.new) for x in c.changes] == [("FROZEN-CLEAN", "PASS", "SKIP")]
    assert [x.invariant for x in c.removed] == ["FSDP2-GROUPS"] and c.exit_status == 1
    assert compare.compare(base, base).exit_status == 0
    assert "1 regressions, 1 fixes, 1 other changes, 0 new, 1 removed, 0 unchanged" in compare.render(c)


def test_write_all_is_atomic_and_complete(tmp_path):
    report = build([session_with_findings().to_dict()])
    paths = write.write_all(report, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junit.xml", "report.html", "report.json", "repros", "summary.md"]
    assert not list(tmp_path.glob(".*.tmp"))
    loaded = data.load(paths["json"])
    assert all(f["repro"] and (tmp_path / f["repro"]).is_file() for f in loaded["findings"])
    script = (tmp_path / loaded["findings"][0]["repro"]).read_text()
    assert "import torch" in script and "conformance" not in script.split("\n", 3)[3]  # torch-only
    suite = ET.parse(paths["junit"]).getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("4", "1", "1")
    page = paths["html"].read_text()
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page and "http" not in page.split("<body>")[0]


class TestRenderedReport(expecttest.TestCase):
    """The Markdown summary and JUnit XML, pinned. After an intended change:
    EXPECTTEST_ACCEPT=1 python -m pytest tests/self/test_report.py"""

    def report(self):
        r = build([session_with_findings().to_dict()])
        for f in r["findings"]:
            f["repro"] = f"repros/{f['invariant']}.py"
        return r

    def test_markdown_summary(self):
        text = markdown.render(self.report(), details=False)
        self.assertExpectedInline(text, """\
## fsdp-conformance FAIL: 1 PASS, 1 KNOWN, 1 FAIL, 1 SKIP; 9 examples in 60s

torch `2.13.0+cpu` (git `fedcba987654`, CUDA -, NCCL -) | suite 0.1.0 `0123456789ab` | tiers fake (fake, W=4) | profile `ci`

| invariant | API | tier | verdict | checked / examples | time | findings |
| --- | --- | --- | --- | ---: | ---: | --- |
| WRAP-UNITS | fsdp1 | fake | **FAIL** | 3 / 3 | 1.5s | FAIL:kind:extra-unit |
| TIES | fsdp1 | fake | KNOWN | 3 / 3 | 0.8s | known:tie-below-lca |
| FROZEN-CLEAN | fsdp1 | fake | PASS | 3 / 3 | 0.4s |  |
| FSDP2-GROUPS | fsdp2 | fake | SKIP | 0 / 0 | 0.0s | no test ran it on this tier |

### Known failures matched: 1 (1 limitation), forms of 1 root cause(s)

| finding | class | root cause | upstream |
| --- | --- | --- | --- |
| `tie-below-lca` | limitation | `tie-unchecked` | [pytorch#104346](https://github.com/pytorch/pytorch/pull/104346) closed |

### Warnings

- known failure frozen-thing (FROZEN-CLEAN) matched nothing in this run
""")

    def test_junit(self):
        text = junit.render(self.report())
        self.assertExpectedInline(text, """\
<?xml version="1.0" encoding="utf-8"?>
<testsuites>
  <testsuite name="fsdp-conformance" tests="4" failures="1" errors="0" skipped="1" time="2.625" timestamp="2026-01-01T00:00:00+00:00">
    <properties>
      <property name="torch" value="2.13.0+cpu" />
      <property name="torch_git" value="fedcba9876543210" />
      <property name="profile" value="ci" />
      <property name="complete" value="True" />
      <property name="suite_revision" value="0123456789abcdef" />
    </properties>
    <testcase classname="fsdp-conformance.fsdp1.fake" name="WRAP-UNITS" time="1.500">
      <failure message="[WRAP-UNITS] module b is a unit but the policy does not target it" type="FAIL">FAIL: [WRAP-UNITS] module b is a unit but the policy does not target it
finding: WRAP-UNITS/fsdp1/fake/FAIL:kind:extra-unit (its smallest case is in the JSON report)
repro: repros/WRAP-UNITS.py</failure>
      <system-out>verdict FAIL, 3 of 3 examples checked</system-out>
    </testcase>
    <testcase classname="fsdp-conformance.fsdp1.fake" name="TIES" time="0.750">
      <system-out>verdict KNOWN, 3 of 3 examples checked
KNOWN tie-below-lca: [TIES] tied a.l.weight lives below the LCA</system-out>
    </testcase>
    <testcase classname="fsdp-conformance.fsdp1.fake" name="FROZEN-CLEAN" time="0.375">
      <system-out>verdict PASS, 3 of 3 examples checked</system-out>
    </testcase>
    <testcase classname="fsdp-conformance.fsdp2.fake" name="FSDP2-GROUPS" time="0.000">
      <skipped message="no test ran it on this tier" />
      <system-out>verdict SKIP, 0 of 0 examples checked
no test ran it on this tier</system-out>
    </testcase>
  </testsuite>
</testsuites>
""")



def test_a_case_of_an_api_without_a_torch_only_generator_replays_through_the_suite():
    from conformance.areas import area_of
    from conformance.areas.autowrap.repro import fsdp1_script
    from conformance.areas.common import repro
    from conformance.run.repro import repro_script

    spec = cases.two_blocks()
    script = repro.suite_script(spec, ["[WRAP-UNITS] something"], "WRAP-UNITS")
    compile(script, "repro.py", "exec")
    assert "from conformance.cli import main" in script and "INVARIANT = 'WRAP-UNITS'" in script
    assert repro_script(spec, [], "WRAP-UNITS").startswith('"""fsdp-conformance reproduction: WRAP-UNITS\n')
    assert area_of("WRAP-UNITS").repro is fsdp1_script and area_of("PARITY").repro is repro.suite_script


def test_a_hung_example_is_a_hang_finding_with_the_engines_account():
    from conformance.engine.errors import RankHang, RankState

    class HangingEngine:
        def run(self, scenario, spec):
            raise RankHang(scenario=scenario, spec=spec, backend="gloo", world_size=2, deadline=1.0, elapsed=1.5,
                           ranks=(RankState(0, 101, "returned", record={"ok": True}), RankState(1, 102, "running", stack="File x, line 1")))

    s = Session(repro_dir=None)
    s.known = KNOWN
    with pytest.raises(AssertionError, match="HANG: scenario '[^']+' on 2 gloo ranks"):
        s.check("TIES", small_case(), HangingEngine(), "gloo")
    report = build([s.to_dict()], run={**RUN, "tiers": [{"tier": "gloo", "backend": "gloo", "world_size": 2}]})
    (row,) = [r for r in report["results"] if r["invariant"] == "TIES"]
    assert row["verdict"] == "FAIL" and row["outcomes"] == {"HANG": 1}
    (f,) = report["findings"]
    assert f["kind"] == "HANG" and f["engine"]["ranks"][1]["state"] == "running" and f["engine"]["verdict"] == "HANG"


def test_progress_files_take_a_bounded_share_of_the_run(tmp_path, monkeypatch):
    """A worker's partial tallies and the running report serialize every
    finding so far: a write that costs more than PROGRESS_SHARE of its
    interval pushes the next one out, so a long run's growing writes stay
    a bounded share of its time (cheap ones keep the 1 s / 2 s interval)."""
    from types import SimpleNamespace

    from conformance.plugin import report as plugin_report

    clock = [1000.0]
    monkeypatch.setattr(plugin_report.time, "monotonic", lambda: clock[0])
    writes = []
    indents = set()

    def write_json(path, obj, indent=1):  # each write costs `cost` seconds of the fake clock
        writes.append(path.name)
        indents.add(indent)
        clock[0] += cost

    monkeypatch.setattr(plugin_report.data, "write_json", write_json)
    options = {"--report-dir": str(tmp_path), "--report": "always", "--invariant": None}
    config = SimpleNamespace(getoption=lambda name, default=None: options.get(name, default),
                             option=SimpleNamespace(dist="no"), rootpath=tmp_path)
    plugin = plugin_report.ReportPlugin(config)
    monkeypatch.setattr(plugin, "build", lambda status: {"status": status})

    def run(seconds: float, step: float = 0.01) -> dict:
        writes.clear()
        end = clock[0] + seconds
        while clock[0] < end:
            clock[0] += step  # an example's work
            plugin._changed()
        return {name: writes.count(name) for name in set(writes)}

    cost = 0.001  # cheap writes: the fixed intervals
    got = run(20.0)
    assert 19 <= got["main.json"] <= 21 and 9 <= got["report.json"] <= 11, got
    assert indents == {None}  # compact: json's C encoder (an indent takes its pure-Python one, ~6x slower)
    cost = 0.5  # a long run's writes: at most PROGRESS_SHARE of the time each
    got = run(200.0)
    spent = cost * sum(got.values())
    assert got["main.json"] >= 1 and got["report.json"] >= 1, got
    assert spent <= 2 * plugin_report.PROGRESS_SHARE * 200.0 + 2 * cost, (got, spent)
