"""Checkpoint round trips on rank pools of several world sizes: the per-example
cost of a save / reshard / load (CKPT-RESHARD and OPTIM-STATE checked on it)
next to the time the ranks spend inside torch.distributed.checkpoint
(get_state_dict + dcp.save, get_state_dict + dcp.load + set_state_dict) and
inside FSDP (wrapping, training steps) (``fsdp-conformance bench --api checkpoint``).
"""

from __future__ import annotations

import time

from conformance.run.bench import draw


def bench(examples: int = 30, world_size: int = 2, seed: int = 0) -> dict:
    from conformance.engine.pool import RankPool
    from conformance.engine.worlds import Worlds
    from conformance.areas import scenario_of
    from conformance.run.runner import evaluate, observations
    from strategies.checkpoint import checkpoint_specs

    specs = draw(checkpoint_specs("reshard"), examples, seed)
    h = scenario_of("CKPT-RESHARD")
    out: dict = {"world_size": world_size, "examples": len(specs)}
    with RankPool(world_size, "gloo", 120.0) as pool:
        pool.tier = "gloo"
        worlds = Worlds(pool, deadline=60.0)
        try:
            for w in (1, 2, 3):  # start every world before timing
                worlds.engine(w)
            observations(worlds, specs[0], h.name, h.observation.from_dict)  # warm-up (lazy imports)
            wall = dcp = fsdp = 0.0
            phases: dict = {}
            for spec in specs:
                ck = spec.ckpt
                key = f"{ck.save_world}->{ck.load_world}"
                t0 = time.perf_counter()
                obs = observations(worlds, spec, h.name, h.observation.from_dict)
                for inv in ("CKPT-RESHARD", "OPTIM-STATE"):
                    evaluate(inv, spec, obs)
                dt = time.perf_counter() - t0
                wall += dt
                load = dict(obs[0].seconds)
                save = dict((obs[0].save or {}).get("seconds") or ())
                dcp += load.get("dcp", 0.0) + save.get("dcp", 0.0)
                fsdp += load.get("fsdp", 0.0) + save.get("fsdp", 0.0)
                phases.setdefault(key, []).append(dt)
        finally:
            worlds.close()
    n = len(specs)
    out.update(
        wall_ms_per_example=1000 * wall / n,
        dcp_ms_per_example=1000 * dcp / n,
        fsdp_ms_per_example=1000 * fsdp / n,
        by_worlds={k: {"examples": len(v), "wall_ms_per_example": 1000 * sum(v) / len(v)} for k, v in sorted(phases.items())},
    )
    return out


def show(res: dict) -> None:
    print(f"checkpoint round trips (save, reshard, load; CKPT-RESHARD and OPTIM-STATE checked), {res['examples']} drawn examples, worlds 1 (driver), 2, 3 (pools)")
    print(f"  {1000 / res['wall_ms_per_example']:6.1f} examples/s, {res['wall_ms_per_example']:7.1f} ms/example in the driver, "
          f"{res['dcp_ms_per_example']:7.1f} ms inside torch.distributed.checkpoint (rank 0: state-dict API, save, load), "
          f"{res['fsdp_ms_per_example']:7.1f} ms inside FSDP (wrap, training steps)")
    for k, r in res["by_worlds"].items():
        print(f"    save on {k.split('->')[0]} ranks, load on {k.split('->')[1]}: {r['examples']:3d} examples, {r['wall_ms_per_example']:7.1f} ms/example")
