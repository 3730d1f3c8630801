"""Training parity (PARITY): a few optimizer steps under FSDP1 (both
use_orig_params) and FSDP2 against single-process training."""

from conformance.areas.common.area import Area, AreaScenario
from conformance.areas.common.repro import suite_script
from conformance.areas.common.support import fsdp2_unavailable
from conformance.areas.common.training_oracle import predict_training
from conformance.areas.parity import invariants, scenario
from conformance.areas.parity.observation import TrainObservation

AREA = Area(
    name="parity",
    title="Training parity: optimizer steps under either API against single-process training",
    invariants=invariants.INVARIANTS,
    scenarios=(AreaScenario("train", scenario.train, TrainObservation, predict_training, ranks_tags=invariants.parity_ranks_tags,
                            fsdp_seconds=lambda obs: obs.fsdp_seconds),),
    applies=lambda case: getattr(case, "train", None) is not None,
    unavailable=lambda case: fsdp2_unavailable() if case.plan.api == "fsdp2" else None,
    needs_ranks=True,
    repro=suite_script,
)
