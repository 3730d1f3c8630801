"""Communication (COMM-COUNTS, COMM-ORDER, COMM-FSDP1-COUNTS,
COMM-FSDP1-PREFETCH): each iteration's collectives per FSDP2 group or FSDP1
unit (count, numel, ranks, dtype), FSDP2's unshard / reshard /
post-backward order and FSDP1's prefetching, on either tier (counts and
sizes need no values)."""

from conformance.areas.comm import invariants, repro, scenario
from conformance.areas.comm.observation import CommObservation
from conformance.areas.comm.oracle import predict_comm
from conformance.areas.common.area import Area, AreaScenario
from conformance.areas.common.support import fsdp2_unavailable

AREA = Area(
    name="comm",
    title="Communication: collectives per group or unit, their sizes and dtypes, FSDP2's event order, FSDP1's prefetching",
    invariants=invariants.INVARIANTS,
    scenarios=(AreaScenario("comm", scenario.comm, CommObservation, predict_comm, fsdp_seconds=lambda obs: obs.seconds),),
    applies=lambda case: getattr(case, "comm", None) is not None,
    unavailable=lambda case: fsdp2_unavailable() if case.plan.api == "fsdp2" else None,
    repro=repro.comm_script,
    model_cases="a real model's forward is opaque to the oracle, which follows the suite's generic forward to predict the backward hooks",
)
