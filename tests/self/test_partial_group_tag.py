"""The tag group:multi-partial-root, which known failure
fsdp2-list-group-partial-call-stays-unsharded matches on, marks the
cases where a call's first FSDP group is a list group that the call runs only
in part: not the same model called through the root's forward only (the
root's post-forward completes the group)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conformance.areas.common.fsdp2_oracle import fsdp2_case_tags, predict_fsdp2
from conformance.case.spec import MethodCall
from conformance.run import corpus

pytestmark = [pytest.mark.selfcheck, pytest.mark.fake]

TAG = "group:multi-partial-root"


def _case():
    return next(c.spec for c in corpus.load() if c.name == "fsdp2-list-group-partial-call-stays-unsharded")


def _tags(spec) -> set[str]:
    return fsdp2_case_tags(spec, predict_fsdp2(spec, torch.__version__))


def test_a_call_running_one_module_of_a_list_group_is_tagged():
    assert TAG in _tags(_case())


def test_the_root_forward_alone_is_not_tagged():
    assert TAG not in _tags(dataclasses.replace(_case(), calls=(MethodCall(-1), MethodCall(-1))))
