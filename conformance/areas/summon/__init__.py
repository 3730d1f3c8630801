"""The FSDP1 workaround for user forward methods (spec source 004): a root
method run inside summon_full_params(recurse=False)."""

from conformance.areas.common.area import Area, AreaScenario
from conformance.areas.common.repro import suite_script
from conformance.areas.summon import invariants, scenario
from conformance.areas.summon.observation import SummonObservation
from conformance.areas.summon.oracle import predict_summon

AREA = Area(
    name="summon",
    title="FSDP1 forward methods: the summon_full_params(recurse=False) workaround",
    invariants=invariants.INVARIANTS,
    scenarios=(AreaScenario("fsdp1-methods", scenario.fsdp1_methods, SummonObservation, predict_summon,
                            fsdp_seconds=lambda obs: obs.seconds),),
    applies=lambda case: case.plan.api == "fsdp1" and bool(getattr(case, "methods", ())),
    repro=suite_script,
    model_cases="a real model's method does not declare which parameters it reads, which the workaround's promise depends on",
)
