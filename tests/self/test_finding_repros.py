"""The committed repro scripts (reports/findings/*.py) and their convention
(conformance/run/repros.py): every header parses, names its finding and
offers a mode; every finding has its script; and, marked `repros` (every
script in every mode: minutes, so only with `pytest -m repros`), each
script's own verdict: DEVIATION in a Run: mode on a torch inside the
finding's range, AS SPECIFIED outside it and in a Not shown by: mode."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import pytest

from conformance.run import repros

pytestmark = pytest.mark.selfcheck
ROOT = Path(__file__).resolve().parents[2]
FINDINGS = ROOT / "reports" / "findings"
SCRIPTS = sorted(FINDINGS.glob("*.py"))


def _known():
    from conformance.run import known

    return {k.id: k for k in known.load()}


def test_every_header_parses_names_its_finding_and_offers_a_mode():
    known = _known()
    assert len(SCRIPTS) >= len(known)
    for path in SCRIPTS:
        modes = repros.modes(path)  # raises for a malformed or unrunnable mode line
        assert any(m.shown for m in modes), path.name
        for m in modes:
            assert f" {path.name}" in f" {m.command}", f"{path.name}: {m.command!r} names another script"
            assert m.shown or m.why, f"{path.name}: a Not shown by line without its reason"
        assert repros.finding(path) in known, f"{path.name}: 'Finding: <id>' names no finding of known_failures.toml"


def test_every_script_prints_the_protocol_s_verdict_lines():
    """The repros tier reads a line starting "DEVIATION: " or "AS SPECIFIED: "
    (repros._VERDICT_RE); a script printing its own words ("rank 0: DEVIATES:")
    read as no verdict at every release."""
    for path in SCRIPTS:
        text = path.read_text()
        assert "DEVIATION: " in text and "AS SPECIFIED: " in text, f"{path.name} prints no protocol verdict line"


def test_every_finding_has_its_repro_naming_it():
    for fid, k in _known().items():
        path = ROOT / k.repro
        assert path.is_file(), f"{fid}: {k.repro} is missing"
        assert repros.finding(path) == fid, f"{k.repro} names {repros.finding(path)!r}, not {fid}"


def test_modes_and_verdict_lines_parse(tmp_path):
    script = tmp_path / "x.py"
    script.write_text('"""Finding: f\n\nRun: python x.py\nRun: torchrun --nproc-per-node 3 x.py uop\n'
                      'Not shown by: python x.py one: one rank is rank 0\n"""\n')
    got = repros.modes(script)
    assert [(m.command, m.shown, m.ranks) for m in got] == [("python x.py", True, 1), ("torchrun --nproc-per-node 3 x.py uop", True, 3),
                                                            ("python x.py one", False, 1)]
    assert got[2].why == "one rank is rank 0"
    assert repros.argv(script, got[1], "py")[:6] == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"]
    assert repros.argv(script, got[1], "py")[-1] == "uop"
    assert repros.verdict_of("noise\nDEVIATION: it did X\n") == ("DEVIATION", "DEVIATION: it did X")
    assert repros.verdict_of("AS SPECIFIED: fine\nAS SPECIFIED: twice\n") == (None, "")  # exactly one verdict line
    assert repros.verdict_of("DEVIATION:\n") == (None, "")
    script.write_text('"""no modes"""\n')
    with pytest.raises(repros.ReproHeaderError):
        repros.modes(script)
    script.write_text('"""Run: mpirun -n 2 x.py"""\n')
    with pytest.raises(repros.ReproHeaderError):
        repros.modes(script)


def test_run_reads_the_verdict_in_a_temp_dir_and_kills_the_group_on_timeout(tmp_path):
    script = tmp_path / "v.py"
    script.write_text(textwrap.dedent('''\
        """Run: python v.py"""
        import os, subprocess, sys, time
        if "sleep" in sys.argv:
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a child the kill must take along
            time.sleep(60)
        print("cwd", os.getcwd())
        print("AS SPECIFIED: nothing to see")
    '''))
    res = repros.run(script, repros.Mode("python v.py", True))
    assert (res.returncode, res.verdict, res.line) == (0, "AS SPECIFIED", "AS SPECIFIED: nothing to see")
    assert "fsdp-repro-" in res.output and str(tmp_path) not in res.output.split("cwd ")[1].splitlines()[0]
    t0 = time.monotonic()
    res = repros.run(script, repros.Mode("python v.py sleep", True), timeout=2)
    assert res.timed_out and res.verdict is None and time.monotonic() - t0 < 30


def _cases():
    out = []
    for path in SCRIPTS:
        try:
            out += [pytest.param(path, m, id=f"{path.stem}[{m.command.split()[0]}{m.ranks if m.ranks > 1 else ''}{'' if m.shown else '-not-shown'}]")
                    for m in repros.modes(path)]
        except repros.ReproHeaderError:
            pass  # test_every_header_parses reports it
    return out


@pytest.mark.repros
@pytest.mark.parametrize("path,mode", _cases())
def test_repro_shows_its_finding(path, mode):
    import torch

    from conformance.run.known import in_range

    k = _known()[repros.finding(path)]
    res = repros.run(path, mode, timeout=240, python=sys.executable)
    tail = res.output[-3000:]
    assert res.returncode == 0 and res.verdict is not None, f"{mode.command}: exit {res.returncode}, verdict line {res.line!r}\n{tail}"
    assert not res.left_behind, f"{mode.command} left {res.left_behind} in its $TMPDIR"
    if not mode.shown:
        want = "AS SPECIFIED"  # the header says this mode cannot show it: the script must not claim it does
    else:
        want = "DEVIATION" if in_range(torch.__version__, k.torch) else "AS SPECIFIED"
    assert res.verdict == want, f"{mode.command} on torch {torch.__version__} (finding's range {k.torch}): {res.line}\n{tail}"


def test_what_a_script_leaves_in_its_tmpdir_is_reported(tmp_path):
    """repros.run gives each script a $TMPDIR of its own and reports what the
    script left there (torch's own directories aside): every generated
    repro is run so in the repros tests, which expect nothing left."""
    leaks = tmp_path / "leaks.py"
    leaks.write_text("import tempfile\ntempfile.NamedTemporaryFile(suffix='.json', delete=False).close()\n"
                     "tempfile.mkdtemp(prefix='torchelastic_')\ntempfile.mkdtemp(prefix='torchinductor_')\nprint('AS SPECIFIED: ok')\n")
    tidy = tmp_path / "tidy.py"
    tidy.write_text("import tempfile\nwith tempfile.NamedTemporaryFile(suffix='.json'):\n    pass\nprint('AS SPECIFIED: ok')\n")
    left = repros.run(leaks, repros.Mode("python leaks.py", True), timeout=60).left_behind
    assert len(left) == 1 and left[0].endswith(".json"), left
    assert repros.run(tidy, repros.Mode("python tidy.py", True), timeout=60).left_behind == ()


def test_measure_runs_every_mode_and_gives_one_release_verdict_per_finding(tmp_path):
    shows = tmp_path / "shows.py"
    shows.write_text('"""Finding: shows\n\nRun: python shows.py\nNot shown by: python shows.py quiet: nothing to see\n"""\n'
                     'import sys\nprint("AS SPECIFIED: quiet" if "quiet" in sys.argv else "DEVIATION: it did X")\n')
    broken = tmp_path / "broken.py"
    broken.write_text('"""Finding: broken\n\nRun: python broken.py\n"""\nraise SystemExit(3)\n')
    got = repros.measure([shows, broken], workers=2)
    assert got["shows"]["verdict"] == "DEVIATION" and [r["verdict"] for r in got["shows"]["runs"]] == ["DEVIATION", "AS SPECIFIED"]
    assert got["broken"]["verdict"] == "no verdict" and got["broken"]["runs"][0]["returncode"] == 3
    assert repros.release_verdict([{"shown": True, "verdict": "AS SPECIFIED"}, {"shown": False, "verdict": "DEVIATION"}]) == "AS SPECIFIED"
