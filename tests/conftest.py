"""pytest glue: Hypothesis profile, engines by tier, the conformance session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conformance import profiles

TIERS = ("fake", "gloo")
ROOT = Path(__file__).resolve().parents[1]


def pytest_addoption(parser):
    g = parser.getgroup("fsdp-conformance")
    g.addoption("--conformance-profile", default=None, help=f"Hypothesis profile: {', '.join(profiles.PROFILES)} (or ${profiles.ENV_VAR}; default dev)")
    g.addoption("--tiers", default=os.environ.get("FSDP_CONFORMANCE_TIERS", "fake,gloo"), help="engines the conformance tests run on: fake,gloo")
    g.addoption("--world-size", type=int, default=2, help="world size of the gloo rank pool (default 2)")
    g.addoption("--fake-world-size", type=int, default=4, help="world size of the fake process group (default 4)")
    g.addoption("--example-deadline", type=float, default=60.0, help="seconds before a pool example is a HANG")
    g.addoption("--report-dir", default=os.environ.get("FSDP_CONFORMANCE_REPORT_DIR", str(ROOT / "reports" / "latest")))


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

            _ENGINES[tier] = RankPool(world_size=cfg.getoption("--world-size"), backend="gloo", deadline=cfg.getoption("--example-deadline"))
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
            close()
    _ENGINES.clear()


_SESSION = None


@pytest.fixture(scope="session")
def conformance(request):
    global _SESSION
    from conformance.session import Session

    if _SESSION is None:
        _SESSION = Session(repro_dir=Path(request.config.getoption("--report-dir")) / "repros")
    return _SESSION


def pytest_terminal_summary(terminalreporter):
    if _SESSION is None or not _SESSION.tallies:
        return
    tr = terminalreporter
    tr.section("fsdp-conformance")
    for (inv, tier), t in sorted(_SESSION.tallies.items()):
        counts = ", ".join(f"{k} {v}" for k, v in sorted(t.verdicts.items()))
        tr.write_line(f"{inv:<20} {tier:<5} {t.verdict:<6} {t.examples:>5} examples  {t.seconds:6.1f}s  ({counts})")
        for key, (spec, text) in sorted(t.findings.items()):
            if key != "FAIL":
                tr.write_line(f"    KNOWN {key}: {text}")
    for k in _SESSION.unused_known():
        tr.write_line(f"warning: known failure {k.id} ({', '.join(sorted(k.invariants))}) matched nothing in this run", yellow=True)
