"""Generated FSDP2 repro scripts are torch-only and run, under python and
torchrun, each printing one verdict line."""

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from conformance.run import repros
from conformance.run.repro import repro_script
from conformance.strategies.groups import fsdp2_case_specs
from tests.self.torchrun import torchrun_env

pytestmark = pytest.mark.selfcheck


def _specs(n):
    out = []

    @settings(max_examples=n, database=None, phases=[Phase.generate], derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
    @given(fsdp2_case_specs())
    def collect(spec):
        out.append(spec)

    collect()
    return out


def test_fsdp2_scripts_are_torch_only_and_run(tmp_path):
    specs = _specs(6)
    assert any(s.methods for s in specs)
    for i, spec in enumerate(specs):
        text = repro_script(spec, title="test")
        body = text.split('"""', 2)[2]  # after the docstring
        assert "conformance" not in body, "a repro must not need this suite"
        assert "fully_shard(" in text
        path = tmp_path / f"repro{i}.py"
        path.write_text(text)
        run = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        assert repros.verdict_of(run.stdout)[0] is not None, run.stdout[-2000:]


def test_fsdp2_script_runs_under_torchrun(tmp_path):
    spec = next(s for s in _specs(6) if s.methods)
    path = tmp_path / "repro.py"
    path.write_text(repro_script(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=torchrun_env(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    assert repros.verdict_of(run.stdout)[0] is not None, run.stdout[-2000:]
