"""`fsdp-conformance change BASE NEW`: a copy of the installed FSDP with one
deliberate regression is reported as a regression (exit 1), with a repro
script that shows it when run against NEW's FSDP."""

import json
import os
import subprocess
import sys

import pytest

from conformance.selfcheck import fsdp_source

pytestmark = pytest.mark.selfcheck


def test_change_reports_a_deliberate_regression_with_its_repro(tmp_path):
    new = fsdp_source.copy_installed(tmp_path / "new")
    wrap_utils = new / "torch" / "distributed" / "fsdp" / "_wrap_utils.py"
    text = wrap_utils.read_text()
    # the regression: a mixed unit with use_orig_params=False only warns
    assert text.count("                    raise ValueError(msg)") == 1
    wrap_utils.write_text(text.replace("                    raise ValueError(msg)", "                    warnings.warn(msg, stacklevel=2)"))
    out_dir = tmp_path / "change"
    env = {k: v for k, v in os.environ.items() if k != fsdp_source.ENV_VAR}
    proc = subprocess.run(
        [sys.executable, "-m", "conformance.cli", "change", "installed", str(new), "--backend", "fake",
         "--invariant", "FROZEN-ERROR", "--examples", "10", "--report-dir", str(out_dir), "--progress", "quiet"],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    text = proc.stdout
    assert "BASE FSDP: installed" in text
    assert f"NEW FSDP:  {new}" in text and "differs from installed in 1 file (_wrap_utils.py)" in text
    regressions = text.split("Regressions (1):", 1)[1]
    assert regressions.splitlines()[1].strip().startswith("FROZEN-ERROR (fsdp1, fake)")
    summary = json.loads((out_dir / "change.json").read_text())
    assert [r["invariant"] for r in summary["regressions"]] == ["FROZEN-ERROR"]
    assert summary["new_source"]["path"] == str(new) and summary["base_source"] is None
    # BASE and NEW ran the same profile and seed
    base = json.loads((out_dir / "base" / "report.json").read_text())
    newr = json.loads((out_dir / "new" / "report.json").read_text())
    assert str(base["run"]["seed"]) == str(newr["run"]["seed"]) == str(summary["seed"])
    assert base["fsdp_source"] is None and newr["fsdp_source"]["path"] == str(new)
    # the repro of the regression, run against NEW's FSDP, shows the warning
    # where the spec promises a ValueError
    (repro,) = summary["regression_repros"]
    assert repro["command"] == f"python -m conformance.selfcheck.fsdp_source run {new} {repro['repro']}"
    assert repro["command"] in text
    run = subprocess.run([sys.executable, "-m", "conformance.selfcheck.fsdp_source", "run", str(new), repro["repro"]],
                         capture_output=True, text=True, timeout=300, env=env)
    shown = run.stdout + run.stderr
    assert "UserWarning" in shown and "FSDP does not support wrapping such modules when use_orig_params=False" in shown
    assert "DEVIATION: " in shown and "expected a ValueError" in shown  # the script's own verdict: the spec promises a ValueError
