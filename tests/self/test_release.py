"""An example's model goes when its scenario ends (conformance.case.build.released,
which the engine's run_scenario opens around every scenario).

FSDP1 with use_orig_params=False ties a wrapped module to its FlatParameter in
a cycle through C++ that Python's collector cannot see (the module's parameter
views -> their autograd nodes -> the FlatParameter -> its ParamInfo -> the
module; pytorch/pytorch#183211): without the release, every such example's
model stayed alive for the rest of the process, and each full collection of
the garbage collector walked all of them again.
"""

import gc

import pytest
import torch.nn as nn

from conformance.case.build import build, released
from conformance.case.spec import CaseSpec, ClassSpec, ModuleSpec, ParamSpec, SizeBasedWrap, WrapPlan


def _case(seed: int, use_orig_params: bool) -> CaseSpec:
    leaf = ModuleSpec("proj0", "Linear", (ParamSpec("weight", (2, 3)),))
    block = ModuleSpec("block0", "Block", (ParamSpec("scale", (3,)),), (), (leaf,))
    return CaseSpec(
        tree=ModuleSpec("", "Model", (), (), (block,)),
        classes=(ClassSpec("Model", "Module"), ClassSpec("Block", "Module")),
        plan=WrapPlan(api="fsdp1", policy=SizeBasedWrap(min_num_params=1), use_orig_params=use_orig_params),
        seed=seed,
    )


def _live_modules() -> int:
    gc.collect()
    return sum(isinstance(o, nn.Module) for o in gc.get_objects())


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_an_fsdp1_example_leaves_no_module_behind(fake_engine, use_orig_params):
    fake_engine.run("fsdp1", _case(0, use_orig_params))  # the group and first-use imports
    before = _live_modules()
    for seed in range(1, 6):
        (rec,) = fake_engine.run("fsdp1", _case(seed, use_orig_params))
        assert rec["ok"], rec.get("error")
        assert len(rec["value"]["units"]) == 3  # each module its own unit: FSDP wrapped them all
    assert _live_modules() == before


def test_released_empties_what_was_built_inside_it_and_nothing_else():
    outside = build(_case(0, False))
    with released():
        inside = build(_case(1, False))
        assert [n for n, _ in inside.model.named_parameters()] == ["block0.scale", "block0.proj0.weight"]
    assert list(inside.model.named_modules()) == [("", inside.model)]
    assert list(inside.modules["block0.proj0"].named_parameters()) == []
    assert [n for n, _ in outside.model.named_parameters()] == ["block0.scale", "block0.proj0.weight"]


def test_released_blocks_nest():
    with released():
        outer = build(_case(0, False))
        with released():
            inner = build(_case(1, False))
        assert list(inner.model.parameters()) == []
        assert len(list(outer.model.parameters())) == 2
    assert list(outer.model.parameters()) == []
