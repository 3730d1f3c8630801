"""`fsdp-conformance run` end to end: the report of an xdist run, repro of a
finding from it, compare, and a run interrupted by SIGTERM (valid JSON
marked incomplete, no rank process left)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conformance.areas import CATALOG
from conformance.engine.pool import pid_alive
from conformance.report import data

pytestmark = pytest.mark.selfcheck
ROOT = Path(__file__).resolve().parents[2]


def cli(*args, timeout=300, **kw):
    env = {**os.environ, "CI": "1"}
    return subprocess.run([sys.executable, "-m", "conformance.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env, **kw)


@pytest.fixture(scope="module")
def xdist_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    proc = cli("run", "--backend", "fake", "-n", "2", "--examples", "4", "--profile", "ci", "--report-dir", str(out))
    return out, proc


def test_an_xdist_run_writes_one_merged_report(xdist_run):
    out, proc = xdist_run
    report = data.load(out / "report.json")
    assert proc.returncode == report["summary"]["exit_status"], proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["complete"] and report["status"] == "complete" and report["run"]["workers"] == 2
    assert {"summary.md", "junit.xml", "report.html"} <= {p.name for p in out.iterdir()}
    assert not (out / ".partial").exists()
    rows = {(r["invariant"], r["tier"]): r for r in report["results"]}
    assert {inv for inv, _ in rows} == set(CATALOG)
    ran = [r for r in rows.values() if r["verdict"] != "SKIP"]
    assert ran and all(r["examples"] >= 4 for r in ran)
    for r in rows.values():
        assert r["verdict"] != "SKIP" or r["reason"], r
    assert report["torch"]["version"] and report["suite"]["git_revision"] and report["run"]["tiers"] == [{"tier": "fake", "backend": "fake", "world_size": 4}]
    assert "fsdp-conformance" in proc.stdout  # the terminal summary, in CI's quiet mode


def test_compare_a_run_with_itself_and_with_garbage(xdist_run, tmp_path, cli_in_process):
    out, _ = xdist_run
    same = cli_in_process("compare", str(out / "report.json"), str(out / "report.json"))
    assert same.returncode == 0 and "0 regressions" in same.stdout, same.stdout + same.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "fsdp-conformance-report", "schema_version": 1, "results": [{"invariant": 1}]}')
    proc = cli_in_process("compare", str(bad), str(out / "report.json"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "lacks 'invariant'" in proc.stderr


def test_repro_reruns_a_finding_from_the_report(xdist_run, tmp_path, cli_in_process):
    out, _ = xdist_run
    report = data.load(out / "report.json")
    if not report["findings"]:
        pytest.skip("this torch showed no finding in 4 examples")
    f = report["findings"][0]
    script = tmp_path / "repro.py"
    proc = cli("repro", str(out / "report.json"), "--finding", f["id"], "--backend", "fake", "-o", str(script))
    assert proc.returncode == (1 if f["kind"] != "KNOWN" else 0), proc.stdout + proc.stderr
    assert f"{f['invariant']}: " in proc.stdout and script.read_text().startswith('"""fsdp-conformance reproduction')
    several = cli_in_process("repro", str(out / "report.json"), "--no-run")
    assert several.returncode in (0, 2)  # 2: the report has no single failing finding to pick
    missing = cli_in_process("repro", str(out / "report.json"), "--finding", "NOPE/x/y/z")
    assert missing.returncode == 2 and "no finding 'NOPE/x/y/z'" in missing.stderr


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="walks /proc for the rank processes")
def test_sigterm_leaves_a_valid_incomplete_report_and_no_rank(tmp_path):
    env = {**os.environ, "CI": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "conformance.cli", "run", "--backend", "gloo", "--world-size", "2", "--invariant", "WRAP-UNITS",
         "--examples", "100000", "--report-dir", str(tmp_path)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    partial = tmp_path / ".partial" / "main.json"
    deadline = time.monotonic() + 180
    tree: set[int] = set()
    while time.monotonic() < deadline and proc.poll() is None:
        tree |= _descendants(proc.pid)
        try:
            if json.loads(partial.read_text())["tallies"][0]["examples"] >= 3:
                break
        except (OSError, ValueError, LookupError):
            pass
        time.sleep(0.2)
    tree |= _descendants(proc.pid)
    assert proc.poll() is None, proc.communicate()
    assert len(tree) >= 4, tree  # pytest, the pool's fork server and two ranks
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out[-2000:] + err[-2000:]
    assert "interrupted (SIGTERM)" in err
    report = data.load(tmp_path / "report.json")
    assert report["complete"] is False and report["status"] == "interrupted" and report["interrupted_by"] == "SIGTERM"
    (row,) = [r for r in report["results"] if r["invariant"] == "WRAP-UNITS"]
    assert row["examples"] >= 3
    end = time.monotonic() + 10
    while time.monotonic() < end and any(pid_alive(p) for p in tree):
        time.sleep(0.1)
    assert not [p for p in tree if pid_alive(p)], "processes of the run survived it"


def test_a_failed_snapshot_names_expecttest_accept(tmp_path):
    test = tmp_path / "snap" / "test_snap.py"
    test.parent.mkdir()
    test.write_text(
        "import expecttest\n\n\n"
        "class TestSnap(expecttest.TestCase):\n"
        "    def test_text(self):\n"
        "        self.assertExpectedInline('new text', '''old text''')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "EXPECTTEST_ACCEPT"}
    # -k: only the snapshot test runs (the suite's own tests are collected, then deselected);
    # the whole fake tier beside it cost 15 s here and showed nothing this test checks
    proc = subprocess.run(
        [sys.executable, "-m", "conformance.cli", "run", "--backend", "fake", "--examples", "1", "--report-dir", str(tmp_path / "out"),
         "--progress", "quiet", "--", str(test), "-k", "TestSnap", f"--rootdir={ROOT}", "-c", str(ROOT / "pyproject.toml")],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env={**env, "CI": "1"},
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "EXPECTTEST_ACCEPT=1 python -m pytest" in proc.stdout and "test_snap.py::TestSnap::test_text" in proc.stdout
    report = data.load(tmp_path / "out" / "report.json")
    assert [n.rsplit("::", 2)[-2:] for n in report["snapshots"]["failed"]] == [["TestSnap", "test_text"]]
    assert "old text" in test.read_text()  # not accepted behind the user's back


def test_collecting_only_writes_no_report(tmp_path):
    """--collect-only runs nothing: no report (it would replace the last run's with SKIP rows)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "conformance/suite/test_summon.py", "--collect-only", "-q", "-p", "no:xdist",
                           f"--report-dir={tmp_path}"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert not (tmp_path / "report.json").exists()


@pytest.mark.gloo
def test_selecting_an_invariant_of_one_api_still_runs_its_area_test(tmp_path):
    """--invariant MP-PIPELINE: the schedule area's tests (one per API)
    check it on each API's row. Once, one test drew both APIs and an
    example with nothing selected to check skipped the whole test (the row
    read SKIP)."""
    proc = cli("run", "--backend", "gloo", "--invariant", "MP-PIPELINE", "--examples", "12", "--profile", "ci",
               "--report-dir", str(tmp_path), "--progress", "quiet")
    report = data.load(tmp_path / "report.json")
    rows = [r for r in report["results"] if r["invariant"] == "MP-PIPELINE" and r["tier"] == "gloo"]
    assert proc.returncode == 0 and rows and all(r.get("checked", 0) > 0 for r in rows), proc.stdout[-3000:] + proc.stderr[-2000:]


def test_a_sigterm_whose_keyboardinterrupt_is_swallowed_still_stops_the_next_example():
    """The SIGTERM handler raises KeyboardInterrupt where the signal lands;
    Python swallows it inside a gc callback or a __del__, and the test's
    remaining examples then ran on (ci/test.sh: the run above went on for
    minutes after its SIGTERM, its ranks alive). The handler also marks the
    session, and every later example raises it again."""
    from conformance.plugin.report import ReportPlugin
    from conformance.run.session import Session

    plugin = ReportPlugin.__new__(ReportPlugin)
    plugin.session = Session()
    old = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(KeyboardInterrupt):
            plugin._on_sigterm(signal.SIGTERM, None)
    finally:
        signal.signal(signal.SIGTERM, old)
    assert plugin.session.interrupted == "SIGTERM"
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        plugin.session.check_example(["WRAP-UNITS"], None, None, "fake")
