"""The mutant catalog (conformance/mutants.toml) applies to the installed
torch, a mutant that does not apply fails loudly, and a small sample of
mutants is killed by `fsdp-conformance selfcheck --mutants` (the CI
self-test of the mutation score; the full table is reports/mutants.md)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conformance.selfcheck import fsdp_source, mutants

pytestmark = pytest.mark.selfcheck

# fast kills on the fake tier, one per API family
SAMPLE = ["fsdp1-simulation-revisits-units", "fwd-missing-method-not-rejected"]


def test_catalog_is_large_realistic_and_applies():
    catalog = mutants.load()
    assert len(catalog) >= 30
    assert {m.api for m in catalog} == set(mutants.APIS)
    mutants.check_all(catalog)  # raises MutantError naming any that does not apply
    for m in catalog:
        assert len(m.description) > 20, m.id


def test_mutant_that_does_not_apply_fails_loudly(tmp_path):
    m = mutants.Mutant("ghost", "fsdp1", "fsdp/wrap.py", "this text is not in wrap.py", "x", "a mutant of nothing")
    with pytest.raises(mutants.MutantError, match=r"ghost: its find text occurs 0 times in torch/distributed/fsdp/wrap.py"):
        mutants.check_all([m])
    broken = mutants.Mutant("broken", "fsdp1", "fsdp/wrap.py", "def _or_policy(", "def _or_policy((", "does not parse")
    with pytest.raises(mutants.MutantError, match="broken: the mutated torch/distributed/fsdp/wrap.py does not parse"):
        mutants.make_source(broken, tmp_path)


def test_mutant_copy_changes_only_its_file(tmp_path):
    m = next(x for x in mutants.load() if x.id == SAMPLE[0])
    root = mutants.make_source(m, tmp_path / "src")
    assert fsdp_source.differs_from_installed(root) == [m.path]


def test_first_areas_run_ahead_of_the_rest(tmp_path, monkeypatch):
    """A mutant's `first` areas lead the run's tests (on the pool, the run
    stopping at its first failing test); every other test still follows."""
    from conformance.selfcheck import mutant_plugin

    class Item:
        def __init__(self, area, tier):
            self.nodeid = f"test_{area}.py::test_x[{tier}]"
            self.callspec = type("C", (), {"params": {"engine": tier}})()

    items = [Item(a, t) for t in ("gloo", "fake") for a in ("autowrap", "checkpoint", "fully_shard", "tp")]
    monkeypatch.setenv(mutant_plugin.ENV_VAR, "fsdp2")
    monkeypatch.setenv(mutant_plugin.FILE_VAR, "torch/distributed/tensor/parallel/style.py")
    monkeypatch.setenv(mutant_plugin.FIRST_VAR, "tp")
    got = list(items)
    mutant_plugin.pytest_collection_modifyitems(None, None, got)
    assert [i.nodeid for i in got[:2]] == ["test_tp.py::test_x[gloo]", "test_tp.py::test_x[fake]"]
    assert sorted(i.nodeid for i in got) == sorted(i.nodeid for i in items)
    tp = [m for m in mutants.load() if m.file.startswith("tensor/parallel/") or "-tp-" in m.id]
    assert len(tp) == 6 and all(m.first == ("tp",) for m in tp)
    bad = tmp_path / "bad.toml"
    bad.write_text('[[mutant]]\nid = "x"\napi = "fsdp2"\nfile = "fsdp/wrap.py"\nfind = "a"\nreplace = "b"\n'
                   'description = "a mutant with a first area of nothing"\nfirst = ["no_such_area"]\n')
    with pytest.raises(mutants.MutantError, match="first names 'no_such_area', which has no conformance tests"):
        mutants.load(bad)


def test_sigterm_stops_the_mutant_runs_it_started(tmp_path):
    """Each mutant run has its own session (a signal to the selfcheck does
    not reach it): an interrupted selfcheck stops them and their ranks, and
    records no outcome for the run it cut short."""
    from tests.self.test_report_run import _descendants, pid_alive

    out = tmp_path / "out.json"
    proc = subprocess.Popen([sys.executable, "-m", "conformance.cli", "selfcheck", "--mutants", "--mutant", SAMPLE[0],
                             "--examples", "100000", "--json", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, tree = time.monotonic() + 120, set()
    while time.monotonic() < deadline and proc.poll() is None:
        tree |= _descendants(proc.pid)
        if any("pytest" in _cmdline(p) for p in tree):
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()
    time.sleep(1.0)
    tree |= _descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "selfcheck interrupted (SIGTERM)" in err
    end = time.monotonic() + 20
    while time.monotonic() < end and any(pid_alive(p) for p in tree):
        time.sleep(0.1)
    assert not [p for p in tree if pid_alive(p)], "mutant runs survived the selfcheck"
    assert not out.exists() or not json.loads(out.read_text())["outcomes"]


def _cmdline(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
    except OSError:
        return ""


def test_unknown_mutant_is_one_line(cli_in_process):
    proc = cli_in_process("selfcheck", "--mutants", "--mutant", "no-such-mutant")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "unknown mutant 'no-such-mutant'" in proc.stderr


def test_sample_of_mutants_is_killed(tmp_path):
    """The CI sample: each mutant of SAMPLE killed, with the invariant that
    caught it, through the FSDP-source overlay."""
    out = tmp_path / "sample.json"
    env = {k: v for k, v in os.environ.items() if k != fsdp_source.ENV_VAR}
    # fake tier only: both are structural kills there, and no rank pool starts (per mutant run and per baseline run)
    args = [sys.executable, "-m", "conformance.cli", "selfcheck", "--mutants", "--examples", "30", "--tiers", "fake", "--json", str(out)]
    for m in SAMPLE:
        args += ["--mutant", m]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    outcomes = {o["id"]: o for o in json.loads(out.read_text())["outcomes"]}
    assert outcomes["fsdp1-simulation-revisits-units"]["status"] == "killed"
    assert any(k.startswith("WRAP-FQNS") and k.endswith("fake)") for k in outcomes["fsdp1-simulation-revisits-units"]["killed_by"])
    assert outcomes["fwd-missing-method-not-rejected"]["status"] == "killed"
    assert any(k.startswith("FWD-MISSING") for k in outcomes["fwd-missing-method-not-rejected"]["killed_by"])
    assert "mutation score: 2/2 non-equivalent mutants killed (100%)" in proc.stdout


class _Baseline:
    """Stands for mutants.Baseline: which tests fail on the unmodified torch."""

    def __init__(self, failing: dict[str, str]) -> None:
        self.failing, self.asked = failing, []

    def failure(self, api, test):
        self.asked.append((api, test))
        return self.failing.get(test)


def test_a_kill_counts_only_where_the_unmodified_torch_passes():
    m = next(x for x in mutants.load() if x.id == SAMPLE[0])
    kill = mutants.Outcome(m, "killed", ["WRAP-FQNS (fsdp1, fake)"], tests=["test_autowrap.py::test_wrapping[fake]"])
    assert mutants.confirm_kill(kill, _Baseline({})) is kill
    base = _Baseline({"test_autowrap.py::test_wrapping[fake]": "1 failed"})
    got = mutants.confirm_kill(kill, base)
    assert got.status == "invalid" and got.killed_by == kill.killed_by
    assert "fails on the unmodified torch" in got.detail and "1 failed" in got.detail
    assert base.asked == [("fsdp1", "test_autowrap.py::test_wrapping[fake]")]
    # a kill that names no test: the whole run is checked
    base = _Baseline({"": "crashed"})
    assert mutants.confirm_kill(mutants.Outcome(m, "killed", ["crash (SIGSEGV) in ?"]), base).status == "invalid"
    assert base.asked == [("fsdp1", "")]
    # an invalid outcome is not measured: not in the score
    assert mutants.score([got, mutants.Outcome(m, "killed")]) == (1, 1)
    for status in ("survived", "timeout", "error"):
        assert mutants.confirm_kill(mutants.Outcome(m, status), _Baseline({"": "x"})).status == status


def test_baseline_runs_the_test_on_an_unmodified_copy(tmp_path):
    """The unmodified copy passes a real conformance test; a test it cannot
    run (here: one that does not exist) is a failure, not a pass."""
    base = mutants.Baseline(tmp_path, profile="ci", examples=5, tiers="fake", timeout=600, python=sys.executable, skip=())
    assert base.failure("fsdp1", "test_autowrap.py") is None
    assert fsdp_source.differs_from_installed(tmp_path / "_unmodified" / "src") == []
    report = json.loads((tmp_path / "_unmodified" / "run0" / "report" / "report.json").read_text())
    assert report["fsdp_source"]["path"].startswith(str(tmp_path)) and report["summary"]["examples"] > 0
    assert base.failure("fsdp1", "test_autowrap.py::test_no_such_test") is not None


def test_render_keeps_each_mutants_outcome_from_the_latest_run_by_date(tmp_path, cli_in_process):
    """--render merges saved runs by their own dates, not by the order of the
    arguments: a shell glob lists run28 before run3, and the older run's
    outcome must not undo the newer one's (it did: three kills read SURVIVED)."""
    meta = dict(command="fsdp-conformance selfcheck --mutants", torch="x", profile="ci", examples=60, tiers="fake,gloo",
                suite="x", complete=True, baseline_checked=True)
    mid = mutants.load()[0].id
    old = dict(meta, date="2026-11-30 14:04 UTC", outcomes=[dict(id=mid, status="survived", seconds=1)])
    new = dict(meta, date="2026-12-04 18:15 UTC", outcomes=[dict(id=mid, status="killed", killed_by=["WRAP-UNITS (fsdp1, fake)"], seconds=1)])
    (tmp_path / "run28-new.json").write_text(json.dumps(new))
    (tmp_path / "run3-old.json").write_text(json.dumps(old))
    out = tmp_path / "table.md"
    res = cli_in_process("selfcheck", "--mutants", "--render", tmp_path / "run28-new.json", tmp_path / "run3-old.json", "-o", out)
    assert res.returncode == 0, res.stderr
    row = next(line for line in out.read_text().splitlines() if line.startswith(f"| `{mid}`"))
    assert "| killed |" in row and "run28-new" in row, row
