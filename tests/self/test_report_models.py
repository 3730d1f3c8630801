"""A real model's rows stand beside the synthetic rows: a run that checks
both (``fsdp-conformance run -- --target T``) reports each model in rows
of its own (same invariant, API and tier; ``model`` set), in every format."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from conformance.case.model_case import ModelCase
from conformance.case.spec import ModuleWrap, WrapPlan
from conformance.case.violation import Violation
from conformance.report import compare, data, html, junit, markdown
from conformance.run.runner import CaseResult
from conformance.run.session import Session
from tests.self import cases
from tests.self.test_report import CATALOG, ENV, KNOWN, RUN

pytestmark = pytest.mark.selfcheck

TARGET = "tests.self.same_name_target:target"


def _session(model_verdict: str = "PASS") -> Session:
    s = Session(repro_dir=None)
    s.known = KNOWN
    model_case = ModelCase(TARGET, plan=WrapPlan("fsdp1", ModuleWrap(("Block",))))
    s.record(CaseResult("WRAP-UNITS", cases.two_blocks(), "PASS"), "fake", 0.1)
    s.record(CaseResult("WRAP-UNITS", cases.two_blocks(), "PASS"), "fake", 0.1)
    bad = [Violation("WRAP-UNITS", "module blocks.0 is not a unit", frozenset({"kind:missing-unit"}))] if model_verdict == "FAIL" else []
    s.record(CaseResult("WRAP-UNITS", model_case, model_verdict, bad), "fake", 0.5)
    return s


def _build(session: Session) -> dict:
    return data.build(partials=[session.to_dict()], run=RUN, catalog=CATALOG, known=KNOWN, environment=ENV)


def test_model_rows_follow_the_synthetic_row_of_their_invariant():
    report = _build(_session("FAIL"))
    rows = [(r["invariant"], r["api"], r["tier"], r["model"], r["verdict"], r["examples"]) for r in report["results"]
            if r["invariant"] == "WRAP-UNITS"]
    assert rows == [("WRAP-UNITS", "fsdp1", "fake", None, "PASS", 2), ("WRAP-UNITS", "fsdp1", "fake", TARGET, "FAIL", 1)]
    (f,) = report["findings"]
    assert f["model"] == TARGET and f["id"] == f"WRAP-UNITS/fsdp1/fake/{TARGET}/FAIL:kind:missing-unit"
    assert report["summary"]["failed"]  # the model's failure fails the run, whatever the synthetic row says


def test_every_format_names_the_model():
    report = _build(_session("FAIL"))
    md = markdown.render(report)
    assert "| WRAP-UNITS | fsdp1 | fake |" in md and f"| WRAP-UNITS on {TARGET} | fsdp1 | fake |" in md
    page = html.render(report)
    assert TARGET in page.split("<h2>Findings")[0]  # a column of the matrix
    names = [c.get("name") for c in ET.fromstring(junit.render(report)).iter("testcase")]
    assert "WRAP-UNITS" in names and f"WRAP-UNITS on {TARGET}" in names


def test_compare_matches_model_rows_with_model_rows():
    base, new = _build(_session("PASS")), _build(_session("FAIL"))
    c = compare.compare(base, new)
    assert [ch.key for ch in c.regressions] == [f"WRAP-UNITS on {TARGET} (fsdp1, fake)"]


def test_a_synthetic_corpus_case_makes_no_model_row_fixed():
    """A known failure whose (synthetic) corpus case no longer deviates
    turns the synthetic PASS row FIXED; the model's own PASS row stays PASS."""
    s = _session("PASS")
    s.corpus[("case-x", "WRAP-UNITS", "fake")] = {"case": "case-x", "finding": "old-bug-fixed", "case_tier": "fake",
                                                  "invariant": "WRAP-UNITS", "tier": "fake", "verdicts": {"PASS": 1}, "known": []}
    import dataclasses

    from packaging.specifiers import SpecifierSet

    fixed = dataclasses.replace(KNOWN[1], id="old-bug-fixed", torch=SpecifierSet(">=2.0"))
    report = data.build(partials=[s.to_dict()], run=RUN, catalog=CATALOG, known=[*KNOWN, fixed], environment=ENV)
    verdicts = {(r["invariant"], r["model"]): r["verdict"] for r in report["results"]}
    assert verdicts[("WRAP-UNITS", None)] == "FIXED" and verdicts[("WRAP-UNITS", TARGET)] == "PASS"


def test_run_target_that_cannot_be_used_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    import os
    import sys

    from conformance import cli

    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # run --target sets it for its pytest child
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["run", "--tiers", "fake", "--target", "no_such_module:target", "--report-dir", str(tmp_path)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "target 'no_such_module:target': cannot import" in lines[0], lines


def test_the_model_command_report_is_complete_and_counts_warnings(tmp_path):
    """`fsdp-conformance model`: the report names the target in its title and
    heading, gives its profile, budget and start time (not None), lists only
    the known failures the run exercised, and counts the warnings torch
    raised instead of printing each (a noisy target warns every forward)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "rep"
    proc = subprocess.run([sys.executable, "-m", "conformance.cli", "model", "tests.self.warning_target:target", "--backend", "fake",
                           "--examples", "2", "--invariant", "FWD-NOOP", "--invariant", "WRAP-UNITS", "--report-dir", str(out)],
                          capture_output=True, text=True, timeout=600)
    rep = json.loads((out / "report.json").read_text())
    assert rep["run"]["profile"] == "dev" and rep["run"]["examples"] == 2 and rep["started_at"] and rep["finished_at"], rep["run"]
    page = (out / "report.html").read_text()
    assert "<h1>fsdp-conformance model report: tests.self.warning_target:target</h1>" in page
    assert "<title>tests.self.warning_target:target: fsdp-conformance" in page and "started None" not in page
    table = page.split("<h2>Known failures</h2>")[1].split("</table>")[0]
    exercised = [k for k in rep["known_failures"] if k["status"] not in ("not-run", "other-torch")]
    assert table.count("<tr><td><code>") == len(exercised) < len(rep["known_failures"])
    assert "Not exercised by this run" in page
    header = page.split('<table id="matrix">')[1].split("</tr>")[0]
    assert "tests.self.warning_target:target" in header and header.count("<th>") == 1 + sum(
        1 for col in {(r["api"], r["tier"], r.get("model")) for r in rep["results"] if r["examples"]})  # no empty synthetic columns
    (w,) = [w for w in rep["torch_warnings"] if w["message"] == "WarningLM.forward: a deliberate warning per call"]
    assert w["category"] == "UserWarning" and w["count"] >= 4, w  # every forward's, counted
    assert "deliberate warning" not in proc.stderr, proc.stderr[-2000:]  # not printed one by one
    assert f"warnings: {sum(x['count'] for x in rep['torch_warnings'])} (" in proc.stdout
