"""Every invariant catches a fault injected into FSDP1 (monkeypatched here).

Each test first shows the case holds on unmodified torch (PASS, or KNOWN only
for a recorded finding), then patches one FSDP internal the way a plausible
regression would, and shows the invariant turns the case into a FAIL.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import _init_utils, _state_dict_utils, _wrap_utils
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from conformance.case.examples import lora_model
from conformance.run.runner import FAIL, KNOWN, PASS, evaluate, observations
from tests.self import cases

pytestmark = [pytest.mark.selfcheck, pytest.mark.fake]


def verdict(invariant, spec, engine):
    return evaluate(invariant, spec, observations(engine, spec))


def assert_caught(invariant, spec, engine, kind, before=(PASS,)):
    clean = verdict(invariant, spec, engine)
    assert clean.verdict in before, clean.describe()
    return clean


def assert_fails(invariant, spec, engine, kind):
    res = verdict(invariant, spec, engine)
    assert res.verdict == FAIL, res.describe()
    assert any(kind in v.tags for v in res.violations), res.describe()


def _dropping_last_target(orig):
    def drop_last(self, *args, **kwargs):
        targets = orig(self, *args, **kwargs)
        targets.pop(list(targets)[-1])
        return targets

    return drop_last


def test_wrap_units_catches_a_dropped_target(fake_engine, monkeypatch):
    spec = cases.two_blocks()
    assert_caught("WRAP-UNITS", spec, fake_engine, None)
    monkeypatch.setattr(ModuleWrapPolicy, "_run_policy", _dropping_last_target(ModuleWrapPolicy._run_policy))
    assert_fails("WRAP-UNITS", spec, fake_engine, "kind:missing-unit")


def _drop_last_param(orig):
    def patched(module, ignored_params):
        params = list(orig(module, ignored_params))
        yield from params[:-1]

    return patched


def test_wrap_fqns_catches_a_param_left_out_after_wrapping(fake_engine, monkeypatch):
    spec = cases.two_blocks(use_orig_params=True)
    assert_caught("WRAP-FQNS", spec, fake_engine, None)
    monkeypatch.setattr(_init_utils, "_get_orig_params", _drop_last_param(_init_utils._get_orig_params))
    assert_fails("WRAP-FQNS", spec, fake_engine, "kind:post-vs-oracle")


def test_wrap_fqns_catches_a_wrong_pre_wrap_simulation(fake_engine, monkeypatch):
    spec = cases.two_blocks()
    orig = _wrap_utils._get_managed_param_to_fqn

    def forgetful(*args, **kwargs):
        out = orig(*args, **kwargs)
        if out:
            out.pop(next(iter(out)))
        return out

    monkeypatch.setattr(_wrap_utils, "_get_managed_param_to_fqn", forgetful)
    assert_fails("WRAP-FQNS", spec, fake_engine, "kind:sim-vs-post")


def test_exactly_once_catches_an_unmanaged_param(fake_engine, monkeypatch):
    spec = cases.two_blocks(use_orig_params=True)
    assert_caught("WRAP-EXACTLY-ONCE", spec, fake_engine, None)
    monkeypatch.setattr(_init_utils, "_get_orig_params", _drop_last_param(_init_utils._get_orig_params))
    assert_fails("WRAP-EXACTLY-ONCE", spec, fake_engine, "kind:unmanaged")


def test_state_dict_catches_a_lost_key(fake_engine, monkeypatch):
    spec = cases.two_blocks()
    assert_caught("WRAP-STATE-DICT", spec, fake_engine, None)
    orig = _state_dict_utils._full_post_state_dict_hook

    def lossy(module, fsdp_state, state_dict, prefix):
        out = orig(module, fsdp_state, state_dict, prefix)
        for k in [k for k in out if k.endswith("bias")][:1]:
            del out[k]
        return out

    monkeypatch.setattr(_state_dict_utils, "_full_post_state_dict_hook", lossy)
    assert_fails("WRAP-STATE-DICT", spec, fake_engine, "kind:state-dict")


def test_frozen_error_catches_a_skipped_validation(fake_engine, monkeypatch):
    spec = lora_model(num_layers=1)
    assert_caught("FROZEN-ERROR", spec, fake_engine, None)
    monkeypatch.setattr(_wrap_utils, "_validate_frozen_params", lambda *a, **k: None)
    assert_fails("FROZEN-ERROR", spec, fake_engine, "kind:unparsed-message")


def test_frozen_warn_catches_the_reversed_traversal_order(fake_engine, monkeypatch):
    # Spec source 000 chose the stack-based DFS so that the first registered
    # violating module is reported first; reverse named_modules() is the
    # order it rejected.
    spec = lora_model(num_layers=2, use_orig_params=True)
    assert_caught("FROZEN-WARN", spec, fake_engine, None)
    monkeypatch.setattr(_wrap_utils, "_get_post_order_named_modules", lambda root: list(root.named_modules())[::-1])
    assert_fails("FROZEN-WARN", spec, fake_engine, "kind:order")


def test_frozen_warn_catches_wrong_numel(fake_engine, monkeypatch):
    spec = cases.uniform_mixed_units(use_orig_params=True)
    assert_caught("FROZEN-WARN", spec, fake_engine, None)
    orig = _wrap_utils._get_managed_param_to_fqn

    def doubled(*args, **kwargs):  # counts one parameter twice, as a tie bug would
        out = orig(*args, **kwargs)
        extra = {nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad): f + "_again" for p, f in list(out.items())[:1]}
        return {**out, **extra}

    monkeypatch.setattr(_wrap_utils, "_get_managed_param_to_fqn", doubled)
    assert_fails("FROZEN-WARN", spec, fake_engine, "kind:wrong-numel")


def _add_ghost_param(monkeypatch):
    """The pre-wrap simulation reports a frozen parameter the model lacks in every non-empty unit."""
    orig = _wrap_utils._get_managed_param_to_fqn

    def ghost(*args, **kwargs):
        out = orig(*args, **kwargs)
        if out:
            out[nn.Parameter(torch.zeros(1), requires_grad=False)] = "ghost"
        return out

    monkeypatch.setattr(_wrap_utils, "_get_managed_param_to_fqn", ghost)


def test_frozen_clean_catches_a_spurious_warning(fake_engine, monkeypatch):
    spec = cases.two_blocks(use_orig_params=True)
    assert_caught("FROZEN-CLEAN", spec, fake_engine, None)
    _add_ghost_param(monkeypatch)
    assert_fails("FROZEN-CLEAN", spec, fake_engine, "kind:spurious-warning")


def test_a_ghost_warning_in_a_shared_module_case_is_not_a_known_finding(fake_engine, monkeypatch):
    # fsdp1-frozen-check-shared-module-order explains spurious warnings in
    # cases with a shared module, but only ones that name a parameter with two
    # names (names:aliased): a regression naming no parameter of the model
    # must stay a FAIL there (CI once absorbed this very fault as KNOWN).
    import dataclasses

    from conformance.case.spec import SharedModule

    spec = dataclasses.replace(cases.two_blocks(use_orig_params=True), shared=(SharedModule("b", "z2", "z"),))
    assert_caught("FROZEN-CLEAN", spec, fake_engine, None, before=(PASS, KNOWN))
    _add_ghost_param(monkeypatch)
    assert_fails("FROZEN-CLEAN", spec, fake_engine, "names:unknown")


def test_ties_catches_a_duplicated_tied_param(fake_engine, monkeypatch):
    # On torch 2.13 this case is KNOWN (the tie sits below the users' common
    # ancestor); a regression that also duplicates the tied parameter with
    # use_orig_params=True must still turn it red.
    spec = cases.sibling_tie(use_orig_params=True)
    assert_caught("TIES", spec, fake_engine, None, before=(PASS, KNOWN))
    monkeypatch.setattr(_init_utils, "_is_fsdp_flattened", lambda t: False)
    assert_fails("TIES", spec, fake_engine, "kind:duplicated")


def test_ranks_agree_catches_a_rank_dependent_policy(monkeypatch):
    # Two ranks of one world, observed in-process one after the other; the
    # fault (a policy that drops a target) is active on rank 1 only.
    from conformance.engine.fake import FakeEngine
    from conformance.run.runner import evaluate

    spec = cases.two_blocks()
    rank0 = observations(FakeEngine(world_size=2, rank=0), spec)
    rank1 = observations(FakeEngine(world_size=2, rank=1), spec)
    assert evaluate("RANKS-AGREE", spec, rank0 + rank1).verdict == PASS
    monkeypatch.setattr(ModuleWrapPolicy, "_run_policy", _dropping_last_target(ModuleWrapPolicy._run_policy))
    rank1 = observations(FakeEngine(world_size=2, rank=1), spec)
    res = evaluate("RANKS-AGREE", spec, rank0 + rank1)
    assert res.verdict == FAIL and any("kind:units-differ" in v.tags for v in res.violations), res.describe()


def test_a_ghost_in_a_shared_parent_error_case_is_not_a_known_finding(fake_engine, monkeypatch):
    # The thorough profile's case (torch 2.13.0): the simulation credits the
    # Attention unit with its shared Linear's trainable weight, so the
    # ValueError names attention1 instead of the root: KNOWN as
    # fsdp1-frozen-check-shared-module-order (kind:wrong-module,
    # names:aliased). A regression whose message names a parameter the model
    # lacks must stay a FAIL, even next to an aliased name.
    import json
    from pathlib import Path

    from conformance.case.spec import CaseSpec

    spec = CaseSpec.from_json(json.dumps(json.loads((Path(__file__).parent / "data" / "frozen-error-shared-parent-credited.json").read_text())))
    clean = assert_caught("FROZEN-ERROR", spec, fake_engine, None, before=(KNOWN,))
    assert [fid for _, fid in clean.known] == ["fsdp1-frozen-check-shared-module-order"], clean.describe()
    orig = _wrap_utils._get_managed_param_to_fqn

    def ghost(*args, **kwargs):
        out = orig(*args, **kwargs)
        if out:  # a trainable ghost: every non-empty unit with a frozen parameter mixes
            out[nn.Parameter(torch.zeros(1), requires_grad=True)] = "ghost"
        return out

    monkeypatch.setattr(_wrap_utils, "_get_managed_param_to_fqn", ghost)
    assert_fails("FROZEN-ERROR", spec, fake_engine, "names:unknown")
