"""Gradient clipping (CLIP-NORM, CLIP-GRADS): torch.nn.utils.clip_grad_norm_
and get_total_norm over FSDP2's DTensor gradients, FSDP1's clip_grad_norm_
method, against single-process clipping."""

from conformance.areas.clip import invariants, scenario
from conformance.areas.clip.adapter import missing_api
from conformance.areas.clip.observation import ClipObservation
from conformance.areas.clip.oracle import predict_clip
from conformance.areas.common.area import Area, AreaScenario
from conformance.areas.common.repro import suite_script
from conformance.areas.common.support import fsdp2_unavailable

AREA = Area(
    name="clip",
    title="Gradient clipping: the total norm and the clipped gradients over sharded gradients",
    invariants=invariants.INVARIANTS,
    scenarios=(AreaScenario("clip", scenario.clip, ClipObservation, predict_clip, ranks_tags=invariants.ranks_tags,
                            failure_tags=invariants.failure_tags,
                            fsdp_seconds=lambda obs: obs.fsdp_seconds),),
    applies=lambda case: getattr(case, "clip", None) is not None,
    unavailable=lambda case: missing_api() or (fsdp2_unavailable() if case.plan.api == "fsdp2" else None),
    needs_ranks=True,
    repro=suite_script,
    model_cases="model cases draw no clipping plan yet",
)
