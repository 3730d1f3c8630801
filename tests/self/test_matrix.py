"""The release matrix (ci/matrix.py, conformance/report/matrix.py): the page
from two small baselines, the known-failure ranges applied per release, and
a release that cannot be installed recorded as not run."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from conformance.report import matrix
from conformance.run import known as known_mod

pytestmark = pytest.mark.selfcheck
ROOT = Path(__file__).resolve().parents[2]

KNOWN = [
    known_mod.KnownFailure(
        id="tie-twice",
        torch=SpecifierSet(">=2.13"),
        matches_=(known_mod.Match("WRAP-UNITS", frozenset({"tie"})),),
        summary="a tied parameter is flattened twice",
        repro="reports/findings/tie-twice.py",
    ),
    known_mod.KnownFailure(
        id="never-seen", torch=SpecifierSet(">=2.4"), matches_=(known_mod.Match("TIES", frozenset()),), summary="s", repro="r"
    ),
]


def _finding(inv: str, kind: str, known: str | None, tags: list[str], message: str) -> dict:
    key = f"known:{known}" if known else f"FAIL:{'|'.join(tags)}"
    return {
        "id": f"{inv}/fsdp1/fake/{key}", "invariant": inv, "api": "fsdp1", "tier": "fake", "kind": kind, "key": key,
        "message": message, "known_failure": known, "count": 1,
        "violations": [{"invariant": inv, "message": message, "tags": tags}],
    }


def _baseline(release: str, results: list[tuple], findings: list[dict]) -> dict:
    rows = [
        {"invariant": inv, "area": "wrap", "api": "fsdp1", "tier": "fake", "backend": "fake", "world_size": 4,
         "statement": f"{inv} holds", "verdict": verdict, "reason": reason, "examples": 10, "seconds": 1.0,
         "findings": [f["id"] for f in findings if f["invariant"] == inv]}
        for inv, verdict, reason in results
    ]
    verdicts = dict.fromkeys(("PASS", "FAIL", "KNOWN", "FIXED", "SKIP"), 0)
    for _, v, _ in results:
        verdicts[v] += 1
    return {
        "schema": "fsdp-conformance-report", "schema_version": 1, "complete": True,
        "torch": {"version": f"{release}+cpu"},
        "run": {"tiers": [{"tier": "fake", "backend": "fake", "world_size": 4}], "profile": "ci"},
        "summary": {"verdicts": verdicts, "examples": 10 * len(results), "seconds": 3.0, "wall_seconds": 2.0},
        "results": rows, "findings": findings,
    }


@pytest.fixture
def matrix_dir(tmp_path: Path) -> Path:
    # 2.4.1 (run with every known failure matching, as ci/matrix.py does):
    # the tie finding is seen, but known_failures' range starts at 2.13
    old = _baseline(
        "2.4.1",
        [("WRAP-UNITS", "KNOWN", None), ("TIES", "SKIP", "register_fsdp_forward_method: not in torch 2.4.1"),
         ("WRAP-FQNS", "FAIL", None)],
        [_finding("WRAP-UNITS", "KNOWN", "tie-twice", ["tie", "kind:x"], "unit a wraps b twice"),
         _finding("WRAP-FQNS", "FAIL", None, ["kind:new"], "simulation disagrees")],
    )
    new = _baseline("2.13.0", [("WRAP-UNITS", "KNOWN", None), ("TIES", "PASS", None), ("WRAP-FQNS", "PASS", None)],
                    [_finding("WRAP-UNITS", "KNOWN", "tie-twice", ["tie"], "unit a wraps b twice")])
    (tmp_path / "torch-2.4.1-fake-w4.json").write_text(json.dumps(old))
    (tmp_path / "torch-2.13.0-fake-w4.json").write_text(json.dumps(new))
    (tmp_path / "torch-2.6.0-install.notrun.json").write_text(
        json.dumps({"release": "2.6.0", "what": "install", "reason": "pip install torch==2.6.0: no matching distribution"})
    )
    return tmp_path


def test_findings_get_their_first_and_last_release_and_ranges_apply(matrix_dir):
    m = matrix.load(matrix_dir, KNOWN)
    assert m.releases == ["2.4.1", "2.6.0", "2.13.0"]  # by version, not by text
    a = matrix.analyse(m)
    f = {x["id"]: x for x in a["findings"]}
    tie = f["tie-twice"]
    assert (tie["first"], tie["last"], tie["covered"]) == ("2.4.1", "2.13.0", False)
    assert tie["gaps"] == []  # 2.6.0 did not run: not a gap
    unknown = [x for x in a["findings"] if x["known"] is None]
    assert len(unknown) == 1 and unknown[0]["first"] == unknown[0]["last"] == "2.4.1"
    assert [k.id for k in a["unseen"]] == ["never-seen"]
    cells = a["rows"][("WRAP-UNITS", "fsdp1")]["cells"]
    # outside its range a known failure is a FAIL; inside, KNOWN
    assert cells["2.4.1"]["fake-w4"]["verdict"] == "FAIL"
    assert cells["2.13.0"]["fake-w4"]["verdict"] == "KNOWN"
    assert a["counts"][("2.4.1", "fake-w4")] == {"PASS": 0, "FAIL": 2, "KNOWN": 0, "FIXED": 0, "SKIP": 1}
    assert a["counts"][("2.13.0", "fake-w4")]["PASS"] == 2


def test_a_range_that_covers_the_measurement_is_known_everywhere(matrix_dir):
    wide = [known_mod.KnownFailure(**{**KNOWN[0].__dict__, "torch": SpecifierSet(">=2.4,<2.15")})]
    a = matrix.analyse(matrix.load(matrix_dir, wide))
    assert a["rows"][("WRAP-UNITS", "fsdp1")]["cells"]["2.4.1"]["fake-w4"]["verdict"] == "KNOWN"
    assert next(x for x in a["findings"] if x["id"] == "tie-twice")["covered"]


def test_page_markdown_and_html(matrix_dir):
    m = matrix.load(matrix_dir, KNOWN)
    a = matrix.analyse(m)
    md = matrix.render_markdown(m, a)
    assert "| 2.6.0 | install | not run: pip install torch==2.6.0: no matching distribution |" in md
    assert "| 2.13.0 | fake-w4 | 2 | 1 | 0 | 0 | 30 | 2s | `ci` |" in md
    assert "| WRAP-UNITS | fsdp1 | **FAIL** | - | KNOWN |" in md
    assert "| tie-twice | WRAP-UNITS | 2.4.1 | 2.13.0 | - | `>=2.13` (**does not cover every release seen**) |" in md
    assert "| TIES | fsdp1 | 2.4.1 | register_fsdp_forward_method: not in torch 2.4.1 |" in md
    html = matrix.render_html(m, a)
    assert "not run: pip install torch==2.6.0" in html and "tie-twice" in html and "v v-FAIL" in html
    assert "--pass:" in html  # the report's own style sheet


def test_write_replaces_the_page_whole(matrix_dir):
    md, html = matrix.write(matrix_dir, KNOWN)
    assert md.read_text().startswith("# fsdp-conformance release matrix")
    assert html.read_text().lstrip().startswith("<!DOCTYPE html>")
    assert not list(matrix_dir.glob("*.tmp"))


def _matrix(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "ci" / "matrix.py"), *args], capture_output=True, text=True, timeout=120)


def _load_script():
    spec = importlib.util.spec_from_file_location("ci_matrix", ROOT / "ci" / "matrix.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_release_that_cannot_be_installed_is_recorded_as_not_run(tmp_path, capsys):
    out = tmp_path / "matrix"
    # in process (torch is already imported here); an interpreter that
    # cannot make a venv: the install step fails at once
    rc = _load_script().main(["2.4.1", "--out", str(out), "--venv-root", str(tmp_path / "venvs"), "--python", "/bin/false"])
    assert rc == 0, capsys.readouterr()
    record = json.loads((out / "torch-2.4.1-install.notrun.json").read_text())
    assert record["release"] == "2.4.1" and record["reason"].startswith("venv:")
    assert "| 2.4.1 | install | not run: venv:" in (out / "README.md").read_text()
    assert not (tmp_path / "venvs" / "torch-2.4.1").exists()  # cleaned up


def test_tiers_rerun_only_keeps_the_other_tiers_rows(tmp_path, capsys):
    out = tmp_path / "matrix"
    out.mkdir()
    kept = out / "torch-2.4.1-fake-w4.json"
    kept.write_text("{}")
    stale = out / "torch-2.4.1-gloo-w2.notrun.json"
    stale.write_text("{}")
    _load_script().main(["2.4.1", "--tiers", "gloo", "--out", str(out), "--venv-root", str(tmp_path / "venvs"),
                         "--python", "/bin/false"])
    capsys.readouterr()
    assert kept.exists() and not stale.exists()
    assert (out / "torch-2.4.1-install.notrun.json").exists()


@pytest.mark.parametrize("bad", [["two.four"], ["2.4"], ["--newest", "0"], ["--tiers", "nccl"], ["--tiers", ""]])
def test_bad_input_is_one_line_and_exit_2(tmp_path, bad):
    proc = _matrix(*bad, "--out", str(tmp_path))
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


# ---- an API a release cannot run: SKIP with its reason (conformance/adapters/support.py)


def test_fsdp2_runs_here_on_this_torch():
    from conformance.areas.common import support

    support.fsdp2_unavailable.cache_clear()
    assert support.fsdp2_unavailable() is None
    assert support.unavailable("fsdp1", "fsdp1", "fake") is None


def test_fsdp2_that_needs_cuda_streams_is_unavailable(monkeypatch):
    # torch 2.4's comm context builds torch.cuda.Stream whatever the device
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    from conformance.areas.common import support

    def cuda_only(self, device):
        raise RuntimeError("CUDA error: CUDA driver version is insufficient for CUDA runtime version")

    monkeypatch.setattr(_fsdp_param_group.FSDPCommContext, "lazy_init", cuda_only)
    support.fsdp2_unavailable.cache_clear()
    try:
        reason = support.unavailable("fsdp2", "fsdp2", "gloo")
    finally:
        support.fsdp2_unavailable.cache_clear()
    assert reason.startswith("FSDP2 in torch ") and "CUDA driver version is insufficient" in reason


def test_fsdp2_whose_cpu_streams_cannot_record_events_is_unavailable(monkeypatch):
    # torch 2.6: CPU streams, but the forward's stream.record_event() fails
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    from conformance.areas.common import support

    def old_cpu_streams(self, device):
        self.all_gather_stream = object()

    monkeypatch.setattr(_fsdp_param_group.FSDPCommContext, "lazy_init", old_cpu_streams)
    support.fsdp2_unavailable.cache_clear()
    try:
        reason = support.unavailable("fsdp2", "fsdp2", "fake")
    finally:
        support.fsdp2_unavailable.cache_clear()
    assert "no attribute 'record_event'" in reason


def test_session_skips_an_unavailable_api_with_its_reason(monkeypatch):
    from conformance.areas.common import support
    from conformance.run.session import Session
    from tests.self.cases import two_blocks, with_plan

    monkeypatch.setattr(support, "unavailable", lambda api, scenario, tier: f"no {api} here" if api == "fsdp2" else None)
    with pytest.raises(pytest.skip.Exception, match="no fsdp2 here"):
        Session().check("FSDP2-GROUPS", with_plan(two_blocks(), api="fsdp2", policy=None), engine=None, tier="fake")


def test_the_bare_already_wrapped_assertion_of_older_torch_gets_its_words(tmp_path):
    # torch 2.4-2.6: `assert not isinstance(child, cast(type, wrapper_cls))` in
    # _recursive_wrap, no message; 2.13 says "Child module ... is already wrapped"
    from conformance.areas.autowrap.invariants import error_tags
    from conformance.areas.autowrap.observation import FrozenMessage, WrapObservation
    from conformance.areas.common.fsdp1_adapter import error_text

    # a module of its own: pytest would give a test module's assert a message
    (tmp_path / "old_wrap.py").write_text("def _recursive_wrap(child):\n    assert not isinstance(child, int)\n")
    spec = importlib.util.spec_from_file_location("old_wrap", tmp_path / "old_wrap.py")
    old_wrap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old_wrap)
    with pytest.raises(AssertionError) as info:
        old_wrap._recursive_wrap(1)
    text = error_text(info.value)
    assert "is already wrapped" in text
    obs = WrapObservation(api="fsdp1", rank=0, world_size=1, torch_version="2.4.1",
                      error=FrozenMessage("AssertionError", text, None, None, None, None, None))
    assert error_tags(obs) == {"error:already-wrapped"}
    assert error_text(AssertionError()) == "AssertionError without a message"  # any other bare assertion
    assert error_text(ValueError("named")) == "named"


def _repros(release: str, verdicts: dict[str, str]) -> dict:
    return {"schema": "fsdp-conformance-repros", "release": release, "torch": f"{release}+cpu",
            "findings": {fid: {"verdict": v, "runs": [{"command": f"python {fid}.py", "shown": True, "verdict": v}]}
                         for fid, v in verdicts.items()}}


def test_the_repros_tier_measures_each_range_and_marks_the_bounds_it_could_not(matrix_dir):
    # tie-twice: >=2.13 in known_failures; its repro shows it on 2.13.0 and, against the range, on 2.4.1 too;
    # never-seen (>=2.4): as specified on 2.13.0 (the range says it should show), no verdict on 2.4.1
    (matrix_dir / "torch-2.4.1-repros.json").write_text(json.dumps(_repros("2.4.1", {"tie-twice": "DEVIATION", "never-seen": "no verdict"})))
    (matrix_dir / "torch-2.13.0-repros.json").write_text(json.dumps(_repros("2.13.0", {"tie-twice": "DEVIATION", "never-seen": "AS SPECIFIED"})))
    m = matrix.load(matrix_dir, KNOWN)
    rows = {r["id"]: r for r in matrix.measured_ranges(m)}
    tie, never = rows["tie-twice"], rows["never-seen"]
    assert (tie["first"], tie["last"], tie["disagrees"]) == ("2.4.1", "2.13.0", ["2.4.1"])
    assert tie["lower_measured"] and tie["upper_measured"]  # the oldest and newest release of the matrix
    assert never["first"] is None and never["disagrees"] == ["2.13.0"]
    # 2.6.0 (not run) lies between: a finding first shown on 2.13.0 has an unmeasured lower bound
    (matrix_dir / "torch-2.4.1-repros.json").unlink()
    (matrix_dir / "torch-2.6.0-repros.json").write_text(json.dumps(_repros("2.6.0", {"tie-twice": "no verdict"})))
    tie = {r["id"]: r for r in matrix.measured_ranges(matrix.load(matrix_dir, KNOWN))}["tie-twice"]
    assert tie["first"] == "2.13.0" and not tie["lower_measured"] and tie["disagrees"] == []
    md = matrix.render_markdown(m := matrix.load(matrix_dir, KNOWN), matrix.analyse(m))
    assert "## Findings: measured ranges" in md and "| tie-twice | `>=2.13` | ? | D | 2.13.0 *unmeasured* | 2.13.0 | - |" in md


def test_without_repro_runs_the_page_says_every_range_is_unmeasured(matrix_dir):
    m = matrix.load(matrix_dir, KNOWN)
    assert "every range in `known_failures.toml` is unmeasured here" in matrix.render_markdown(m, matrix.analyse(m))


def test_an_unmatched_finding_is_identified_by_the_finding_in_range_first():
    """A baseline's FAIL re-identified by its tags on the page: a finding
    whose range holds the release wins over one that matched by tags only
    (the 2.9.1 / 2.10.0 TP deviations were frozen weights made trainable,
    not gloo's summed reduce-scatter, fixed in 2.9.1)."""
    tags = ["api:fsdp2", "backend:gloo", "kind:param", "mesh:2d", "style:colwise", "requires-grad:changed"]
    f = {"known_failure": None, "violations": [{"invariant": "TP-PARITY", "tags": tags}]}
    ks = known_mod.load()
    assert matrix.identify(f, ks, "2.10.0").id == "tp-colwise-rowwise-unfreeze-params"
    assert matrix.identify(f, ks, "2.8.0").id == "fsdp2-gloo-reduce-scatter-avg-sums"  # both in range: file order
    assert matrix.identify(f, ks, "2.13.0").id == "fsdp2-gloo-reduce-scatter-avg-sums"  # neither: the first that fits (a FAIL there)
