"""pytest plugin of ``fsdp-conformance bench``: the conformance tests run as
``fsdp-conformance run`` runs them, and each process writes where their time
went to $FSDP_CONFORMANCE_BENCH_OUT: per test its wall time and, per scenario
run of each example, the engine's time, the slowest rank's time inside the
scenario and inside FSDP, and the driver's checks (Session.timings), and
the pools started inside it (world size, seconds to ready)."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import pytest

from conformance.engine import pool

ENV_VAR = "FSDP_CONFORMANCE_BENCH_OUT"
REPORT_PLUGIN = "fsdp-conformance-report"

_tests: list[dict] = []
_started = time.perf_counter()


def _session(config):
    plugin = config.pluginmanager.get_plugin(REPORT_PLUGIN)
    return plugin.get_session() if plugin is not None else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    session = _session(item.config)
    if session is not None and session.timings is None:
        session.timings = []
    before = len(session.timings) if session is not None else 0
    starts = len(pool.STARTS)
    t0 = time.perf_counter()
    try:
        return (yield)
    finally:
        wall = time.perf_counter() - t0
        timings = session.timings[before:] if session is not None else []
        _tests.append({"nodeid": item.nodeid, "wall": wall, "timings": [dataclasses.asdict(t) for t in timings],
                       # pools (re)started inside the test (a Worlds pool of another world size, a rebuild)
                       "pool_starts": [list(s) for s in pool.STARTS[starts:]]})


def pytest_sessionfinish(session):
    out = os.environ.get(ENV_VAR)
    if out:
        with open(out, "w") as f:
            json.dump({"process_seconds": time.perf_counter() - _started, "tests": _tests}, f)
