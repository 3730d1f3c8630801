"""The fake tier compares no values (its process group's collectives carry
no data): the areas that compare FSDP's results with a single-process
reference compute none there, as HSDP's and TP's never did. Activation
checkpointing and init_order train no reference (their reference_loss,
patched to raise, is never reached), summon builds and calls none; what
they observe of structure stays (state-dict keys, all-gathers, calls)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from conformance.areas.activation_checkpointing import adapter as ac
from conformance.areas.init_order import adapter as init
from conformance.areas.summon import adapter as summon
from conformance.strategies.activation_checkpointing import ac_specs
from conformance.strategies.init_order import init_specs
from conformance.strategies.summon import summon_specs

pytestmark = [pytest.mark.selfcheck, pytest.mark.fake]

FEW = settings(max_examples=6, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def _no_reference(*_a, **_k):
    raise AssertionError("the fake tier trained a single-process reference")


def _value(records: list[dict]) -> dict:
    (rec,) = records
    assert rec["ok"], rec.get("error")
    return rec["value"]


def _ac_structure(obs: dict) -> None:
    assert obs["losses_close"] is None and not obs["params"], obs
    if not (obs["ac_error"] or obs["wrap_error"] or obs["step_error"]):
        assert obs["state_dict_keys"] and obs["plain_keys"], obs  # structure is still observed


def _init_structure(obs: dict) -> None:
    assert not obs["final"], obs
    if not obs["failed"]:
        assert obs["losses_close"] is None and obs["losses"], obs  # FSDP's training still ran


TRAINED = {
    "activation-checkpointing": (ac, ac_specs, _ac_structure),
    "init_order": (init, init_specs, _init_structure),
}


@pytest.mark.parametrize("api", ["fsdp1", "fsdp2"])
@pytest.mark.parametrize("scenario", sorted(TRAINED))
def test_no_reference_is_trained_on_the_fake_tier(scenario, api, fake_engine, monkeypatch):
    adapter, strategy, structure = TRAINED[scenario]
    monkeypatch.setattr(adapter, "reference_loss", _no_reference)

    @FEW
    @given(spec=strategy(api=api))
    def run(spec):
        obs = _value(fake_engine.run(scenario, spec))
        assert not obs["ref_losses"], obs
        structure(obs)

    run()


def test_summon_calls_no_reference_on_the_fake_tier(fake_engine, monkeypatch):
    built = []
    real = summon.build
    monkeypatch.setattr(summon, "build", lambda spec: built.append(spec) or real(spec))

    @FEW
    @given(spec=summon_specs())
    def run(spec):
        built.clear()
        obs = _value(fake_engine.run("fsdp1-methods", spec))
        assert len(built) == 1, "summon built a reference model on the fake tier"
        assert all(c["close"] is None and c["max_diff"] is None for c in obs["calls"]), obs
        if not obs["wrap_error"]:
            assert obs["calls"], obs  # the calls still ran under summon_full_params

    run()
