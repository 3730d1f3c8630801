"""Generated checkpoint repro scripts: torch-only; a plain `python` run of a
case found on 2 ranks says that it runs another world size (seed 11: the
script of an FSDP1 use_orig_params=True load did not deviate under python,
where FSDP1 switches to NO_SHARD), and a failed load prints the first failing
rank's own exception rather than the CheckpointException's tracebacks."""

import subprocess
import sys

import pytest

from conformance.run import corpus, repros
from conformance.run.repro import repro_script
from tests.self.torchrun import torchrun_env

pytestmark = pytest.mark.selfcheck

CASE = "fsdp1-orig-params-shared-module-sharded-state-dict-raw-shard"


def _script(tmp_path):
    spec = next(c.spec for c in corpus.load() if c.name == CASE)
    text = repro_script(spec, title="CKPT-RESHARD")
    body = text.split('"""', 2)[2]  # after the docstring
    assert "conformance" not in body, "a repro must not need this suite"
    assert "SAVE_WORLD, LOAD_WORLD = 2, 2" in text
    path = tmp_path / "repro.py"
    path.write_text(text)
    return path


def test_a_python_run_of_a_two_rank_case_says_so(tmp_path):
    run = subprocess.run([sys.executable, str(_script(tmp_path))], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "[rank 0] note: the case saves on 2 rank(s) and loads on 2; this run has 1" in run.stdout


@pytest.mark.gloo
def test_the_two_rank_run_shows_the_inner_exception(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(_script(tmp_path))]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=torchrun_env(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    assert "note:" not in run.stdout
    verdict, line = repros.verdict_of(run.stdout)
    assert verdict == "DEVIATION", run.stdout[-2000:]
    assert "the load raised CheckpointException: rank 0: ValueError: Size mismatch between saved torch.Size([7, 7])" in line, line
