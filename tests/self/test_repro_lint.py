"""The repro scripts pass the linter (ruff: unused imports and names,
undefined names, import order): the committed ones, and the ones every
area's generator writes for the regression corpus's cases (all areas: wrap,
fully_shard, schedule, checkpoint, the suite replay) and for real-model cases."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.case.model_case import ModelCase
from conformance.case.spec import ShardGroup, SizeBasedWrap, WrapPlan
from conformance.run import corpus
from conformance.run.repro import repro_script

pytestmark = pytest.mark.selfcheck
ROOT = Path(__file__).resolve().parents[2]


def _ruff(*paths) -> subprocess.CompletedProcess:
    exe = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    return subprocess.run([exe, "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), *map(str, paths)],
                          capture_output=True, text=True, cwd=ROOT)


def test_committed_repros_pass_ruff():
    run = _ruff(*sorted((ROOT / "reports" / "findings").glob("*.py")))
    assert run.returncode == 0, run.stdout[-4000:]


def test_generated_repros_pass_ruff(tmp_path):
    areas = set()
    for case in corpus.load():
        text = repro_script(case.spec, [], title=case.invariants[0])
        (tmp_path / f"{case.name}.py").write_text(text)
        areas.add(text.split("\n", 1)[0])
    target = "tests.self.mha_target:target"
    for i, case in enumerate([ModelCase(target, plan=WrapPlan("fsdp1", SizeBasedWrap(100))),
                              ModelCase(target, plan=WrapPlan("fsdp2", groups=(ShardGroup(("blocks.0.attn.out_proj",)),)))]):
        (tmp_path / f"model{i}.py").write_text(repro_script(case, [], title="lint"))
    assert len(list(tmp_path.glob("*.py"))) > 50
    run = _ruff(tmp_path)
    assert run.returncode == 0, run.stdout[-4000:]
