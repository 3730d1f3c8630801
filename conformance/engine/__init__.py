"""Where cases run: the fake tier (in-process), a pool of rank processes, torchrun."""

from conformance.engine.errors import (
    CRASH,
    HANG,
    BackendUnavailable,
    EngineError,
    ExampleFailed,
    PoolStartError,
    RankCrash,
    RankHang,
    RankState,
)
from conformance.engine.fake import FakeEngine
from conformance.engine.pool import RankPool, resolve_backend
from conformance.engine.scenarios import Scenario, get_scenario, run_scenario, scenario, scenario_names

__all__ = [
    "CRASH", "HANG", "BackendUnavailable", "EngineError", "ExampleFailed", "FakeEngine", "PoolStartError",
    "RankCrash", "RankHang", "RankPool", "RankState", "Scenario", "get_scenario", "resolve_backend",
    "run_scenario", "scenario", "scenario_names",
]
