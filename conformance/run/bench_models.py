"""A real model (a Target) per FSDP API: examples per second of the checks on
drawn model cases next to the time inside FSDP (``fsdp-conformance bench
--target package.module:attr``). FSDP1 on the fake tier (its auto-wrap
invariants), FSDP2 on the gloo pool (FSDP2-* and FWD-*, the target's
generate-like methods included)."""

from __future__ import annotations

import time

from conformance.run.bench import draw


def bench(target: str, examples: int = 20, world_size: int = 2, fake_world_size: int = 4, seed: int = 0,
          apis=("fsdp1", "fsdp2")) -> dict:
    """Per API of ``apis`` (fsdp1, fsdp2; --api): examples/s of drawn model
    cases next to the time inside FSDP."""
    from hypothesis import strategies as st

    from conformance.engine.fake import FakeEngine
    from conformance.engine.pool import RankPool
    from conformance.areas import CATALOG
    from conformance.areas import scenario_of
    from conformance.run.runner import evaluate, observations
    from conformance.case.target import check_target
    from strategies.targets import model_cases

    from conformance.run.known import load

    check_target(target)
    known = load()
    out: dict = {"target": target, "examples": examples, "apis": {}}
    runs = {
        "fsdp1": ("fake", fake_world_size, "WRAP-UNITS", [i for i, v in CATALOG.items() if v.scenario in ("fsdp1-structure", "fsdp1")]),
        "fsdp2": ("gloo", world_size, "FWD-PARITY", [i for i, v in CATALOG.items() if v.scenario == "fsdp2"]),
    }
    runs = {api: r for api, r in runs.items() if api in apis}
    if not runs:
        from conformance.run.bench import BenchError

        raise BenchError(f"a model is measured per API fsdp1 / fsdp2, not {', '.join(apis)}")
    for api, (tier, ws, inv, same) in runs.items():
        cases = draw(model_cases(target, apis=st.just(api)), examples, seed)
        engine = FakeEngine(world_size=ws) if tier == "fake" else RankPool(ws, "gloo", 300.0)
        try:
            wall = inside = fsdp = 0.0
            scenarios = sorted({scenario_of(i).name for i in same})
            for sc in scenarios:  # warm-up: lazy imports, the first build
                observations(engine, cases[0], sc, scenario_of(next(i for i in same if scenario_of(i).name == sc)).observation.from_dict)
            for case in cases:
                t0 = time.perf_counter()
                for sc in scenarios:
                    h = scenario_of(next(i for i in same if scenario_of(i).name == sc))
                    recs = engine.run(sc, case)
                    obs = [h.observation.from_dict(r["value"]) for r in recs]
                    for i in same:
                        if scenario_of(i).name == sc:
                            evaluate(i, case, obs, known)
                    inside += max(r["seconds"] for r in recs)
                    fsdp += max(_fsdp_seconds(o) for o in obs)
                wall += time.perf_counter() - t0
        finally:
            engine.close()
        n = len(cases)
        out["apis"][api] = {
            "tier": tier, "world_size": ws, "examples": n, "invariants": len(same),
            "examples_per_s": n / wall, "wall_ms_per_example": 1000 * wall / n,
            "rank_scenario_ms_per_example": 1000 * inside / n, "fsdp_ms_per_example": 1000 * fsdp / n,
            "fsdp_share_of_wall": fsdp / wall,
        }
    return out


def _fsdp_seconds(obs) -> float:
    """Time inside FSDP: FSDP1's constructor and state_dict(); FSDP2's
    fully_shard, registration and the calls."""
    if hasattr(obs, "wrap_seconds"):
        return obs.wrap_seconds + obs.state_dict_seconds
    return obs.seconds


def show(res: dict) -> None:
    print(f"target {res['target']}: {res['examples']} drawn model cases per API")
    for api, r in res["apis"].items():
        print(f"  {api} ({r['tier']}, W={r['world_size']}, {r['invariants']} invariants): {r['examples_per_s']:6.2f} examples/s, "
              f"{r['wall_ms_per_example']:8.1f} ms/example in the driver, {r['rank_scenario_ms_per_example']:8.1f} ms in the rank's scenarios, "
              f"{r['fsdp_ms_per_example']:8.1f} ms of it inside FSDP ({100 * r['fsdp_share_of_wall']:.0f}% of wall)")
