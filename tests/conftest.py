"""pytest glue: Hypothesis profile, engines by tier, the conformance session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conformance import profiles

TIERS = ("fake", "gloo", "nccl")
ROOT = Path(__file__).resolve().parents[1]


def pytest_addoption(parser):
    g = parser.getgroup("fsdp-conformance")
    g.addoption("--conformance-profile", default=None, help=f"Hypothesis profile: {', '.join(profiles.PROFILES)} (or ${profiles.ENV_VAR}; default dev)")
    g.addoption("--tiers", default=os.environ.get("FSDP_CONFORMANCE_TIERS", "fake,gloo"), help="engines the conformance tests run on: fake,gloo,nccl")
    g.addoption("--world-size", type=int, default=2, help="world size of the gloo rank pool (default 2)")
    g.addoption("--fake-world-size", type=int, default=4, help="world size of the fake process group (default 4)")
    g.addoption("--example-deadline", type=float, default=60.0, help="seconds before a pool example is a HANG")
    g.addoption("--report-dir", default=os.environ.get("FSDP_CONFORMANCE_REPORT_DIR", str(ROOT / "reports" / "latest")), help="where the report (report.json, summary.md, junit.xml, report.html) and repro scripts go")
    g.addoption("--report", choices=("auto", "always", "never"), default="auto", help="write the report: auto (when conformance tests ran), always, never")
    g.addoption("--baseline", action="append", default=None, help="baseline report JSON for FIXED verdicts (repeatable); 'auto' (default): reports/baselines/ for this torch and tier; 'none'")
    g.addoption("--max-examples", type=int, default=None, help="override the profile's Hypothesis example budget")
    g.addoption("--invariant", action="append", default=None, help="run only these invariant IDs or areas (repeatable)")
    # hunting (fsdp-conformance hunt): a time limit and one report over several rounds
    g.addoption("--stop-at", type=float, default=None, help="epoch seconds after which conformance tests are skipped (hunt)")
    g.addoption("--save-partials", default=None, help="write this run's per-process results to this JSON file (hunt)")
    g.addoption("--prior-partials", action="append", default=None, help="include the results saved by an earlier run (repeatable; hunt)")


def pytest_configure(config):
    try:
        name = profiles.selected(config.getoption("--conformance-profile"))
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    profiles.activate(name)
    tiers = [t for t in config.getoption("--tiers").split(",") if t]
    bad = [t for t in tiers if t not in TIERS]
    if bad:
        raise pytest.UsageError(f"unknown tier(s) {bad}; choose from {', '.join(TIERS)}")
    config.addinivalue_line("markers", "nccl: runs on a persistent pool of NCCL rank processes (one GPU each)")
    from conformance.report.pytest_plugin import PLUGIN_NAME, ReportPlugin

    if not config.pluginmanager.has_plugin(PLUGIN_NAME):
        config.pluginmanager.register(ReportPlugin(config), PLUGIN_NAME)


def pytest_generate_tests(metafunc):
    if "engine" in metafunc.fixturenames:
        tiers = [t for t in metafunc.config.getoption("--tiers").split(",") if t]
        if metafunc.definition.get_closest_marker("needs_ranks"):
            tiers = [t for t in tiers if t != "fake"]  # one in-process rank cannot disagree
        metafunc.parametrize("engine", [pytest.param(t, marks=getattr(pytest.mark, t), id=t) for t in tiers], indirect=True, scope="session")


_ENGINES: dict = {}


@pytest.fixture(scope="session")
def engine(request):
    tier = request.param
    if tier not in _ENGINES:
        cfg = request.config
        if tier == "fake":
            from conformance.engine.fake import FakeEngine

            _ENGINES[tier] = FakeEngine(world_size=cfg.getoption("--fake-world-size"))
        else:
            from conformance.engine.pool import RankPool

            _ENGINES[tier] = RankPool(world_size=cfg.getoption("--world-size"), backend=tier, deadline=cfg.getoption("--example-deadline"))
        _ENGINES[tier].tier = tier
    return _ENGINES[tier]


@pytest.fixture(scope="session")
def fake_engine(request):
    """The fake-process-group engine, for the suite's own in-process tests
    (monkeypatched faults reach it, unlike rank processes)."""
    if "fake" not in _ENGINES:
        from conformance.engine.fake import FakeEngine

        _ENGINES["fake"] = FakeEngine(world_size=request.config.getoption("--fake-world-size"))
        _ENGINES["fake"].tier = "fake"
    return _ENGINES["fake"]


def pytest_sessionfinish(session):
    for eng in _ENGINES.values():
        close = getattr(eng, "close", None)
        if close:
            try:
                close()
            except Exception as e:  # e.g. a pool whose ranks SIGTERM already killed
                print(f"fsdp-conformance: closing {eng!r} failed: {type(e).__name__}: {e}")
    _ENGINES.clear()


@pytest.fixture(scope="session")
def conformance(request):
    """This process's conformance Session (the report plugin keeps it and
    merges it with the other xdist workers' into the run's report)."""
    from conformance.report.pytest_plugin import PLUGIN_NAME

    return request.config.pluginmanager.get_plugin(PLUGIN_NAME).get_session()
