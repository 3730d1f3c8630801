"""The suite installs like a library: the wheel, installed non-editably into
a fresh virtual environment that sees this environment's torch and
dependencies (no download), runs `fsdp-conformance run` from an unrelated
directory, and its pytest plugin leaves a project that does not ask for
conformance alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from conformance.report import data

pytestmark = pytest.mark.selfcheck
ROOT = Path(__file__).resolve().parents[2]
# what the wheel is built from (a copy: building in place would leave build/ behind)
SOURCES = ("pyproject.toml", "README.md", "conformance", "strategies")


def _run(cmd, cwd, timeout=300, **kw):
    # no PYTHONPATH: nothing but the installed wheel may provide `conformance`
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")} | {"CI": "1"}
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env, **kw)
    return proc


def _ok(proc) -> str:
    assert proc.returncode == 0, f"{proc.args}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the venv's python, its bin directory) with the wheel installed."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in SOURCES:
        p = ROOT / name
        (shutil.copytree(p, src / name, ignore=ignore) if p.is_dir() else shutil.copy2(p, src / name))
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index", "-q", "-w", str(tmp / "dist")]
    try:  # this environment's setuptools builds the wheel: nothing to download
        import setuptools  # noqa: F401

        build.append("--no-build-isolation")
    except ImportError:
        pass
    _ok(_run([*build, str(src)], cwd=tmp))
    (wheel,) = (tmp / "dist").glob("fsdp_conformance-*.whl")

    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = Path(_ok(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp)).strip())
    # this environment's packages (torch, hypothesis, ...) after the venv's own;
    # a path listed in a .pth file is not scanned for .pth files itself, so
    # this checkout's editable install stays inactive there
    here = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (site / "outer-site-packages.pth").write_text("\n".join(here) + "\n")
    # --no-index without --no-deps: pip must find every dependency (torch
    # included) already installed, or fail rather than fetch another
    _ok(_run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-index", "-q", str(wheel)], cwd=tmp))
    return py, env_dir / "bin"


def test_the_installed_wheel_runs_from_another_directory(installed, tmp_path):
    py, bin_dir = installed
    where = _ok(_run([str(py), "-c", "import importlib.util, conformance, torch; from conformance.run import corpus; "
                      "from conformance.strategies import trees; "
                      "assert importlib.util.find_spec('strategies') is None, 'a top-level strategies package shipped'; "
                      "print(conformance.__file__, torch.__version__, len(corpus.load()))"], cwd=tmp_path))
    module, torch_version, corpus_cases = where.split()
    assert int(corpus_cases) > 0, "the regression corpus did not ship"
    assert Path(module).is_relative_to(bin_dir.parent), f"imported {module}, not the installed wheel"
    import torch

    assert torch_version == torch.__version__  # the same torch, not another one pip pulled in
    proc = _run([str(bin_dir / "fsdp-conformance"), "run", "--backend", "fake", "--invariant", "WRAP-UNITS",
                 "--examples", "5", "--progress", "quiet"], cwd=tmp_path)
    _ok(proc)
    out = tmp_path / "reports" / "latest"
    report = data.load(out / "report.json")
    assert {"summary.md", "junit.xml", "report.html"} <= {p.name for p in out.iterdir()}
    (row,) = [r for r in report["results"] if r["invariant"] == "WRAP-UNITS" and r["tier"] == "fake"]
    assert row["verdict"] in ("PASS", "KNOWN") and row["examples"] >= 5, row
    assert report["suite"]["git_revision"] is None  # the installed package, not this checkout
    assert report["known_failures"], "the shipped known_failures.toml was not loaded"
    # the shipped baseline for this torch (when there is one) was found
    release = torch.__version__.split("+")[0]
    if (ROOT / "conformance" / "baselines" / f"torch-{release}-fake-w4.json").exists():
        assert report["baselines"], report.get("baselines")


def test_the_plugin_leaves_a_project_that_does_not_ask_alone(installed, tmp_path):
    py, _ = installed
    (tmp_path / "test_mine.py").write_text(
        "import pytest\n"
        "from hypothesis import settings\n\n\n"
        "@pytest.fixture\n"
        "def engine():\n"
        "    return 'mine'\n\n\n"
        "def test_mine(engine, request):\n"
        "    assert engine == 'mine'\n"
        "    assert request.config.pluginmanager.has_plugin('fsdp_conformance')\n"
        "    assert request.config.getoption('--conformance-profile') is None  # the options are there\n"
        "    assert settings.default.max_examples == 100  # Hypothesis's own, not a conformance profile\n"
    )
    out = _ok(_run([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_mine.py"], cwd=tmp_path))
    assert "1 passed" in out
    assert not (tmp_path / "reports").exists()
