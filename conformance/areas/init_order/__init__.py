"""Init and order (INIT-ORDER, INIT-META, INIT-SYNC, INIT-DIVERGENT): the
user's actions around FSDP's lazy initialisation, meta-device init, rank 0's
values broadcast to rank-seeded models, and a module some ranks do not call,
under FSDP1 and FSDP2, against single-process training."""

from conformance.areas.common.area import Area, AreaScenario
from conformance.areas.common.repro import suite_script
from conformance.areas.common.support import fsdp2_unavailable
from conformance.areas.init_order import invariants, scenario
from conformance.areas.init_order.observation import InitObservation
from conformance.areas.init_order.oracle import predict_init

AREA = Area(
    name="init_order",
    title="Init and order: user actions around lazy init, meta-device init, sync from rank 0, rank-divergent modules",
    invariants=invariants.INVARIANTS,
    scenarios=(AreaScenario("init_order", scenario.init_order, InitObservation, predict_init,
                            ranks_tags=invariants.ranks_tags, failure_tags=invariants.failure_tags,
                            fsdp_seconds=lambda obs: obs.fsdp_seconds),),
    applies=lambda case: getattr(case, "init", None) is not None,
    unavailable=lambda case: fsdp2_unavailable() if case.plan.api == "fsdp2" else None,
    # INIT-META's shards and placements and INIT-ORDER's dtype and errors are
    # structure: the fake tier checks them, real ranks the values
    needs_ranks=False,
    repro=suite_script,
    model_cases="model cases draw no init plan yet",
)
