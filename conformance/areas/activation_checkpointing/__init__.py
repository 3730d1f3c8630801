"""Activation checkpointing under FSDP (AC-PARITY, AC-STATE-DICT,
AC-ALLGATHER): checkpoint_wrapper, torch.utils.checkpoint, selective AC and
the composable checkpoint inside, around and across FSDP units and groups."""

from conformance.areas.activation_checkpointing import invariants, scenario
from conformance.areas.activation_checkpointing.observation import ACObservation
from conformance.areas.activation_checkpointing.oracle import predict_ac
from conformance.areas.common.area import Area, AreaScenario
from conformance.areas.common.repro import suite_script
from conformance.areas.common.support import fsdp2_unavailable

AREA = Area(
    name="activation_checkpointing",
    title="Activation checkpointing inside, around and across FSDP units: values, state-dict keys, all-gathers",
    invariants=invariants.INVARIANTS,
    scenarios=(AreaScenario("activation-checkpointing", scenario.activation_checkpointing, ACObservation, predict_ac,
                            ranks_tags=lambda case, pred, obs: set(pred.tags), fsdp_seconds=lambda obs: obs.fsdp_seconds),),
    applies=lambda case: getattr(case, "activation_checkpoint", None) is not None,
    unavailable=lambda case: fsdp2_unavailable() if case.plan.api == "fsdp2" else None,
    repro=suite_script,
    model_cases="model cases draw no activation checkpointing plan yet",
)
