"""FSDP1 auto-wrapping (FullyShardedDataParallel with an auto_wrap_policy):
the units and the parameters each manages, torch's own pre-wrap simulation,
the frozen-parameter error and warnings, tied parameters, state-dict keys,
CustomPolicy kwargs, and every rank building the same units."""

from conformance.areas.autowrap import invariants, repro, scenario
from conformance.areas.autowrap.invariants import check_ranks_agree
from conformance.areas.autowrap.observation import WrapObservation
from conformance.areas.common.area import Area, AreaScenario
from conformance.areas.common.fsdp1_oracle import predict_fsdp1


def _fsdp_seconds(obs: WrapObservation) -> float:
    return obs.wrap_seconds + obs.state_dict_seconds  # FSDP's constructor and state_dict()


AREA = Area(
    name="autowrap",
    title="FSDP1 auto-wrapping: units, managed FQNs, frozen checks, ties, rank agreement",
    invariants=invariants.INVARIANTS,
    scenarios=(
        AreaScenario("fsdp1", scenario.fsdp1, WrapObservation, predict_fsdp1, agree=check_ranks_agree,
                     covers=("fsdp1-structure",), fsdp_seconds=_fsdp_seconds),
        AreaScenario("fsdp1-structure", scenario.fsdp1_structure, WrapObservation, predict_fsdp1, agree=check_ranks_agree,
                     fsdp_seconds=_fsdp_seconds),
    ),
    applies=lambda case: case.plan.api == "fsdp1",
    repro=repro.fsdp1_script,
)
