"""Tensor parallelism + FSDP2 (TP-LAYOUT, TP-FULL-TENSOR, TP-PARITY,
TP-STATE-DICT, TP-MP-DTYPE, TP-CLIP): parallelize_module over the "tp" dim
of a (dp, tp) DeviceMesh, then fully_shard(mesh=mesh["dp"]), trained on data
that differs by dp rank against single-process training, clipped with
clip_grad_norm_ over the 2-D gradients, its state dicts carried to flat
FSDP and back. Layout needs no values: the fake tier checks it too."""

from conformance.areas.common.area import Area, AreaScenario
from conformance.areas.common.repro import suite_script
from conformance.areas.common.support import fsdp2_unavailable
from conformance.areas.tp import invariants, scenario
from conformance.areas.tp.observation import TpObservation
from conformance.areas.tp.oracle import predict_tp


def _ranks_tags(spec, pred, obs) -> set[str]:
    return invariants.case_tags(spec, pred, obs[0])


AREA = Area(
    name="tp",
    title="Tensor parallelism + FSDP2 on a (dp, tp) mesh: layout, full tensors, training, state dicts, mixed precision and clipping",
    invariants=invariants.INVARIANTS,
    scenarios=(AreaScenario("tp", scenario.tp, TpObservation, predict_tp, ranks_tags=_ranks_tags, failure_tags=invariants.failure_tags,
                            fsdp_seconds=lambda obs: obs.fsdp_seconds),),
    applies=lambda case: getattr(case, "tp", None) is not None,
    unavailable=lambda case: fsdp2_unavailable(),
    repro=suite_script,
    model_cases="model cases draw no tensor-parallel plan yet",
)
