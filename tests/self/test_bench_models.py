"""`fsdp-conformance bench --target`: per API, examples per second of a real
model's drawn cases next to the time inside FSDP (what it prints, not how
fast: speed is measured by the bench, never by a test)."""

from __future__ import annotations

import pytest

from conformance.run import bench

pytestmark = [pytest.mark.selfcheck, pytest.mark.fake]


def test_bench_prints_examples_per_second_next_to_the_time_inside_fsdp(capsys):
    res = bench.run(["fsdp1"], examples=2, targets=["conformance.models.toy_target:target"])
    out = capsys.readouterr().out
    r = res["conformance.models.toy_target:target"]["apis"]
    assert list(r) == ["fsdp1"]  # --api chooses, as for the synthetic benches
    assert r["fsdp1"]["examples"] == 2 and r["fsdp1"]["examples_per_s"] > 0 and r["fsdp1"]["fsdp_ms_per_example"] > 0
    assert "fsdp1 (fake, W=4" in out and "examples/s" in out and "inside FSDP" in out


def test_bench_names_an_api_a_model_is_not_measured_by():
    with pytest.raises(bench.BenchError, match="per API fsdp1 / fsdp2"):
        bench.run(["checkpoint"], examples=1, targets=["conformance.models.toy_target:target"])
