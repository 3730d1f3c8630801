"""``fsdp-conformance bench``: the one way to measure the suite's speed, as
printed figures (never timed tests). One module per FSDP API (fsdp1: the
fake tier's auto-wrap checks; fsdp2: FSDP2, forward methods and training on
the gloo pool) and the engines compared on the same cases (engines)."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, seed as hseed, settings

APIS = ("fsdp1", "fsdp2", "checkpoint")


class BenchError(RuntimeError):
    """A measurement that could not complete (a rank failed or timed out)."""


# examples per API when --examples is not given: a few seconds each
DEFAULT_EXAMPLES = {"fsdp1": 500, "fsdp2": 100, "checkpoint": 30, "engines": 200, "models": 20}


def draw(strategy, n: int, seed: int = 0) -> list:
    """``n`` values of ``strategy``, the same ones for the same seed."""
    out: list = []

    @hseed(seed)
    @settings(max_examples=n, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(value):
        out.append(value)

    collect()
    return out


def run(apis=APIS, *, engines: bool = False, examples: int | None = None, world_size: int = 2,
        fake_world_size: int = 4, seed: int = 0, json_path: str | None = None, targets=()) -> dict:
    """Run the benchmarks of ``apis`` (and the engines), print their figures,
    return them (and write them as JSON to ``json_path``). ``targets``: real
    models ("package.module:attr") instead, each per API (conformance.run.bench_models)."""
    results: dict = {}
    if targets:
        from conformance.run import bench_models as models

        for t in targets:
            results[t] = models.bench(t, examples or DEFAULT_EXAMPLES["models"], world_size, fake_world_size, seed, apis=apis)
            models.show(results[t])
        if json_path:
            Path(json_path).write_text(json.dumps(results, indent=1) + "\n")
        return results
    if "fsdp1" in apis:
        from conformance.areas.autowrap import bench as fsdp1

        results["fsdp1"] = fsdp1.bench(examples or DEFAULT_EXAMPLES["fsdp1"], fake_world_size, seed)
        fsdp1.show(results["fsdp1"])
    if "fsdp2" in apis:
        from conformance.areas.fully_shard import bench as fsdp2

        results["fsdp2"] = fsdp2.bench(examples or DEFAULT_EXAMPLES["fsdp2"], world_size, seed)
        fsdp2.show(results["fsdp2"])
    if "checkpoint" in apis:  # lifecycle: save / reshard / load round trips
        from conformance.areas.checkpoint import bench as checkpoint

        results["checkpoint"] = checkpoint.bench(examples or DEFAULT_EXAMPLES["checkpoint"], world_size, seed)
        checkpoint.show(results["checkpoint"])
    if engines:
        from conformance.engine import bench as eng

        results["engines"] = eng.bench_engines(eng.default_specs(examples or DEFAULT_EXAMPLES["engines"]), world_size)
        eng.show(results["engines"])
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1) + "\n")
    return results
