"""The training lifecycle, checkpoint half: SD-FULL, TIES-KEPT, CKPT-RESHARD,
OPTIM-STATE on real ranks. A case is saved (or its state dict taken) on its
save world and loaded on its load world: world size 1 is the driver itself,
2 the session's pool, 3 a pool made for this module.

Spec: the FSDP1 state_dict_type / FullStateDictConfig docstrings, the
torch.distributed.checkpoint and .state_dict docstrings (catalog entries).
"""

import pytest
from hypothesis import given, settings

from conformance.run import corpus
from conformance.suite.budget import examples
from strategies.checkpoint import checkpoint_specs

pytestmark = pytest.mark.needs_ranks  # values and world sizes: not the fake tier


@pytest.fixture(scope="module")
def worlds(engine):
    from conformance.engine.worlds import Worlds

    w = Worlds(engine)
    yield w
    w.close()


def _check(invariant_id, spec, worlds, conformance):
    from conformance.areas.checkpoint.adapter import missing_api

    why = missing_api(spec)
    if why:
        pytest.skip(why)
    if worlds.backend == "nccl":  # one GPU per rank: the save and load worlds must fit the machine
        import torch

        need = max(spec.ckpt.save_world, spec.ckpt.load_world)
        if torch.cuda.device_count() < need:
            pytest.skip(f"nccl: a checkpoint world of {need} ranks needs {need} GPUs, this machine has {torch.cuda.device_count()}")
    conformance.check(invariant_id, spec, worlds, worlds.tier)


@pytest.mark.parametrize("invariant_id", ["SD-FULL"])
@settings(max_examples=examples(100))
@corpus.examples("SD-FULL")
@given(spec=checkpoint_specs("full"))
def test_full_state_dict(invariant_id, spec, worlds, conformance):
    _check(invariant_id, spec, worlds, conformance)


@pytest.mark.parametrize("invariant_id", ["TIES-KEPT"])
@settings(max_examples=examples(100))
@corpus.examples("TIES-KEPT")
@given(spec=checkpoint_specs("ties"))
def test_ties_kept(invariant_id, spec, worlds, conformance):
    _check(invariant_id, spec, worlds, conformance)


# CKPT-RESHARD and OPTIM-STATE are checked on the same round trip (the
# runner keeps the example's observations for the second check): one save
# and load per example for both.
@pytest.mark.parametrize("invariant_id", ["CKPT-RESHARD"])
@settings(max_examples=examples(100))
@corpus.examples("CKPT-RESHARD", "OPTIM-STATE")
@given(spec=checkpoint_specs("optim"))
def test_checkpoint_round_trip(invariant_id, spec, worlds, conformance):
    failures = []
    for inv in (invariant_id, "OPTIM-STATE"):
        try:
            _check(inv, spec, worlds, conformance)
        except AssertionError as e:
            failures.append(e)
    if failures:
        raise failures[0]
