"""The GitHub Actions workflows (ci/workflows/) validate against GitHub's
workflow schema (check-jsonschema's vendored copy, no network), call only
scripts that exist in ci/, and those scripts are valid bash."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.selfcheck
ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((ROOT / "ci" / "workflows").glob("*.yml"))
SCRIPTS = sorted((ROOT / "ci").glob("*.sh"))


def check_jsonschema(*files: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("check-jsonschema") or str(Path(sys.executable).with_name("check-jsonschema"))
    if not Path(exe).exists():
        pytest.skip("check-jsonschema is not installed (pip install -e '.[test]')")
    return subprocess.run([exe, "--builtin-schema", "vendor.github-workflows", *map(str, files)], capture_output=True, text=True, timeout=120)


def test_there_are_cpu_gpu_nightly_hunt_and_matrix_workflows():
    assert {"cpu", "multi-gpu", "nightly", "hunt", "matrix"} <= {p.stem for p in WORKFLOWS}


def test_workflows_match_githubs_schema():
    proc = check_jsonschema(*WORKFLOWS)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_schema_check_catches_a_broken_workflow(tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_text(WORKFLOWS[0].read_text().replace("runs-on:", "run-on:", 1))
    assert check_jsonschema(broken).returncode != 0


def _run_steps(path: Path) -> list[str]:
    yaml = pytest.importorskip("ruamel.yaml")
    doc = yaml.YAML(typ="safe").load(path.read_text())
    return [step["run"] for job in doc["jobs"].values() for step in job["steps"] if "run" in step]


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=lambda p: p.stem)
def test_workflows_call_the_ci_scripts(workflow):
    runs = _run_steps(workflow)
    called = {m for r in runs for m in re.findall(r"\bci/[\w.-]+", r)}
    assert called, f"{workflow.name} calls no ci/ script"
    for script in called:
        assert (ROOT / script).is_file(), f"{workflow.name} calls {script}, which does not exist"
    assert any("ci/setup.sh" in r for r in runs), "every workflow sets up with ci/setup.sh, as the README does"


def test_ci_scripts_are_valid_bash_and_used():
    text = "\n".join(p.read_text() for p in WORKFLOWS + SCRIPTS) + (ROOT / "README.md").read_text() + (ROOT / ".ci" / "run").read_text()
    for script in SCRIPTS:
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{script.name}: {proc.stderr}"
        assert f"ci/{script.name}" in text.replace(f"# {script.name}", ""), f"nothing calls ci/{script.name}"


def test_readme_says_where_the_workflows_go():
    readme = (ROOT / "README.md").read_text()
    assert "ci/workflows/" in readme and ".github/workflows/" in readme
