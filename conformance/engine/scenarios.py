"""The scenario registry: name -> what one rank does with one CaseSpec.

A scenario is ``fn(spec: CaseSpec) -> dict`` (JSON-able). It runs inside a
rank whose default process group is initialised (pool, torchrun) or in the
driver over the fake process group. The areas' scenarios are registered from
their records (conformance.areas, which a driver imports before it runs
anything); a test registers its own with ``@scenario("name")`` in an
importable module. Ranks import a scenario's module by name on first use.

Test-only scenarios (``test_only=True``) exist to exercise the engine's fault
handling; ``fault=True`` marks the ones that hang or kill their process, which
the in-process fake tier refuses to run.
"""

from __future__ import annotations

import importlib
import json
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from conformance.case.model_case import case_from_json
from conformance.case.spec import CaseSpec
from conformance.engine.errors import EngineError

ScenarioFn = Callable[[CaseSpec], dict]


@dataclass(frozen=True)
class Scenario:
    name: str
    fn: ScenarioFn
    module: str  # where ranks import it from
    test_only: bool = False
    fault: bool = False  # hangs or kills its process: never run in-process
    # What every rank must agree on, from one rank's value (rank ids, pids and
    # timings removed).
    comparable: Callable[[dict], Any] | None = None
    # Modules the scenario imports on first use; a pool's fork server imports
    # them once, before it forks any rank.
    preload: tuple[str, ...] = ()
    # Run as these scenarios one after the other, each on its own world, in
    # one directory (conformance.engine.worlds): a checkpoint's save and load.
    phases: tuple[str, ...] = ()

    def comparable_value(self, value: dict) -> Any:
        if self.comparable is not None:
            return self.comparable(value)
        return {k: v for k, v in value.items() if k not in ("rank", "pid") and not k.endswith("seconds")}


_REGISTRY: dict[str, Scenario] = {}


def register(sc: Scenario) -> None:
    """Register ``sc`` under its name (again is harmless, another one is not)."""
    old = _REGISTRY.get(sc.name)
    if old is not None and (old.module, getattr(old.fn, "__qualname__", None)) != (sc.module, getattr(sc.fn, "__qualname__", None)):
        raise EngineError(f"scenario {sc.name!r} is already registered by {old.module}.{getattr(old.fn, '__qualname__', '?')}")
    _REGISTRY[sc.name] = sc


def scenario(
    name: str,
    *,
    test_only: bool = False,
    fault: bool = False,
    comparable: Callable[[dict], Any] | None = None,
    preload: tuple[str, ...] = (),
) -> Callable[[ScenarioFn], ScenarioFn]:
    """Register ``fn`` as the scenario ``name`` (test scenarios)."""

    def declare(fn: ScenarioFn) -> ScenarioFn:
        register(Scenario(name, fn, fn.__module__, test_only, fault, comparable, tuple(preload)))
        return fn

    return declare


# Where the suite's scenarios are declared, by module name: the areas
# (their records) and the engine's own self-checks. The engine imports them
# on the first lookup that misses, as a rank imports a scenario's module.
PROVIDERS = ("conformance.areas", "conformance.engine.selfcheck")


def get_scenario(name: str, module: str | None = None) -> Scenario:
    """The scenario ``name``; imports ``module`` (else the PROVIDERS) first
    if it is not registered yet."""
    if name not in _REGISTRY:
        for m in (module,) if module else PROVIDERS:
            importlib.import_module(m)
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(scenario_names(include_test_only=True))
        raise EngineError(f"unknown scenario {name!r}; known: {known}") from None


def scenario_names(*, include_test_only: bool = False) -> list[str]:
    for m in PROVIDERS:
        importlib.import_module(m)
    return sorted(n for n, s in _REGISTRY.items() if include_test_only or not s.test_only)


def default_preload() -> tuple[str, ...]:
    """What every registered scenario (test-only ones aside) imports: their
    own modules and their ``preload``s (the PROVIDERS' scenarios included)."""
    for m in PROVIDERS:
        importlib.import_module(m)
    mods: list[str] = []
    for s in _REGISTRY.values():
        if not s.test_only:
            for m in (s.module, *s.preload):
                if m != "__main__" and m not in mods:
                    mods.append(m)
    return tuple(mods)


def run_scenario(
    name: str,
    spec_json: str | CaseSpec,
    *,
    rank: int,
    module: str | None = None,
    catch: tuple[type[BaseException], ...] = (Exception,),
    args: dict | None = None,
) -> dict:
    """Run one scenario on one rank and return its result record:
    ``{"rank", "ok": True, "value", "seconds"}`` or
    ``{"rank", "ok": False, "error": {"type", "message", "traceback"}, "seconds"}``.
    ``seconds`` times the scenario function alone. An exception is a record,
    not a crash; the value must be JSON-able. ``args``: keyword arguments
    for the scenario besides the spec (pure data, e.g. a directory)."""
    start = time.perf_counter()
    try:
        from conformance.case.build import released

        sc = get_scenario(name, module)
        # in-process callers may hand the (immutable) spec over as it is
        spec = spec_json if not isinstance(spec_json, str) else case_from_json(spec_json)
        start = time.perf_counter()
        with released():  # the example's models go with it (conformance.case.build.released)
            value = sc.fn(spec, **args) if args else sc.fn(spec)
        seconds = time.perf_counter() - start
        if not isinstance(value, dict):
            raise EngineError(f"scenario {name!r} returned {type(value).__name__}, not a dict")
        return {"rank": rank, "ok": True, "value": value, "seconds": seconds}
    except catch as e:
        seconds = time.perf_counter() - start
        return {"rank": rank, "ok": False, "error": error_record(e), "seconds": seconds}


def error_record(e: BaseException) -> dict:
    return {
        "type": type(e).__name__,
        "message": str(e).splitlines()[0] if str(e) else "",
        "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__)),
    }


def json_roundtrip(record: dict, catch: tuple[type[BaseException], ...] = (Exception,)) -> dict:
    """The record as it arrives through a pipe (tuples become lists); a value
    that is not JSON-able becomes an error record."""
    try:
        return json.loads(json.dumps(record))
    except catch as e:
        return {"rank": record["rank"], "ok": False, "error": error_record(e), "seconds": record["seconds"]}
