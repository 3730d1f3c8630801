"""Engine throughput on the same specs: spawn-per-example, the pool, the fake
tier (``fsdp-conformance bench --engines``)."""

from __future__ import annotations

import json
import multiprocessing
import os
import tempfile
import time
from typing import Sequence

from conformance.case.examples import lora_model
from conformance.case.spec import CaseSpec
from conformance.engine.errors import BenchError
from conformance.engine.fake import FakeEngine
from conformance.engine.pool import RankPool
from conformance.engine.scenarios import run_scenario


def default_specs(n: int) -> list[CaseSpec]:
    """``n`` hand-written cases: LoraModel variants (source 000)."""

    return [
        lora_model(num_layers=1 + i % 3, use_orig_params=bool(i % 2), seed=i)
        for i in range(n)
    ]


def _check(records: list[dict], engine: str) -> None:
    bad = [r for r in records if not r.get("ok")]
    if bad:
        err = bad[0]["error"]
        raise BenchError(f"{engine}: rank {bad[0]['rank']} raised {err['type']}: {err['message']}")


def _spawned_rank(rank: int, world_size: int, store: str, scenario: str, spec_json: str, conn) -> None:
    import torch.distributed as dist


    dist.init_process_group("gloo", store=dist.FileStore(store, world_size), rank=rank, world_size=world_size)
    record = run_scenario(scenario, spec_json, rank=rank)
    dist.barrier()
    dist.destroy_process_group()
    conn.send(json.dumps(record))
    conn.close()
    os._exit(0)


def spawn_example(scenario: str, spec: CaseSpec, world_size: int = 2, deadline: float = 120.0) -> list[dict]:
    """One example on a fresh group of ``world_size`` spawned processes (the
    baseline the pool replaces: multiprocessing spawn, one group per test)."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="fsdp-conformance-spawn-") as tmp:
        pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
        procs = [
            ctx.Process(target=_spawned_rank, args=(r, world_size, os.path.join(tmp, "store"), scenario,
                                                    spec.to_json(), pipes[r][1]), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            records = []
            for r, (recv, _) in enumerate(pipes):
                if not recv.poll(deadline):
                    raise BenchError(f"spawn-per-example: rank {r} gave no result in {deadline:g}s")
                records.append(json.loads(recv.recv()))
            for p in procs:
                p.join(deadline)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
    return records


def bench_engines(
    specs: Sequence[CaseSpec],
    world_size: int = 2,
    *,
    scenario: str | None = None,
    spawn_examples: int = 3,
    deadline: float = 120.0,
) -> dict:
    """Examples per second of each engine on ``specs`` (spawn-per-example on
    the first ``spawn_examples`` only: each costs seconds), their ratios, and
    the pool's overhead: driver wall time per example less the slowest rank's
    time inside the scenario function. Pool startup and one warm-up example
    (lazy imports) are timed apart, as is the fake tier's warm-up."""
    if not specs:
        raise ValueError("bench_engines needs at least one spec")
    scenario = scenario or "fsdp1"

    # (a) a fresh W-process gloo group per example, as MultiProcessTestCase does
    spawn_specs = list(specs[: max(1, spawn_examples)])
    t0 = time.perf_counter()
    for spec in spawn_specs:
        _check(spawn_example(scenario, spec, world_size, deadline), "spawn-per-example")
    spawn_s = time.perf_counter() - t0

    # (b) the pool
    t0 = time.perf_counter()
    with RankPool(world_size, "gloo", deadline) as pool:
        startup_s = time.perf_counter() - t0
        _check(pool.run(scenario, specs[0]), "pool")  # warm-up
        inside = 0.0
        t0 = time.perf_counter()
        for spec in specs:
            records = pool.run(scenario, spec)
            _check(records, "pool")
            inside += max(r["seconds"] for r in records)
        pool_s = time.perf_counter() - t0

    # (c) the fake tier, in this process
    with FakeEngine(world_size) as fake:
        _check(fake.run(scenario, specs[0]), "fake")  # warm-up
        fake_inside = 0.0
        t0 = time.perf_counter()
        for spec in specs:
            records = fake.run(scenario, spec)
            _check(records, "fake")
            fake_inside += records[0]["seconds"]
        fake_s = time.perf_counter() - t0

    n = len(specs)
    spawn_rate = len(spawn_specs) / spawn_s
    pool_rate = n / pool_s
    fake_rate = n / fake_s
    return {
        "scenario": scenario,
        "world_size": world_size,
        "spawn_per_example": {"examples": len(spawn_specs), "seconds": spawn_s, "examples_per_s": spawn_rate},
        "pool": {
            "examples": n,
            "seconds": pool_s,
            "examples_per_s": pool_rate,
            "ms_per_example": 1000 * pool_s / n,
            "startup_seconds": startup_s,
            "scenario_seconds": inside,
            "overhead_ms_per_example": 1000 * (pool_s - inside) / n,
            "overhead_fraction": (pool_s - inside) / pool_s,
        },
        "fake": {
            "examples": n,
            "seconds": fake_s,
            "examples_per_s": fake_rate,
            "ms_per_example": 1000 * fake_s / n,
            "scenario_seconds": fake_inside,
        },
        "ratios": {
            "pool_over_spawn": pool_rate / spawn_rate,
            "fake_over_pool": fake_rate / pool_rate,
            "fake_over_spawn": fake_rate / spawn_rate,
        },
    }


def show(res: dict, out=print) -> None:
    p, f, s = res["pool"], res["fake"], res["spawn_per_example"]
    out(f"engines, scenario {res['scenario']}, world size {res['world_size']}:")
    out(f"  spawn per example: {s['examples_per_s']:.2f} examples/s ({s['examples']} examples)")
    out(f"  gloo pool: {p['examples_per_s']:.1f} examples/s (startup {p['startup_seconds']:.1f} s, "
          f"overhead {p['overhead_ms_per_example']:.1f} ms per example, {100 * p['overhead_fraction']:.0f}%)")
    out(f"  fake tier: {f['examples_per_s']:.1f} examples/s")
    r = res["ratios"]
    out(f"  pool / spawn {r['pool_over_spawn']:.1f}x, fake / pool {r['fake_over_pool']:.1f}x")
