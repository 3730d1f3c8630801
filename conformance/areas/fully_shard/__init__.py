"""FSDP2 (fully_shard applied bottom-up to the plan's groups): parameter
groups, frozen parameters, parameters two groups see, and user forward
methods registered with register_fsdp_forward_method."""

import torch

from conformance.areas.common.area import Area, AreaScenario
from conformance.areas.common.fsdp2_oracle import fsdp2_case_tags, predict_fsdp2
from conformance.areas.common.support import fsdp2_unavailable
from conformance.areas.fully_shard import invariants, repro, scenario
from conformance.areas.fully_shard.observation import FSDP2Observation


def _predict(case):
    return predict_fsdp2(case, torch.__version__)


AREA = Area(
    name="fully_shard",
    title="FSDP2 fully_shard: parameter groups, frozen parameters, ties, registered forward methods",
    invariants=invariants.INVARIANTS,
    scenarios=(
        AreaScenario("fsdp2", scenario.fsdp2, FSDP2Observation, _predict,
                     ranks_tags=lambda case, pred, obs: fsdp2_case_tags(case, pred),
                     fsdp_seconds=lambda obs: obs.seconds + obs.backward_seconds),  # fully_shard, registration, the calls, backward, the read (adapter.observe)
    ),
    applies=lambda case: case.plan.api == "fsdp2",
    unavailable=lambda case: fsdp2_unavailable(),
    repro=repro.fsdp2_script,
)
