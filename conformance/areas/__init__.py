"""AREAS: one record per area, the only registry. The runner, the engine's
scenarios, repro dispatch, the suite's parametrization, the model-case
exclusions and the README's invariant table all read it.

An area is one thing FSDP does or is composed with (FSDP1 auto-wrapping,
FSDP2 groups and forward methods, the FSDP1 forward-method workaround,
training parity, checkpoints, training schedules), in a package of its own:
oracle, adapter (the only code that touches FSDP internals), observation,
invariants, scenario, repro, bench. Areas share code only through
conformance.areas.common."""

from __future__ import annotations

from conformance.areas import (
    activation_checkpointing,
    autowrap,
    checkpoint,
    clip,
    comm,
    fully_shard,
    hsdp,
    init_order,
    microbatch,
    parity,
    schedule,
    summon,
    tp,
)
from conformance.areas.common.area import Area, AreaScenario
from conformance.areas.common.catalog import Invariant, UnknownInvariant
from conformance.engine import scenarios as engine_scenarios

AREAS: tuple[Area, ...] = (
    autowrap.AREA, fully_shard.AREA, summon.AREA, parity.AREA, checkpoint.AREA, schedule.AREA, clip.AREA, comm.AREA,
    microbatch.AREA, activation_checkpointing.AREA, init_order.AREA, hsdp.AREA, tp.AREA,
)

# Derived indexes (not registries: every entry comes from AREAS).
CATALOG: dict[str, Invariant] = {inv.id: inv for area in AREAS for inv in area.invariants}
_AREA_OF: dict[str, Area] = {inv.id: area for area in AREAS for inv in area.invariants}
SCENARIOS: dict[str, tuple[Area, AreaScenario]] = {s.name: (area, s) for area in AREAS for s in area.scenarios}
if len(CATALOG) != sum(len(a.invariants) for a in AREAS) or len(SCENARIOS) != sum(len(a.scenarios) for a in AREAS):
    raise ValueError("two areas declare the same invariant ID or scenario name")


def _register_scenarios() -> None:
    """Every area's scenarios in the engine's registry, by name: ranks import
    the module of a scenario's function (which imports this package)."""
    for _, s in SCENARIOS.values():
        fn = s.run
        module = fn.__module__ if fn is not None else __name__
        engine_scenarios.register(engine_scenarios.Scenario(
            s.name, fn, module, comparable=s.comparable, phases=s.phases,
        ))


_register_scenarios()


def get(invariant_id: str) -> Invariant:
    try:
        return CATALOG[invariant_id]
    except KeyError:
        raise UnknownInvariant(invariant_id, list(CATALOG)) from None


def area_of(invariant_id: str) -> Area:
    get(invariant_id)
    return _AREA_OF[invariant_id]


def scenario_of(invariant_id: str) -> AreaScenario:
    """The area scenario that observes what ``invariant_id`` checks."""
    inv = get(invariant_id)
    return _AREA_OF[inv.id].scenario(inv.scenario)


def select(names: list[str] | None = None) -> list[Invariant]:
    """Invariants by ID, group (wrap, frozen, ...) or area (autowrap, ...);
    none named: all. An unknown name raises UnknownInvariant."""
    if not names:
        return list(CATALOG.values())
    out: list[Invariant] = []
    for name in names:
        hits = [inv for inv in CATALOG.values() if name in (inv.id, inv.group, inv.area)]
        if not hits:
            raise UnknownInvariant(name, [*CATALOG, *{i.group for i in CATALOG.values()}, *(a.name for a in AREAS)])
        out += [h for h in hits if h not in out]
    return out


def areas_of_case(case) -> list[Area]:
    """The areas whose cases ``case`` is (a checkpoint case: checkpoint)."""
    return [a for a in AREAS if a.applies(case)]


__all__ = ["AREAS", "CATALOG", "Area", "AreaScenario", "Invariant", "UnknownInvariant", "area_of", "areas_of_case", "get",
           "scenario_of", "select"]


def invariant_table() -> str:
    """The README's invariant table, one section per area (Markdown): made
    from AREAS, checked against the README by a test (tests/self/test_readme.py)."""
    lines = []
    for area in AREAS:
        lines += [f"**{area.name}**: {area.title}", "", "| ID | API | statement | spec source |", "| --- | --- | --- | --- |"]
        for inv in area.invariants:
            cells = [inv.id, inv.api.replace("|", ", "), inv.statement, inv.source]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
