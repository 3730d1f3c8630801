"""FSDP2 (with the forward-method and training scenarios) on the rank pool:
per-example cost next to the bare FSDP2 work inside the ranks
(``fsdp-conformance bench --api fsdp2``).

For each scenario: the driver's wall time per example (oracle and checks
included), the slowest rank's time inside the scenario function, and inside
that the time the adapter spends in fully_shard, registration and the calls
(FSDP2 and the method bodies, without the reference model and the checks).
"""

from __future__ import annotations

import time

from conformance.run.bench import draw


def bench(examples: int = 100, world_size: int = 2, seed: int = 0) -> dict:
    from conformance.engine.pool import RankPool
    from conformance.areas import CATALOG
    from conformance.areas import scenario_of
    from conformance.run.runner import evaluate, observations
    from strategies.methods import fsdp2_case_specs, summon_specs, training_specs

    cases = {
        "fsdp2 (FSDP2-* and FWD-*)": ("FWD-PARITY", draw(fsdp2_case_specs(), examples, seed)),
        "fsdp2 without methods": ("FSDP2-GROUPS", draw(fsdp2_case_specs(methods=False), examples, seed)),
        "fsdp1-methods (FWD-SUMMON)": ("FWD-SUMMON", draw(summon_specs(), examples, seed)),
        "train fsdp2 (PARITY)": ("PARITY", draw(training_specs(api="fsdp2"), examples, seed)),
        "train fsdp1 (PARITY)": ("PARITY", draw(training_specs(api="fsdp1"), examples, seed)),
    }
    out: dict = {"world_size": world_size, "examples": examples, "scenarios": {}}
    with RankPool(world_size, "gloo", 120.0) as pool:
        for label, (inv, specs) in cases.items():
            h = scenario_of(inv)
            same = [i for i, v in CATALOG.items() if v.scenario == h.name]
            observations(pool, specs[0], h.name, h.observation.from_dict)  # warm-up (lazy imports)
            wall = inside = fsdp = 0.0
            for spec in specs:
                t0 = time.perf_counter()
                recs = pool.run(h.name, spec)
                obs = [h.observation.from_dict(r["value"]) for r in recs]
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


def show(res: dict) -> None:
    print(f"gloo pool, FSDP2 / forward methods / training, world size {res['world_size']}: {res['examples']} drawn examples per scenario")
    for label, r in res["scenarios"].items():
        print(f"  {label:<28} {1000 / r['wall_ms_per_example']:6.1f} examples/s, {r['wall_ms_per_example']:7.1f} ms/example in the driver "
              f"({r['invariants_per_example']} invariants), {r['rank_scenario_ms_per_example']:7.1f} ms in the rank's scenario, "
              f"{r['fsdp_work_ms_per_example']:7.1f} ms of it FSDP work ({100 * r['fsdp_share_of_wall']:.0f}% of wall)")
