"""HSDP and 2-D meshes (HSDP-PARITY, HSDP-REPLICAS, HSDP-DEGENERATE, HSDP-SYNC,
HSDP-LAYOUT, HSDP-STATE-DICT, HSDP-COMMS): FSDP2's fully_shard over a
(replicate, shard) DeviceMesh and FSDP1's HYBRID_SHARD /
_HYBRID_SHARD_ZERO2 (a device_mesh or a process-group pair), trained on
data that differs by rank, against single-process training and flat FSDP
over the whole world. Layout and collectives need no values: the fake tier
checks them too."""

from conformance.areas.common.area import Area, AreaScenario
from conformance.areas.common.repro import suite_script
from conformance.areas.common.support import fsdp2_unavailable
from conformance.areas.hsdp import invariants, scenario
from conformance.areas.hsdp.observation import HsdpObservation
from conformance.areas.hsdp.oracle import predict_hsdp


def _ranks_tags(spec, pred, obs) -> set[str]:
    return invariants.case_tags(spec, pred, obs[0])


AREA = Area(
    name="hsdp",
    title="HSDP and 2-D meshes: training, replicas, degenerate meshes, layout, state dicts, sync from rank 0 and collectives over (replicate, shard)",
    invariants=invariants.INVARIANTS,
    scenarios=(AreaScenario("hsdp", scenario.hsdp, HsdpObservation, predict_hsdp, ranks_tags=_ranks_tags,
                            fsdp_seconds=lambda obs: obs.fsdp_seconds),),
    applies=lambda case: getattr(case, "hsdp", None) is not None,
    unavailable=lambda case: fsdp2_unavailable() if case.plan.api == "fsdp2" else None,
    repro=suite_script,
    model_cases="model cases draw no HSDP layout yet",
)
