"""`fsdp-conformance bench`: each area's conformance tests as `run` runs them,
per tier, with where their time went (what it measures and prints, not how
fast: speed is measured by the bench, never by a test)."""

from __future__ import annotations

import pytest

from conformance.areas import AREAS
from conformance.run import bench

pytestmark = [pytest.mark.selfcheck, pytest.mark.fake]


def _consistent(row: dict) -> None:
    assert row["examples"] > 0 and row["tests"] > 0 and row["pytest_exit_status"] == 0
    assert 0 < row["tests_seconds"] <= row["wall_seconds"] and row["startup_seconds"] >= 0
    assert 0 < row["fsdp_seconds"] <= row["tests_seconds"]
    assert 0 < row["fsdp_share"] <= row["fsdp_share_without_startup"] <= 1
    assert abs(row["suite_share_without_startup"] + row["fsdp_share_without_startup"] - 1) < 1e-9


def test_bench_measures_an_area_on_the_fake_tier_through_the_suite(capsys):
    res = bench.run(["autowrap"], tiers=("fake",), examples=3)
    out = capsys.readouterr().out
    (row,) = res["rows"]
    assert (row["area"], row["tier"]) == ("autowrap", "fake")
    _consistent(row)
    # every autowrap test ran: its examples are each test's, the corpus cases of the area included
    assert row["tests"] == 5
    assert "autowrap" in out and "examples in" in out and "FSDP" in out


def test_bench_measures_the_pool_overhead_on_gloo():
    (row,) = bench.run(["summon"], tiers=("gloo",), examples=3)["rows"]
    _consistent(row)
    assert row["engine_seconds"] >= row["in_rank_seconds"] > 0
    assert row["pool_overhead_seconds"] == row["engine_seconds"] - row["in_rank_seconds"]


def test_bench_measures_a_real_model_and_names_the_areas_it_leaves_out(capsys):
    left_out = next(a for a in AREAS if a.model_cases and not a.needs_ranks)  # an area models do not reach (summon)
    res = bench.run(["autowrap", left_out.name], tiers=("fake",), examples=2, targets=["conformance.models.toy_target:target"])
    out = capsys.readouterr().out
    assert [r["area"] for r in res["rows"]] == ["autowrap"]
    _consistent(res["rows"][0])
    assert f"{left_out.name}: not measured on a model ({left_out.model_cases})" in out


def test_bench_skips_the_fake_tier_of_an_area_that_needs_ranks():
    assert bench.run(["parity"], tiers=("fake",), examples=1)["rows"] == []


def test_a_pool_started_inside_a_test_is_start_up_not_pool_overhead():
    """A Worlds pool of another world size starts inside the first example
    that needs it: its seconds count as start-up, not as the pool's
    per-example overhead (the HSDP and TP rows read 64-66% overhead)."""
    timing = {"engine": 11.0, "in_rank": 0.8, "fsdp": 0.5, "check": 0.1}  # a 10 s pool start in the first example
    data = {"tests": [{"wall": 12.0, "timings": [timing, {**timing, "engine": 1.0}], "pool_starts": [[4, 10.0]]}]}
    row = bench.summarize(data, wall=20.0, tier="gloo")
    assert row["pool_start_seconds"] == 10.0 and row["startup_seconds"] == 18.0 and row["tests_seconds"] == 2.0
    assert row["engine_seconds"] == 2.0 and row["pool_overhead_seconds"] == pytest.approx(0.4)
    assert row["pool_overhead_of_fsdp"] == pytest.approx(0.4)
    no_start = bench.summarize({"tests": [{**data["tests"][0], "pool_starts": []}]}, wall=20.0, tier="gloo")
    assert no_start["pool_overhead_seconds"] == pytest.approx(10.4)  # what the row said before


def test_a_row_whose_tests_failed_says_so():
    """A failing example is shrunk (the activation-checkpointing row ran 655
    examples for a budget of 30): the row must not read as the run's figures."""
    data = {"tests": [{"wall": 2.0, "timings": [{"engine": 1.0, "in_rank": 0.0, "fsdp": 0.5, "check": 0.1}]}]}
    ok = {"area": "activation_checkpointing", "tier": "fake", **bench.summarize(data, wall=3.0, tier="fake"), "pytest_exit_status": 0}
    bad = {**ok, "pytest_exit_status": 1}
    assert "FAILED" not in bench.format_row(ok) and "FAILED: pytest exited 1" in bench.format_row(bad)
    assert bench.failed_rows({"rows": [ok, bad]}) == [bad]


def test_reading_the_records_is_the_drivers_check_not_the_engines_time(monkeypatch):
    """The pool's overhead is what running the scenario in ranks adds: the
    engine's run() less the ranks' time in it. Reading the records as
    observations is the driver's own work, which the fake tier does the same
    way; counted in the engine's time it read as pool overhead (a fifth of
    autowrap's 1.28 ms an example). The engine and the parse move the
    runner's clock on (20 s and 50 s) instead of sleeping: a loaded
    machine's scheduling cannot blur the two."""
    import time
    import types

    from conformance.run import runner
    from conformance.run.runner import Timing, observations

    moved = [0.0]

    def advance(seconds):
        moved[0] += seconds

    monkeypatch.setattr(runner, "time", types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + moved[0]))

    class Engine:
        def run(self, scenario, spec):
            advance(20.0)
            return [{"rank": 0, "ok": True, "value": {}, "seconds": 0.01}]

    def slow_parse(value):
        advance(50.0)
        return value

    timing = Timing("echo")
    observations(Engine(), None, "echo", parse=slow_parse, timing=timing)
    assert 20.0 <= timing.engine < 50.0 and timing.in_rank == 0.01
    assert timing.check >= 50.0


def test_a_hung_example_is_the_engines_wait_not_drawing():
    """An example that HANGs (a recorded finding's hang waits for its
    deadline: fsdp2-tp-empty-piece-full-tensor-hang, 15 s a TP example on
    gloo) gave no Timing: `bench --area tp --tiers gloo --examples 40` put
    four hangs' 60 s under drawing and Hypothesis (61.4 of 70.8 s) and
    counted 36 examples of 40. It is an example, its wait is the engine's,
    and the pool's overhead leaves it out (no rank time of its is known)."""
    import time

    from conformance.engine.errors import RankHang
    from conformance.run.runner import ScenarioFailed, check_example
    from tests.self.cases import two_blocks

    class HangingEngine:
        def run(self, scenario, spec):
            time.sleep(0.05)
            raise RankHang(scenario=scenario, spec=spec, backend="gloo", world_size=2, deadline=0.05, elapsed=0.05, ranks=())

    timings: list = []
    with pytest.raises(RankHang):
        check_example(["WRAP-UNITS"], two_blocks(), HangingEngine(), known=[], timings=timings)
    (t,) = timings
    assert t.failed == "HANG" and t.engine >= 0.05 and t.in_rank == 0.0 and t.fsdp == 0.0

    class RaisingEngine:  # ERROR: a rank's scenario raised; its ranks' time is known
        def run(self, scenario, spec):
            return [{"rank": 0, "ok": False, "error": {"type": "RuntimeError", "message": "boom"}, "seconds": 0.03}]

    with pytest.raises(ScenarioFailed):
        check_example(["WRAP-UNITS"], two_blocks(), RaisingEngine(), known=[], timings=timings)
    assert timings[1].failed == "ERROR" and timings[1].in_rank == 0.03

    ok = {"engine": 1.0, "in_rank": 0.8, "fsdp": 0.5, "check": 0.1}
    hung = {"engine": 15.0, "in_rank": 0.0, "fsdp": 0.0, "check": 0.0, "failed": "HANG"}
    row = bench.summarize({"tests": [{"wall": 17.0, "timings": [ok, hung]}]}, wall=20.0, tier="gloo")
    assert row["examples"] == 2 and row["failed_examples"] == 1 and row["failed_seconds"] == 15.0
    assert row["drawing_and_hypothesis_seconds"] == pytest.approx(17.0 - 16.0 - 0.1)
    assert row["pool_overhead_seconds"] == pytest.approx(0.2)
    line = bench.format_row({"area": "tp", "tier": "gloo", **row, "pytest_exit_status": 0})
    assert "1 examples HANG, CRASH or ERROR, 15.0s waiting for them" in line
