"""OPTIM-STATE compares the saved optimizer state and the resumed values
with single-process training; a parameter whose gradient is zero in exact
arithmetic (a LayerNorm's weight over one element: x - mean is 0) moves by
rounding noise alone, and two correct summation orders move it apart by
more than any tolerance. Seed 54 (ci, torch 2.13.0) FAILed OPTIM-STATE
fsdp2 on gloo for such a weight: after one SGD step saved on 3 ranks and one
resumed on 2, FSDP's 0.2935 against the reference's 0.2889, FSDP's resumed
and uninterrupted runs agreeing. The comparison leaves noise trajectories
out (the float32 reference moves them, the float64 one does not) and allows
the reference's own rounding noise elsewhere, as the parity areas do; a
wrong value of any other parameter still fails (test_faults_checkpoint). Spec: the
torch.distributed.checkpoint.state_dict docstring (set_state_dict restores
the model and optimizer state) and DESIGN.md OPTIM-STATE."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conformance.areas.checkpoint import adapter
from conformance.areas.checkpoint.observation import CkptObservation
from conformance.case.spec import CaseSpec
from conformance.run import runner

pytestmark = pytest.mark.selfcheck

# seed 54's shrunk case: LayerNorm(1) under a module that is also shared, SGD, saved on 3 ranks, loaded on 2
CASE = CaseSpec.from_json((Path(__file__).parent / "data" / "ckpt-layernorm-one-element-noise.json").read_text())


def test_close_admits_the_references_noise_and_no_more():
    assert not adapter._close([0.2881], [0.2831])
    assert adapter._close([0.2881], [0.2831], torch.tensor([0.0013]))
    assert not adapter._close([0.2881], [0.2831], torch.tensor([0.0011]))
    assert adapter._close([float("nan"), 1.0], [float("nan"), 1.0]) and not adapter._close([float("nan")], [0.5])
    assert not adapter._close([1.0, 2.0], [1.0])


def test_only_the_noise_trajectory_is_left_out():
    ref32, _ = adapter.single_process(CASE, until_save=False)
    ref64, _ = adapter.single_process(CASE, until_save=False, dtype=torch.float64)
    names = [n for n, _ in ref32.named_parameters()]
    init = adapter.placed(adapter.build(CASE)).model
    assert adapter._noise_only(init, ref32, ref64, names) == {"model0.norm1.weight"}


@pytest.mark.gloo
def test_seed_54_case_passes(fault_pools):
    """FAIL before (saved momentum and resumed value of model0.norm1.weight);
    that the invariant still catches a wrong state or value is
    test_faults_checkpoint's (faults injected in the ranks)."""
    from conformance.engine.worlds import Worlds

    engine = Worlds(fault_pools(2))
    try:
        obs = runner.observations(engine, CASE, "ckpt-roundtrip", CkptObservation.from_dict)
    finally:
        engine.close()
    res = runner.evaluate("OPTIM-STATE", CASE, obs, [])
    assert res.verdict == "PASS", res
