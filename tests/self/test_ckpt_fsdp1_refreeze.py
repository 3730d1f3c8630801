"""The checkpoint area draws refreeze (requires_grad flipped after the first
step, before the save) for FSDP1 with use_orig_params=True too, not only for
FSDP2: progressive freezing and unfreezing around a checkpoint. It had
been FSDP2's only, and the mutant fsdp1-optim-gather-frozen-state-as-padding
(a parameter frozen after training has its optimizer state treated as
padding) survived 410 s of the ci profile. The first three ci seeds with
FSDP1 refreeze (torch 2.13.0, gloo) found:
- fsdp1-optim-state-dict-trainable-param-without-state (new): a parameter
  unfrozen since the last step has no optimizer state, and FSDP1's
  optimizer state dict raises '<name> is not in the optimizer state'; where
  one rank's optimizer is empty, get_state_dict's zero-gradient step gives
  it state there first (the checkpoint holds state the optimizer never
  had) or the ranks part (HANG);
- fsdp1-unfreeze-frozen-unit-orig-params: every parameter frozen in the
  first step (a forward with no backward), one unfrozen, the second step's
  backward raises 'Invalid: _post_backward_hook_state'.
Spec: the FullyShardedDataParallel docstring (use_orig_params: mixing frozen
and non-frozen parameters), FSDP.optim_state_dict, torch.optim's state_dict."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, find, settings

from conformance.areas.checkpoint.invariants import case_tags, cause_tags, trainable_without_state
from conformance.areas.checkpoint.oracle import predict_ckpt
from conformance.case.violation import Violation
from conformance.run import corpus, known
from conformance.strategies.checkpoint import checkpoint_specs

pytestmark = pytest.mark.selfcheck

FINDING = "fsdp1-optim-state-dict-trainable-param-without-state"
RAISED = ("save raised RuntimeError: {} is not in the optimizer state. The FSDPParamInfo has the param keys "
          "['block0.scale', 'weight'] while the optimizer has the param keys ['block0.scale'].")


def _case(name: str):
    return next(c.spec for c in corpus.load() if c.name == name)


def _tags(spec) -> set[str]:
    return case_tags(spec, predict_ckpt(spec)) | {"backend:gloo"}


def _match(inv: str, spec, message: str, *extra: str):
    got = known.match(Violation(inv, f"[{inv}] {message}", frozenset(_tags(spec) | set(extra))), known.load(), "2.13.0")
    return got.id if got is not None else None


def _raise_tags(spec, fqn: str) -> tuple[str, ...]:
    error = RAISED.format(fqn).partition(" raised ")[2]
    return ("kind:raised", "phase:save", "error:RuntimeError",
            *cause_tags(error, unstated=trainable_without_state(spec, predict_ckpt(spec))))


def test_fsdp1_with_use_orig_params_draws_refreeze():
    spec = find(checkpoint_specs("optim", api="fsdp1"), lambda s: bool(s.ckpt.refreeze),
                settings=settings(max_examples=2000, database=None, suppress_health_check=list(HealthCheck)))
    assert spec.plan.api == "fsdp1" and spec.plan.use_orig_params


def test_the_unfrozen_parameter_without_state_is_named():
    spec = _case(FINDING)
    assert spec.ckpt.refreeze == ("weight",) and spec.ckpt.steps == 1
    assert trainable_without_state(spec, predict_ckpt(spec)) == {"weight"}
    assert "save:trainable-without-state" in _tags(spec)
    # unfrozen and then trained in a second step: it has state by the save
    trained = dataclasses.replace(spec, ckpt=dataclasses.replace(spec.ckpt, steps=2))
    assert not trainable_without_state(trained, predict_ckpt(trained))
    assert "save:trainable-without-state" not in _tags(trained)


def test_the_raise_is_known_only_for_that_parameter():
    spec = _case(FINDING)
    for inv in ("CKPT-RESHARD", "OPTIM-STATE"):
        assert _match(inv, spec, RAISED.format("weight"), *_raise_tags(spec, "weight")) == FINDING, inv
        assert "key:trainable-without-state" not in _raise_tags(spec, "block0.scale")
        assert _match(inv, spec, RAISED.format("block0.scale"), *_raise_tags(spec, "block0.scale")) is None, inv


def test_the_extra_state_is_known_only_for_that_parameter():
    spec = _case(f"{FINDING}-extra")
    assert trainable_without_state(spec, predict_ckpt(spec)) == {"weight"}
    message = "weight has saved optimizer state; single-process training gave it none"
    assert _match("OPTIM-STATE", spec, message, "kind:extra-at-save", "param:trainable-without-state") == FINDING
    assert _match("OPTIM-STATE", spec, message, "kind:extra-at-save") is None  # another parameter's extra state


def test_a_hang_at_the_save_is_known_only_with_the_unfrozen_parameter():
    spec = _case(f"{FINDING}-extra")
    message = "HANG: scenario 'ckpt-save' on 2 gloo ranks"
    assert _match("CKPT-RESHARD", spec, message, "kind:hang") == FINDING
    trained = dataclasses.replace(spec, ckpt=dataclasses.replace(spec.ckpt, steps=2))
    assert _match("CKPT-RESHARD", trained, message, "kind:hang") is None


def test_the_stale_hook_state_form():
    spec = _case("fsdp1-unfreeze-frozen-unit-orig-params-ckpt")
    error = "Invalid: ``_post_backward_hook_state``: (<torch.autograd.graph._MultiHandle object at 0x7f>,)"
    extra = ("kind:raised", "phase:train", "error:AssertionError", *cause_tags(f"AssertionError: {error}"))
    assert "unit:stale-hook-state" in _tags(spec)
    for inv in ("CKPT-RESHARD", "OPTIM-STATE"):
        assert _match(inv, spec, f"rank 0: train raised AssertionError: {error}", *extra) == "fsdp1-unfreeze-frozen-unit-orig-params"
    one_step = dataclasses.replace(spec, ckpt=dataclasses.replace(spec.ckpt, steps=1, steps_after=0))  # no backward after the unfreeze
    assert "unit:stale-hook-state" not in _tags(one_step)
    # the uninterrupted run after the save trains the same model (ci seed 3: phase:resume), under the save's mask only
    resumed = dataclasses.replace(spec, ckpt=dataclasses.replace(spec.ckpt, steps=1, steps_after=1, load_frozen=()))
    assert "unit:stale-hook-state" in _tags(resumed)
    refrozen = dataclasses.replace(resumed, ckpt=dataclasses.replace(resumed.ckpt, load_frozen=("proj0.weight",)))
    assert "unit:stale-hook-state" not in _tags(refrozen)
