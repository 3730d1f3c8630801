"""FSDP1 on the fake tier: examples per second of the auto-wrap checks, and the
share of time spent inside FSDP's own wrapping (``fsdp-conformance bench --api fsdp1``)."""

from __future__ import annotations

import time

from conformance.run.bench import draw
from conformance.areas import CATALOG
from conformance.run.known import load
from conformance.run.runner import evaluate, observations
from conformance.case.tree import walk


def _measure(engine, specs, scenario: str, invariants: list, known) -> dict:
    fsdp_s = observe_s = check_s = 0.0
    observations(engine, specs[0], scenario)  # warm-up of imports and caches
    t_all = time.perf_counter()
    for spec in specs:
        t0 = time.perf_counter()
        obs = observations(engine, spec, scenario)
        t1 = time.perf_counter()
        for inv in invariants:
            evaluate(inv.id, spec, obs, known)
        check_s += time.perf_counter() - t1
        observe_s += t1 - t0
        fsdp_s += obs[0].wrap_seconds + obs[0].state_dict_seconds
    total = time.perf_counter() - t_all
    n = len(specs)
    return {
        "examples_per_s": n / total,
        "total_s": total,
        "fsdp_share": fsdp_s / total,
        "observe_ms": 1000 * observe_s / n,
        "fsdp_ms": 1000 * fsdp_s / n,
        "check_ms": 1000 * check_s / n,
    }


def bench(examples: int = 500, world_size: int = 4, seed: int = 0) -> dict:
    """Both FSDP1 scenarios on the same drawn cases: structure (what 8 of the
    9 FSDP1 invariants read) and full (with state_dict(), for WRAP-STATE-DICT).
    Time inside FSDP = its constructor, plus state_dict() in the full one."""
    from conformance.engine.fake import FakeEngine
    from strategies import case_specs

    t0 = time.perf_counter()
    specs = draw(case_specs(max_modules=24), examples, seed)
    draw_s = time.perf_counter() - t0
    engine = FakeEngine(world_size=world_size)
    known = load()
    # the auto-wrap invariants (FWD-SUMMON and PARITY observe other scenarios)
    fsdp1 = [i for i in CATALOG.values() if i.scenario in ("fsdp1", "fsdp1-structure")]
    structural = [i for i in fsdp1 if i.scenario == "fsdp1-structure"]
    res = {
        "structure": _measure(engine, specs, "fsdp1-structure", structural, known),
        "full": _measure(engine, specs, "fsdp1", fsdp1, known),
    }
    res["structure"]["invariants"] = len(structural)
    res["full"]["invariants"] = len(fsdp1)
    engine.close()
    n = len(specs)
    sizes = [sum(1 for _ in walk(s.tree)) for s in specs]
    res.update(examples=n, world_size=world_size, modules_mean=sum(sizes) / n, modules_max=max(sizes),
               draw_ms=1000 * draw_s / n, draw_s=draw_s)
    return res


def show(res: dict) -> None:
    n = res["examples"]
    print(f"fake tier, FSDP1, world size {res['world_size']}: {n} drawn examples, trees of {res['modules_mean']:.1f} modules on average (max {res['modules_max']})")
    print(f"  drawing (Hypothesis): {res['draw_ms']:.2f} ms per example")
    for name, label in (("structure", "structure scenario"), ("full", "full scenario (+state_dict)")):
        r = res[name]
        with_draw = n / (r["total_s"] + res["draw_s"])
        print(f"  {label}: {r['examples_per_s']:.0f} examples/s checking {r['invariants']} invariants each ({with_draw:.0f}/s counting drawing); "
              f"per example observe {r['observe_ms']:.2f} ms (inside FSDP {r['fsdp_ms']:.2f} ms), oracle+checks {r['check_ms']:.2f} ms; "
              f"inside FSDP {100 * r['fsdp_share']:.0f}%, suite overhead {100 * (1 - r['fsdp_share']):.0f}%")
