"""FSDP1 wraps the root with the constructor's kwargs whatever a CustomPolicy's
lambda returns for the root module itself (_construct_wrap_fn wraps only
modules that are not the root; WRAP-KWARGS expects the same). The schedule
oracle's unit_strategy had applied such kwargs to the root unit: thorough
seed 2511518773 (torch 2.13.0, gloo) drew CustomWrap(targets=('',),
kwargs FULL_SHARD for '') under a NO_SHARD root, FSDP ran the unit NO_SHARD,
and ACCUM / MP-DTYPES (fsdp1-no-shard-unfrozen-param-loses-no-sync-grad) and
MP-PIPELINE (fsdp1-no-shard-synced-accumulation-in-reduce-dtype) FAILed
untagged. `fsdp-conformance check` with the root FULL_SHARD passes both
cases. The checkpoint area's no-shard-unit tag read the root's kwargs the
same way."""

from __future__ import annotations

import dataclasses

import pytest

from conformance.areas.checkpoint.invariants import case_tags as ckpt_tags
from conformance.areas.schedule.invariants import case_tags
from conformance.areas.schedule.oracle import predict_schedule, unit_strategy
from conformance.case.spec import CustomWrap
from conformance.case.violation import Violation
from conformance.run import corpus, known

pytestmark = pytest.mark.selfcheck

STALE = "fsdp1-no-shard-unfrozen-param-loses-no-sync-grad"
SYNCED = "fsdp1-no-shard-synced-accumulation-in-reduce-dtype"
# what the seed's violations carried besides the case tags
GRAD = {"backend:gloo", "kind:grad"}
PIPELINE = {"backend:gloo", "kind:grad", "off:rounding"}


def _case(name: str):
    return next(c.spec for c in corpus.load() if c.name == name)


def _root(spec, strategy: str):
    return dataclasses.replace(spec, schedule=dataclasses.replace(spec.schedule, sharding_strategy=strategy))


def _tags(spec) -> set[str]:
    return case_tags(spec, predict_schedule(spec), 2)


def _match(inv: str, spec, extra: set[str]):
    msg = f"[{inv}] step 1: gradient of 0.proj0.weight differs from single-process training by 0.00225 (relative; tolerance 0.0001)"
    got = known.match(Violation(inv, msg, frozenset(_tags(spec) | extra)), known.load(), "2.13.0")
    return got.id if got is not None else None


def test_the_root_runs_the_constructors_strategy_not_the_policys():
    spec = _case(f"{STALE}-root-kwargs")
    assert spec.plan.policy.kwargs == (("", (("sharding_strategy", "FULL_SHARD"),)),)
    assert unit_strategy(spec, "") == "NO_SHARD"
    assert unit_strategy(_root(spec, "FULL_SHARD"), "") == "FULL_SHARD"
    # a unit below the root still takes its own
    below = dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, policy=CustomWrap(("", "0"), (("0", (("sharding_strategy", "SHARD_GRAD_OP"),)),))))
    assert unit_strategy(below, "0") == "SHARD_GRAD_OP" and unit_strategy(below, "") == "NO_SHARD"


def test_the_stale_mask_form_is_known_only_under_a_no_shard_root():
    spec = _case(f"{STALE}-root-kwargs")
    assert "unit:no-shard-stale-grad-none-mask" in _tags(spec)
    for inv in ("ACCUM", "MP-DTYPES"):
        assert _match(inv, spec, GRAD) == STALE, inv
        assert _match(inv, _root(spec, "FULL_SHARD"), GRAD) is None, inv


def test_the_synced_accumulation_form_is_known_only_under_a_no_shard_root():
    spec = _case(f"{SYNCED}-root-kwargs")
    assert "unit:no-shard-synced-accumulation" in _tags(spec)
    assert _match("MP-PIPELINE", spec, PIPELINE) == SYNCED
    assert _match("MP-PIPELINE", _root(spec, "FULL_SHARD"), PIPELINE) is None


def test_a_checkpoint_no_shard_unit_is_one_below_the_root():
    spec = _case("fsdp1-rank0-only-no-shard-unit-keys")
    assert "no-shard-unit" in ckpt_tags(spec)
    root_only = dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, policy=CustomWrap(("", "proj0"), (("", (("sharding_strategy", "NO_SHARD"),)),))))
    assert "no-shard-unit" not in ckpt_tags(root_only)
