"""The training lifecycle's checkpoints: full state dicts, every load path
keeping ties, torch.distributed.checkpoint saved under one API, plan and
world size and loaded under another, optimizer state across freeze changes."""

from conformance.areas.checkpoint import invariants, repro, scenario
from conformance.areas.checkpoint.adapter import missing_api
from conformance.areas.checkpoint.observation import CkptObservation
from conformance.areas.checkpoint.oracle import predict_ckpt
from conformance.areas.common.area import Area, AreaScenario


def _fsdp_seconds(obs: CkptObservation) -> float:
    """Inside FSDP and torch.distributed.checkpoint, the save phase's included."""
    phases = [dict(obs.seconds), dict((obs.save or {}).get("seconds") or ())]
    return sum(p.get("fsdp", 0.0) + p.get("dcp", 0.0) for p in phases)


def _scenario(name, run=None, phases=()):
    return AreaScenario(name, run, CkptObservation, predict_ckpt, ranks_tags=invariants.ranks_tags,
                        failure_tags=invariants.failure_tags, phases=phases, fsdp_seconds=_fsdp_seconds)


AREA = Area(
    name="checkpoint",
    title="Checkpoints: full state dicts, ties through every load path, DCP across APIs, plans and world sizes, optimizer state",
    invariants=invariants.INVARIANTS,
    scenarios=(
        _scenario("ckpt-full", scenario.ckpt_full),
        _scenario("ckpt-ties", scenario.ckpt_ties),
        # a round trip: saved on the case's save world, loaded on its load
        # world, in one temporary directory (conformance.engine.worlds)
        _scenario("ckpt-roundtrip", phases=("ckpt-save", "ckpt-load")),
        _scenario("ckpt-save", scenario.ckpt_save),
        _scenario("ckpt-load", scenario.ckpt_load),
    ),
    applies=lambda case: getattr(case, "ckpt", None) is not None,
    unavailable=missing_api,
    needs_ranks=True,
    repro=repro.ckpt_script,
)
