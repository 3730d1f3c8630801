"""``fsdp-conformance bench``: the one way to measure the suite's speed, as
figures from one run (never timed tests). It measures what users run: each
area's conformance tests on each tier, through the same session code as
``fsdp-conformance run`` (one pytest process per area and tier, start-up,
drawing and known-failure matching included), with a plugin that records
where each example's time went (conformance.run.bench_plugin). Figures:
examples/s, FSDP's share of the wall time, the suite's own share (drawing
included), the pool's overhead; ``--engines`` adds the pool against
spawn-per-example and the fake tier on the same cases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from conformance import paths
from conformance.engine import bench as engine_bench
from conformance.engine.errors import BenchError

TIERS = ("fake", "gloo")
# examples per test when --examples is not given: the ci profile's budgets
# scaled down to a few seconds per area and tier
DEFAULT_EXAMPLES = 60
DEFAULT_ENGINE_EXAMPLES = 200


def _pytest_args(area, tier: str, examples: int, world_size: int, fake_world_size: int, seed: int, report_dir: Path,
                 targets: tuple[str, ...]) -> list[str]:
    suite = str(paths.SUITE)
    module = "test_models.py" if targets else f"{area.suite_module}.py"
    args = [str(paths.SUITE / module), f"--rootdir={suite}", "-c", os.devnull, f"--confcutdir={suite}", "-p", "no:cacheprovider",
            "-p", "no:xdist", "-p", "conformance.run.bench_plugin", "-q", "--disable-warnings",
            "--conformance-profile=ci", f"--max-examples={examples}", f"--hypothesis-seed={seed}", f"--tiers={tier}",
            f"--world-size={world_size}", f"--fake-world-size={fake_world_size}", f"--report-dir={report_dir}", "--report=never"]
    args += [f"--target={t}" for t in targets]
    if targets:  # only the invariants of this area on the model
        args += [f"--invariant={area.name}"]
    return args


def measure(area, tier: str, *, examples: int, world_size: int = 2, fake_world_size: int = 4, seed: int = 0,
            targets: tuple[str, ...] = ()) -> dict:
    """One area's tests on one tier in a fresh pytest process; its figures."""
    with tempfile.TemporaryDirectory(prefix="fsdp-conformance-bench-") as tmp:
        out = Path(tmp) / "timings.json"
        env = {**os.environ, "FSDP_CONFORMANCE_BENCH_OUT": str(out)}
        cmd = [sys.executable, "-m", "pytest", *_pytest_args(area, tier, examples, world_size, fake_world_size, seed, Path(tmp) / "report", targets)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t0
        if not out.exists():
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
            raise BenchError(f"{area.name} on {tier}: pytest wrote no timings (exit {proc.returncode}): {' | '.join(tail)}")
        data = json.loads(out.read_text())
    return {"area": area.name, "tier": tier, **summarize(data, wall, tier), "pytest_exit_status": proc.returncode}


def summarize(data: dict, wall: float, tier: str) -> dict:
    """The figures of one bench process: ``data`` is what the bench plugin
    wrote (per test its wall time, per scenario run its timings, the pools
    started inside it), ``wall`` the process's wall time."""
    timings = [t for test in data["tests"] for t in test["timings"]]
    # pools started inside a test (a Worlds pool of another world size, a
    # rebuild after a hang or crash) are start-up, as the base pool's start
    # before the first test is: not the pool's per-example overhead
    pool_starts = sum(s[1] for test in data["tests"] for s in test.get("pool_starts", []))
    tests_wall = sum(test["wall"] for test in data["tests"]) - pool_starts
    n = len(timings)
    # examples without observations (HANG, CRASH: a recorded finding's hang
    # waits for its deadline; ERROR: a rank raised): their wait is the
    # engine's; the pool's overhead is that of the examples that gave records
    failed = [t for t in timings if t.get("failed")]
    failed_seconds = sum(t["engine"] for t in failed)
    fsdp = sum(t["fsdp"] for t in timings)
    engine = sum(t["engine"] for t in timings) - pool_starts
    in_rank = sum(t["in_rank"] for t in timings)
    check = sum(t["check"] for t in timings)
    overhead = sum(t["engine"] - t["in_rank"] for t in timings if not t.get("failed")) - pool_starts
    return {
        "examples": n, "tests": len(data["tests"]),
        "wall_seconds": wall, "tests_seconds": tests_wall, "startup_seconds": wall - tests_wall, "pool_start_seconds": pool_starts,
        "examples_per_s": n / wall if wall else 0.0, "examples_per_s_without_startup": n / tests_wall if tests_wall else 0.0,
        "fsdp_seconds": fsdp, "fsdp_share": fsdp / wall if wall else 0.0, "fsdp_share_without_startup": fsdp / tests_wall if tests_wall else 0.0,
        # everything in the tests that is not FSDP's own work: drawing, building, the oracle, the checks
        "suite_share_without_startup": 1 - fsdp / tests_wall if tests_wall else 0.0,
        "drawing_and_hypothesis_seconds": tests_wall - engine - check,
        "engine_seconds": engine, "in_rank_seconds": in_rank, "check_seconds": check,
        "failed_examples": len(failed), "failed_seconds": failed_seconds,
        # the driver's wait for the ranks less their time inside the scenario
        "pool_overhead_seconds": overhead if tier != "fake" else 0.0,
        "pool_overhead_of_fsdp": overhead / fsdp if tier != "fake" and fsdp else 0.0,
    }


def run(areas: list[str] | None = None, *, tiers: tuple[str, ...] = TIERS, engines: bool = False, examples: int | None = None,
        world_size: int = 2, fake_world_size: int = 4, seed: int = 0, json_path: str | None = None, targets=(), out=print) -> dict:
    """The figures of each area (default all) on each tier, printed as the
    run goes and returned (and written as JSON to ``json_path``); ``targets``:
    the same on real models (test_models.py) instead of drawn trees."""
    # torch and the areas: the CLI reads this module's defaults without them
    from conformance.areas import AREAS

    chosen = [a for a in AREAS if not areas or a.name in areas]
    results: dict = {"examples_per_test": examples or DEFAULT_EXAMPLES, "seed": seed, "rows": []}
    for area in chosen:
        if targets and area.model_cases:
            out(f"{area.name}: not measured on a model ({area.model_cases})")
            continue
        for tier in tiers:
            if tier == "fake" and area.needs_ranks:
                continue
            row = measure(area, tier, examples=examples or DEFAULT_EXAMPLES, world_size=world_size, fake_world_size=fake_world_size,
                          seed=seed, targets=tuple(targets))
            results["rows"].append(row)
            out(format_row(row))
    if engines:
        specs = engine_bench.default_specs(examples or DEFAULT_ENGINE_EXAMPLES)
        results["engines"] = engine_bench.bench_engines(specs, world_size)
        engine_bench.show(results["engines"], out)
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1) + "\n")
    return results


def format_row(r: dict) -> str:
    pools = f", {r['pool_start_seconds']:.1f}s of it starting pools in tests" if r.get("pool_start_seconds") else ""
    head = f"{r['area']:<12} {r['tier']:<5} {r['examples']:5d} examples in {r['wall_seconds']:6.1f}s ({r['startup_seconds']:.1f}s start-up{pools})"
    rates = f"{r['examples_per_s']:7.1f}/s ({r['examples_per_s_without_startup']:.1f}/s after start-up)"
    share = f"FSDP {100 * r['fsdp_share']:4.1f}% of wall ({100 * r['fsdp_share_without_startup']:.1f}% after start-up)"
    pool = f", pool overhead {100 * r['pool_overhead_of_fsdp']:.0f}% of FSDP" if r["tier"] != "fake" else ""
    if r.get("failed_examples"):  # HANG / CRASH / ERROR (a recorded finding's hang waits for its deadline)
        pool += f"; {r['failed_examples']} examples HANG, CRASH or ERROR, {r['failed_seconds']:.1f}s waiting for them"
    failed = ""
    if r.get("pytest_exit_status", 0) != 0:
        # a failing example is shrunk: hundreds of extra examples, and figures that are not the run's
        failed = (f"\n  FAILED: pytest exited {r['pytest_exit_status']}: a test failed, and these figures include Hypothesis"
                  f" shrinking it (see `fsdp-conformance run --invariant {r['area']}` with the same seed)")
    return f"{head}  {rates}  {share}{pool}{failed}"


def failed_rows(results: dict) -> list[dict]:
    """The rows whose pytest run failed (their figures are not the run's)."""
    return [r for r in results["rows"] if r.get("pytest_exit_status", 0) != 0]
