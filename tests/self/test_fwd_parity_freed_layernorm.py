"""fsdp2-frozen-list-group-freed-in-backward has two errors: a backward that
reads the freed weight through setStorage ("out of bounds for storage of
size 0", a Linear's) and one that uses it as it is ("its data is not
allocated yet", a LayerNorm's). FWD-PARITY's match named only the first
(thorough seed 11310111, torch 2.13.0, gloo: fully_shard([1.0, 1.1]), Block
1.0 with a frozen weight and a trainable LayerNorm, the frozen Embedding
1.1 tied to that weight completing the group; the root's forward, then a
registered method reading 2.weight). `check` on 2 gloo ranks: the tied
weight trainable, or reshard_after_forward=False, passes."""

from __future__ import annotations

import dataclasses

import pytest

from conformance.areas.common.fsdp2_oracle import fsdp2_case_tags, predict_fsdp2
from conformance.areas.common.violations import freed_storage_tags, violation
from conformance.run import corpus, known

pytestmark = pytest.mark.selfcheck

FINDING = "fsdp2-frozen-list-group-freed-in-backward"
NOT_ALLOCATED = "RuntimeError: The tensor has a non-zero number of elements, but its data is not allocated yet."


def _case():
    return next(c.spec for c in corpus.load() if c.name == "fsdp2-frozen-list-group-freed-in-backward-layernorm")


def _match(spec, error: str):
    tags = fsdp2_case_tags(spec, predict_fsdp2(spec, "2.13.0")) | {"backend:gloo"} | freed_storage_tags(error)
    v = violation("FWD-PARITY", f"backward raised {error}", tags, "kind:backward-raised")
    return getattr(known.match(v, known.load(), "2.13.0"), "id", None)


def test_each_freed_weight_error_has_its_tag():
    assert freed_storage_tags(NOT_ALLOCATED) == {"error:data-not-allocated"}
    assert freed_storage_tags("RuntimeError: setStorage: sizes [1, 1] ... out of bounds for storage of size 0") == {"error:freed-storage"}
    assert freed_storage_tags("RuntimeError: mat1 and mat2 shapes cannot be multiplied") == set()


def test_the_layernorm_form_is_known_only_where_the_group_frees_the_weight():
    spec = _case()
    assert _match(spec, NOT_ALLOCATED) == FINDING
    assert _match(spec, "RuntimeError: mat1 and mat2 shapes cannot be multiplied") is None
    kept = dataclasses.replace(spec.plan.groups[0], reshard_after_forward=False)
    assert _match(dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, groups=(kept,))), NOT_ALLOCATED) is None
