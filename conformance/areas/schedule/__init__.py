"""Training schedules (MP-DTYPES, ACCUM, MP-PIPELINE): optimizer steps with
freeze changes, microbatches with gradient sync off on all but the last, and
mixed precision, under either API against fp32 single-process training and
(MP-PIPELINE) an emulation of the promised mixed-precision pipeline."""

from conformance.areas.common.area import Area, AreaScenario
from conformance.areas.schedule import invariants, repro, scenario
from conformance.areas.schedule.adapter import missing_api
from conformance.areas.schedule.observation import ScheduleObservation
from conformance.areas.schedule.oracle import predict_schedule

AREA = Area(
    name="schedule",
    title="Training schedules: mixed precision and gradient accumulation",
    invariants=invariants.INVARIANTS,
    scenarios=(AreaScenario("schedule", scenario.schedule, ScheduleObservation, predict_schedule, ranks_tags=invariants.ranks_tags,
                            fsdp_seconds=lambda obs: obs.fsdp_seconds),),
    applies=lambda case: getattr(case, "schedule", None) is not None,
    unavailable=lambda case: missing_api(),
    needs_ranks=True,
    repro=repro.schedule_script,
)
