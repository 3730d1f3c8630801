"""A HANG of a microbatch example is KNOWN only where a finding's mechanism
stops some ranks (the area's failure_tags: the case's tags and the comm
oracle's notes). Thorough seed 191916010 (torch 2.13.0, gloo, a (1, 4)
mesh): proj0.weight (1, 4) with Shard(1) and reshard_after_forward=2; ranks
0 and 2 returned, 1 and 3 waited until the deadline. That is
fsdp2-int-reshard-shard-dim1-backward-raises' one-row form (the forward's
reshard raises on some ranks only; spec: the fully_shard docstring's
reshard_after_forward int and shard_placement_fn). Checked with `check`:
Shard(0) or reshard_after_forward=True passes, and a (2, 4) weight gives
the backward's IndexError on every rank (KNOWN as a raise)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from conformance.areas.microbatch.invariants import failure_tags
from conformance.areas.microbatch.oracle import predict_microbatch
from conformance.case.spec import CaseSpec
from conformance.case.violation import Violation
from conformance.run import known

pytestmark = pytest.mark.selfcheck

CASE = CaseSpec.from_json((Path(__file__).parent / "data" / "mb-int-reshard-shard-dim1-one-row-hang.json").read_text())
FINDING = "fsdp2-int-reshard-shard-dim1-backward-raises"


def _hang(spec: CaseSpec, invariant: str = "MB-GRADS", world_size: int = 4):
    tags = failure_tags(spec, predict_microbatch(spec), world_size)
    v = Violation(invariant, f"HANG: scenario 'microbatch' on {world_size} gloo ranks", frozenset(tags | {"kind:hang"}))
    return known.match(v, known.load(), torch.__version__)


def _with_proj0(spec: CaseSpec, weight: tuple[int, ...], bias: tuple[int, ...]) -> CaseSpec:
    proj0 = spec.tree.children[0]
    params = (dataclasses.replace(proj0.params[0], shape=weight), dataclasses.replace(proj0.params[1], shape=bias))
    children = (dataclasses.replace(proj0, params=params), *spec.tree.children[1:])
    return dataclasses.replace(spec, tree=dataclasses.replace(spec.tree, children=children))


@pytest.mark.parametrize("invariant", ["MB-COMMS", "MB-GRADS", "MB-SHARDED"])
def test_the_one_row_reshard_hang_is_the_shard_dim1_finding(invariant):
    assert CASE.microbatch.shard_dim1 == ("proj0",) and CASE.plan.groups[0].reshard_after_forward == 2
    assert CASE.tree.children[0].params[0].shape == (1, 4) and CASE.microbatch.mesh == (1, 4)
    match = _hang(CASE, invariant)
    assert match is not None and match.id == FINDING


def test_a_hang_without_the_one_row_reshard_is_a_failure():
    shard0 = dataclasses.replace(CASE, microbatch=dataclasses.replace(CASE.microbatch, shard_dim1=()))
    groups = (dataclasses.replace(CASE.plan.groups[0], reshard_after_forward=True), *CASE.plan.groups[1:])
    resharded = dataclasses.replace(CASE, plan=dataclasses.replace(CASE.plan, groups=groups))
    two_rows = _with_proj0(CASE, (2, 4), (2,))  # the backward's IndexError on every rank, not a hang
    for other in (shard0, resharded, two_rows):
        assert _hang(other) is None, other


class _HangingEngine:
    """An engine whose every example hangs on 4 ranks (a pool's HANG)."""

    tier = backend = "gloo"
    world_size = 4
    deadline = 15.0

    def run(self, scenario, spec, *args, **kwargs):
        from conformance.engine.errors import RankHang, RankState

        raise RankHang(scenario=scenario, spec=spec, backend="gloo", world_size=4, deadline=15.0, elapsed=15.0,
                          ranks=(RankState(rank=0, pid=1, state="returned"), RankState(rank=1, pid=2, state="running")))

    def close(self):
        pass


def test_check_reports_a_known_hang_as_run_records_it(capsys):
    """`fsdp-conformance check` on the case gives the verdict `run` records:
    KNOWN (exit 0) on this finding's hang; the same hang of a case without
    the one-row reshard stays HANG (exit 1)."""
    from conformance.areas import select
    from conformance.cli.cases import check_case_file

    invariants = select(["MB-GRADS"])
    assert check_case_file(CASE, invariants, "gloo", 4, engine=_HangingEngine()) == 0
    assert f"MB-GRADS: KNOWN\n  KNOWN {FINDING}: [MB-GRADS] HANG" in capsys.readouterr().out
    shard0 = dataclasses.replace(CASE, microbatch=dataclasses.replace(CASE.microbatch, shard_dim1=()))
    assert check_case_file(shard0, invariants, "gloo", 4, engine=_HangingEngine()) == 1
    assert "MB-GRADS: HANG" in capsys.readouterr().out


def test_without_a_mesh_the_notes_are_the_pools_world():
    """A mesh-less case runs on the pool's world (--world-size, 4 on a
    four-GPU runner): the one-row note is that world's, not a pair's."""
    no_mesh = dataclasses.replace(CASE, microbatch=dataclasses.replace(CASE.microbatch, mesh=None))
    match = _hang(no_mesh, world_size=4)
    assert match is not None and match.id == FINDING
    assert _hang(no_mesh, world_size=2) is None  # two columns a rank: no one-row reshard
