"""The pytest plugin of fsdp-conformance (the ``pytest11`` entry point
``fsdp_conformance``): options, the engines by tier (``engine``,
``fake_engine``), the conformance session (``conformance``) and the report.

Installing the package gives every pytest run these options and fixtures, so
it must stay harmless where nobody asks for conformance: the Hypothesis
profile is loaded, SIGTERM handled and the report written only when the
conformance suite (conformance/suite) or a test using the ``conformance``
fixture is part of the run, or a conformance option asks for it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conformance import paths
from conformance.plugin import order
from conformance.run import profiles

TIERS = ("fake", "gloo", "nccl")
REPORT_DIR_ENV = "FSDP_CONFORMANCE_REPORT_DIR"


def pytest_addoption(parser):
    g = parser.getgroup("fsdp-conformance")
    g.addoption("--conformance-profile", default=None, help=f"Hypothesis profile: {', '.join(profiles.PROFILES)} (or ${profiles.ENV_VAR}; default dev)")
    g.addoption("--tiers", default=os.environ.get("FSDP_CONFORMANCE_TIERS", "fake,gloo"), help="engines the conformance tests run on: fake,gloo,nccl")
    g.addoption("--world-size", type=int, default=2, help="world size of the gloo rank pool (default 2)")
    g.addoption("--fake-world-size", type=int, default=4, help="world size of the fake process group (default 4)")
    g.addoption("--example-deadline", type=float, default=60.0, help="seconds before a pool example is a HANG")
    g.addoption("--report-dir", default=os.environ.get(REPORT_DIR_ENV), help="where the report (report.json, summary.md, junit.xml, report.html) and repro scripts go (default: reports/latest under pytest's rootdir)")
    g.addoption("--report", choices=("auto", "always", "never"), default="auto", help="write the report: auto (when conformance tests ran), always, never")
    g.addoption("--baseline", action="append", default=None, help="baseline report JSON for FIXED verdicts (repeatable); 'auto' (default): the shipped baselines for this torch and tier; 'none'")
    g.addoption("--max-examples", type=int, default=None, help="override the profile's Hypothesis example budget")
    g.addoption("--invariant", action="append", default=None, help="run only these invariant IDs or areas (repeatable)")
    g.addoption("--slowest-first", action="store_true", default=False,
                help="on xdist workers, take the tests slowest first by --durations-path (fsdp-conformance run -n N does)")
    g.addoption("--store-durations", action="store_true", default=False,
                help="record each test's duration in --durations-path: the order a conformance run takes (slowest first)")
    g.addoption("--durations-path", default=str(order.DURATIONS),
                help="the durations a run on xdist workers takes its tests by, and --store-durations writes (default conformance/suite/durations.json)")
    # hunting (fsdp-conformance hunt): a time limit and one report over several rounds
    g.addoption("--stop-at", type=float, default=None, help="epoch seconds after which conformance tests are skipped (hunt)")
    g.addoption("--save-partials", default=None, help="write this run's per-process results to this JSON file (hunt)")
    g.addoption("--prior-partials", action="append", default=None, help="include the results saved by an earlier run (repeatable; hunt)")
    # real models (conformance/suite/test_models.py)
    g.addoption("--target", action="append", default=None, help="a real model, 'package.module:attr' naming a conformance.Target (repeatable): the suite checks it too")


def requested(config) -> bool:
    """Whether this run asked for conformance: a conformance option, or the
    suite's directory (or a file in it) among the paths pytest collects."""
    if config.getoption("--conformance-profile") or os.environ.get(profiles.ENV_VAR):
        return True
    if config.getoption("--report") == "always" or config.getoption("--invariant"):
        return True
    for arg in config.args:
        if arg.split("::")[0].replace("/", ".").startswith("conformance.suite"):  # --pyargs
            return True
        p = (Path(config.invocation_params.dir) / arg.split("::")[0]).resolve()
        if p == paths.SUITE or paths.SUITE in p.parents:
            return True
    return False


def ensure_profile(config) -> None:
    """Load the selected Hypothesis profile once (the conftests of the suite
    and of the suite's own tests call this; so does a run that asks)."""
    if getattr(config, "_fsdp_conformance_profile", None):
        return
    try:
        name = profiles.selected(config.getoption("--conformance-profile"))
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    # a seed given to a derandomized profile (ci) must change the draws
    profiles.activate(name, seeded=config.getoption("hypothesis_seed", None) is not None)
    config._fsdp_conformance_profile = name


def tiers(config) -> list[str]:
    return [t for t in config.getoption("--tiers").split(",") if t]


def pytest_configure(config):
    bad = [t for t in tiers(config) if t not in TIERS]
    if bad:
        raise pytest.UsageError(f"unknown tier(s) {bad}; choose from {', '.join(TIERS)}")
    for t in TIERS:
        config.addinivalue_line("markers", f"{t}: a conformance test on the {t} tier")
    config.addinivalue_line("markers", "needs_ranks: needs real rank processes (not the fake tier)")
    config.addinivalue_line("markers", "several_ranks: needs two ranks or more (skipped with --world-size 1)")
    config.addinivalue_line("markers", MODEL_MARKER_DOC)  # fsdp_model (conformance.plugin.models)
    config._fsdp_conformance_requested = requested(config)
    if config._fsdp_conformance_requested:
        ensure_profile(config)
    from conformance.plugin.report import PLUGIN_NAME, ReportPlugin

    if not config.pluginmanager.has_plugin(PLUGIN_NAME):
        config.pluginmanager.register(ReportPlugin(config), PLUGIN_NAME)
    if config.getoption("--store-durations"):
        config.pluginmanager.register(order.Recorder(config.rootpath, Path(config.getoption("--durations-path"))),
                                      "fsdp-conformance-durations")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """--slowest-first on xdist workers: the tests slowest first
    (conformance.plugin.order). In one process the order changes no wall
    time, only what a run cut short reaches first (a hunt's time limit, a
    mutant killed by its first failing test): pytest's order stays there."""
    if config.getoption("--slowest-first") and hasattr(config, "workerinput"):
        order.order(items, order.load(Path(config.getoption("--durations-path"))))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """Before the first test of a conformance run: what is alive now (torch,
    Hypothesis, pytest, the collected tests) lives as long as the run, so
    the garbage collector's full passes stop rescanning it (gc.freeze, as
    the rank pool's fork server does). They happen every few hundred
    examples; over torch's ~300,000 objects each took 130-170 ms here,
    about a fifth of the fake tier's time after start-up."""
    if getattr(session.config, "_fsdp_conformance_requested", False):
        import gc

        gc.collect()
        gc.freeze()


def _ours(node, name: str) -> bool:
    """Whether fixture ``name`` of this test is this plugin's (a project may
    have an ``engine`` fixture of its own)."""
    info = getattr(node, "_fixtureinfo", None) or getattr(getattr(node, "definition", None), "_fixtureinfo", None)
    defs = getattr(info, "name2fixturedefs", {}).get(name) if info is not None else None
    if not defs:
        return False
    func = getattr(defs[-1], "func", None)
    return getattr(func, "__module__", None) == __name__


def pytest_generate_tests(metafunc):
    if "engine" in metafunc.fixturenames and _ours(metafunc, "engine"):
        ts = tiers(metafunc.config)
        one_rank = []
        if metafunc.definition.get_closest_marker("needs_ranks"):
            ts = [t for t in ts if t != "fake"]  # real rank processes (the fake tier is one in-process rank)
        if metafunc.definition.get_closest_marker("several_ranks") and metafunc.config.getoption("--world-size") < 2:
            one_rank = [pytest.mark.skip(reason="world size 1: one rank has nothing to disagree with")]
        metafunc.parametrize("engine", [pytest.param(t, marks=[getattr(pytest.mark, t), *one_rank], id=t) for t in ts],
                             indirect=True, scope="session")
    if "model_target" in metafunc.fixturenames:  # conformance/suite/test_models.py: one test per --target
        targets = metafunc.config.getoption("--target") or []
        metafunc.parametrize("model_target", targets or [pytest.param(None, marks=pytest.mark.skip(reason="no --target given"))],
                             ids=[t.split(":")[0].rsplit(".", 1)[-1] for t in targets] or ["no-target"])


_ENGINES: dict = {}


@pytest.fixture(scope="session")
def engine(request):
    """The engine of this test's tier (parametrized over --tiers): the fake
    process group in this process, or a pool of gloo / NCCL rank processes."""
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


_WORLDS: dict = {}


@pytest.fixture(scope="session")
def worlds(engine):
    """The engine's tier at every world size (conformance.engine.worlds):
    HSDP and TP meshes, checkpoints saved on one world size and loaded on
    another. One per tier and process, shared by every module: a pool of 4
    ranks starts once, not once per test module."""
    from conformance.engine.worlds import Worlds

    if engine.tier not in _WORLDS:
        _WORLDS[engine.tier] = Worlds(engine)
    return _WORLDS[engine.tier]


@pytest.fixture(scope="session")
def fake_engine(request):
    """The fake-process-group engine, for in-process tests (monkeypatched
    faults reach it, unlike rank processes)."""
    if "fake" not in _ENGINES:
        from conformance.engine.fake import FakeEngine

        _ENGINES["fake"] = FakeEngine(world_size=request.config.getoption("--fake-world-size"))
        _ENGINES["fake"].tier = "fake"
    return _ENGINES["fake"]


@pytest.fixture(scope="session")
def conformance(request):
    """This process's conformance Session (the report plugin keeps it and
    merges it with the other xdist workers' into the run's report)."""
    from conformance.plugin.report import PLUGIN_NAME

    ensure_profile(request.config)
    return request.config.pluginmanager.get_plugin(PLUGIN_NAME).get_session()


def pytest_sessionfinish(session):
    for eng in [*_WORLDS.values(), *_ENGINES.values()]:
        close = getattr(eng, "close", None)
        if close:
            try:
                close()
            except Exception as e:  # e.g. a pool whose ranks SIGTERM already killed
                print(f"fsdp-conformance: closing {eng!r} failed: {type(e).__name__}: {e}")
    _WORLDS.clear()
    _ENGINES.clear()


from conformance.plugin.models import MARKER_DOC as MODEL_MARKER_DOC  # noqa: E402
from conformance.plugin.models import fsdp_model  # noqa: E402,F401  (a fixture of this plugin)
