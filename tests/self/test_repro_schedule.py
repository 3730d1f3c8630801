"""The training-schedule repro script builds the suite's own model: the same
initial values (seed 66's bf16 tolerance case only reproduced with them)."""

from __future__ import annotations

import pytest
import torch

from conformance.areas.schedule.repro import schedule_script
from conformance.case.build import build
from conformance.run import corpus

pytestmark = pytest.mark.selfcheck


@pytest.mark.parametrize("name", ["suite-bf16-ill-conditioned-tolerance", "fsdp1-keep-low-precision-grads-tied-param-one-shard"])
def test_the_script_starts_from_the_suite_s_values(name):
    spec = next(c.spec for c in corpus.load() if c.name == name)
    ns = {"__name__": "repro_under_test"}  # defines everything, runs nothing
    exec(compile(schedule_script(spec, [], "MP-DTYPES"), "repro.py", "exec"), ns)
    model, _ = ns["build"]()
    want = dict(build(spec).model.named_parameters())
    got = dict(model.named_parameters())
    assert got.keys() == want.keys()
    for name, p in want.items():
        assert torch.equal(got[name], p), name

