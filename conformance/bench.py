"""Benchmark of the fake-tier FSDP1 checks: examples per second, and the share
of time spent inside FSDP's own wrapping. Figures, not timed tests."""

from __future__ import annotations

import time

from hypothesis import HealthCheck, Phase, given, settings

from conformance.invariants import CATALOG
from conformance.known import load
from conformance.runner import evaluate, observations
from conformance.spec import walk


def draw_specs(n: int, seed: int, max_modules: int = 24) -> tuple[list, float]:
    """n CaseSpecs from the suite's strategy, and the seconds drawing took."""
    from strategies import case_specs

    out: list = []

    @settings(max_examples=n, database=None, phases=[Phase.generate], deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(spec=case_specs(max_modules=max_modules))
    def collect(spec):
        out.append(spec)

    t0 = time.perf_counter()
    collect()
    return out, time.perf_counter() - t0


def bench_fake(examples: int = 500, world_size: int = 4, seed: int = 0) -> dict:
    from conformance.engine.fake import FakeEngine

    specs, draw_s = draw_specs(examples, seed)
    engine = FakeEngine(world_size=world_size)
    known = load()
    fsdp1 = [i for i in CATALOG.values() if i.api == "fsdp1"]
    wrap_s = observe_s = check_s = 0.0
    for spec in specs:  # warm-up of imports and caches
        observations(engine, spec)
        break
    t_all = time.perf_counter()
    for spec in specs:
        t0 = time.perf_counter()
        obs = observations(engine, spec)
        t1 = time.perf_counter()
        for inv in fsdp1:
            evaluate(inv.id, spec, obs, known)
        check_s += time.perf_counter() - t1
        observe_s += t1 - t0
        wrap_s += obs[0].wrap_seconds
    total = time.perf_counter() - t_all
    engine.close()
    n = len(specs)
    sizes = [sum(1 for _ in walk(s.tree)) for s in specs]
    res = {
        "examples": n,
        "modules_mean": sum(sizes) / n,
        "modules_max": max(sizes),
        "examples_per_s": n / total,
        "examples_per_s_with_drawing": n / (total + draw_s),
        "fsdp_wrap_share": wrap_s / total,
        "suite_overhead_share": 1 - wrap_s / total,
        "draw_ms": 1000 * draw_s / n,
        "observe_ms": 1000 * observe_s / n,
        "wrap_ms": 1000 * wrap_s / n,
        "check_ms": 1000 * check_s / n,
    }
    print(f"fake tier, FSDP1, world size {world_size}: {n} examples, trees of {res['modules_mean']:.1f} modules on average (max {res['modules_max']})")
    print(f"  {res['examples_per_s']:.0f} examples/s checking all {len(fsdp1)} FSDP1 invariants per example "
          f"({res['examples_per_s_with_drawing']:.0f}/s counting Hypothesis drawing)")
    print(f"  per example: draw {res['draw_ms']:.2f} ms, observe {res['observe_ms']:.2f} ms "
          f"(inside FSDP's constructor {res['wrap_ms']:.2f} ms), oracle+checks {res['check_ms']:.2f} ms")
    print(f"  share inside FSDP wrapping: {100 * res['fsdp_wrap_share']:.0f}%; suite overhead {100 * res['suite_overhead_share']:.0f}%")
    return res
