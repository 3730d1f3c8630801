"""Per-example cost of the FSDP2, forward-method and training scenarios on the
rank pool, next to the bare FSDP2 work inside the ranks.

    python -m conformance.bench_fsdp2 [--examples N] [--world-size W]

For each scenario: the driver's wall time per example (oracle and checks
included), the slowest rank's time inside the scenario function, and inside
that the time the adapter spends in fully_shard, registration and the calls
(FSDP2 and the method bodies, without the reference model and the checks).
"""

from __future__ import annotations

import argparse
import json
import time

from hypothesis import HealthCheck, Phase, given, settings


def draw(strategy, n: int) -> list:
    out: list = []

    @settings(max_examples=n, database=None, phases=[Phase.generate], deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(spec):
        out.append(spec)

    collect()
    return out


def bench(examples: int = 100, world_size: int = 2) -> dict:
    from conformance.engine.pool import RankPool
    from conformance.invariants import CATALOG
    from conformance.runner import evaluate, handler, observations
    from strategies.methods import fsdp2_case_specs, summon_specs, training_specs

    cases = {
        "fsdp2 (FSDP2-* and FWD-*)": ("FWD-PARITY", draw(fsdp2_case_specs(), examples)),
        "fsdp2 without methods": ("FSDP2-GROUPS", draw(fsdp2_case_specs(methods=False), examples)),
        "fsdp1-methods (FWD-SUMMON)": ("FWD-SUMMON", draw(summon_specs(), examples)),
        "train fsdp2 (PARITY)": ("PARITY", draw(training_specs(api="fsdp2"), examples)),
        "train fsdp1 (PARITY)": ("PARITY", draw(training_specs(api="fsdp1"), examples)),
    }
    out: dict = {"world_size": world_size, "examples": examples, "scenarios": {}}
    with RankPool(world_size, "gloo", 120.0) as pool:
        for label, (inv, specs) in cases.items():
            h = handler(inv)
            same = [i for i, v in CATALOG.items() if v.scenario == h.scenario]
            observations(pool, specs[0], h.scenario, h.parse)  # warm-up (lazy imports)
            wall = inside = fsdp = 0.0
            for spec in specs:
                t0 = time.perf_counter()
                recs = pool.run(h.scenario, spec)
                obs = [h.parse(r["value"]) for r in recs]
                for i in same:
                    evaluate(i, spec, obs)
                wall += time.perf_counter() - t0
                inside += max(r["seconds"] for r in recs)
                fsdp += max(o.seconds for o in obs)
            n = len(specs)
            out["scenarios"][label] = {
                "examples": n,
                "invariants_per_example": len(same),
                "wall_ms_per_example": 1000 * wall / n,
                "rank_scenario_ms_per_example": 1000 * inside / n,
                "fsdp_work_ms_per_example": 1000 * fsdp / n,
                "fsdp_share_of_wall": fsdp / wall,
            }
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m conformance.bench_fsdp2", description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=100)
    p.add_argument("--world-size", type=int, default=2)
    a = p.parse_args(argv)
    res = bench(a.examples, a.world_size)
    print(json.dumps(res, indent=2))
    for label, r in res["scenarios"].items():
        print(f"{label:<28} {r['wall_ms_per_example']:7.1f} ms/example in the driver "
              f"({r['invariants_per_example']} invariants), {r['rank_scenario_ms_per_example']:7.1f} ms in the rank's scenario, "
              f"{r['fsdp_work_ms_per_example']:7.1f} ms of it FSDP work ({100 * r['fsdp_share_of_wall']:.0f}% of wall)")


if __name__ == "__main__":
    main()
