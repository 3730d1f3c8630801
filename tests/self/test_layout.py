"""The layout's rules that import-linter does not express (its contracts run
in ci/test.sh): FSDP's private modules are imported by adapters only, and the
modules every pytest run or CLI call loads stay free of torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.selfcheck

ROOT = Path(__file__).resolve().parents[2]
# modules that may touch FSDP's private state: the areas' adapters, the
# shared adapters, the support probe, and the source overlay (which loads
# FSDP's packages from a tree)
ADAPTERS = ("support.py", "fsdp_source.py")  # and every *adapter.py
PRIVATE = ("torch.distributed.fsdp._", "torch.distributed._composable")


def _private_imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        out += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.startswith(PRIVATE)]
    return out


def test_fsdp_internals_are_imported_by_adapters_only():
    offenders = [hit for p in sorted((ROOT / "conformance").rglob("*.py")) if p.name not in ADAPTERS and not p.name.endswith("adapter.py") for hit in _private_imports(p)]
    offenders += [hit for p in sorted((ROOT / "strategies").rglob("*.py")) for hit in _private_imports(p)]
    assert not offenders, "FSDP internals outside an adapter:\n" + "\n".join(offenders)


def test_the_plugin_the_cli_and_the_report_load_without_torch():
    code = ("import sys\nimport conformance.plugin, conformance.cli, conformance.report.data, conformance.report.write, "
            "conformance.report.compare, conformance.report.html\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('conformance.areas')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_a_pytest_run_that_asks_nothing_of_the_suite_loads_no_torch(tmp_path):
    """The plugin is installed for every pytest run of a project that has the
    package: a run that asks for no conformance test must not pay for torch
    (seconds of start-up)."""
    (tmp_path / "test_plain.py").write_text(
        "import sys\n\ndef test_plain():\n    assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('conformance'))\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_plain.py")],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


def test_strategies_are_imported_by_their_packaged_name():
    """strategies/ ships as conformance.strategies (no top-level package in
    the wheel); a `from strategies ...` would load every strategy module a
    second time, under another name, in a checkout and fail in a wheel."""
    offenders = []
    for top in ("conformance", "strategies", "tests", "ci"):
        for p in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(p.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
                offenders += [f"{p.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n == "strategies" or n.startswith("strategies.")]
    assert not offenders, "import conformance.strategies instead:\n" + "\n".join(offenders)
