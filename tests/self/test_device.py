"""The rank's device (conformance.areas.common.support): CPU for gloo, fake and no
group, unchanged behaviour there; and everything a scenario computes follows
the device a case is placed on. CUDA is not available here, so the "meta"
device stands in for it: a tensor made on CPU and mixed with a meta one raises,
just as a CPU tensor mixed with a CUDA one does."""

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings

from conformance.areas.common import support
from conformance.case.build import build, call_args, method_callable
from conformance.case.model_case import ModelCase
from conformance.case.spec import WrapPlan, effective_calls
from conformance.models.toy_target import lm_loss
from conformance.strategies.groups import fsdp2_case_specs

pytestmark = pytest.mark.selfcheck

TOY = "conformance.models.toy_target:target"


def test_without_nccl_everything_stays_on_cpu():
    assert support.rank_device() == torch.device("cpu")  # no process group here
    x = torch.ones(2)
    assert support.on_rank_device(x) is x
    built = build(next(iter(_specs(1))))
    params = list(built.model.parameters())
    assert support.placed(built) is built and built.device == torch.device("cpu")
    assert all(a is b and a.device.type == "cpu" for a, b in zip(params, built.model.parameters()))


@pytest.fixture
def on_meta(monkeypatch):
    monkeypatch.setattr(support, "rank_device", lambda: torch.device("meta"))


def _specs(n):
    out = []

    @settings(max_examples=n, database=None, phases=[Phase.generate], derandomize=True, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(fsdp2_case_specs())
    def collect(spec):
        out.append(spec)

    collect()
    return out


def test_a_placed_case_computes_on_its_device(on_meta):
    # the case's forward, its user methods (keyword calls included) and
    # the inputs: nothing made on CPU along the way
    for spec in _specs(10):
        built = support.placed(build(spec))
        assert {t.device.type for t in built.model.parameters()} <= {"meta"}
        for call in effective_calls(spec):
            args, kwargs = call_args(built.example_input(), call)
            out = method_callable(built.model, spec, call.method)(*args, **kwargs)
            assert out.device.type == "meta", spec


def test_a_placed_target_computes_on_its_device(on_meta):
    built = support.placed(build(ModelCase(TOY, plan=WrapPlan("fsdp2"))))
    inputs = built.example_input()
    assert inputs["input_ids"].device.type == "meta"
    assert lm_loss(built.model(**inputs)).device.type == "meta"
    assert support.on_rank_device({"a": [torch.ones(1)], "b": 3})["a"][0].device.type == "meta"
