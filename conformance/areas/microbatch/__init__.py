"""FSDP2's schedule APIs drawn per microbatch (MB-COMMS, MB-GRADS,
MB-SHARDED): gradient sync, all-reduce, reshard after backward / forward,
is_last_backward, explicit unshard / reshard, int reshard_after_forward,
Shard(1), set_unshard_in_backward, reset_iter_state after an aborted
iteration, all-reduce hooks and custom comms, CPU offload where it runs; against the oracle's collectives and
the large batch's gradients."""

from conformance.areas.common.area import Area, AreaScenario
from conformance.areas.common.support import fsdp2_unavailable
from conformance.areas.microbatch import invariants, repro, scenario
from conformance.areas.microbatch.adapter import api_unavailable, offload_unavailable
from conformance.areas.microbatch.observation import MicrobatchObservation
from conformance.areas.microbatch.oracle import predict_microbatch, unused_differs


def _unavailable(case) -> str | None:
    return (fsdp2_unavailable() or (offload_unavailable() if case.microbatch.cpu_offload else None)
            or (api_unavailable("reset_iter_state") if case.microbatch.abort is not None else None)
            or (api_unavailable("set_unshard_in_backward") if case.microbatch.no_unshard_in_backward else None)
            or (api_unavailable("set_all_reduce_hook") if case.microbatch.all_reduce_hook else None)
            or (api_unavailable("set_custom_all_gather") if case.microbatch.custom_comms else None)
            or (api_unavailable("set_reduce_scatter_unused_params") if case.microbatch.reduce_scatter_unused_params else None)
            or (api_unavailable("set_separate_reduce_scatter_group")
                if any(s.separate_reduce_scatter is not None for s in case.microbatch.microbatches) else None)
            or unused_differs(case))


AREA = Area(
    name="microbatch",
    title="FSDP2 schedule APIs per microbatch: gradient sync, resharding, explicit unshard / reshard, Shard(1), unshard in backward, recovery from an aborted iteration, all-reduce hooks, custom comms, unused parameters, a separate reduce-scatter group, CPU offload",
    invariants=invariants.INVARIANTS,
    scenarios=(AreaScenario("microbatch", scenario.microbatch, MicrobatchObservation, predict_microbatch,
                            failure_tags=invariants.failure_tags, fsdp_seconds=lambda obs: obs.seconds),),
    applies=lambda case: getattr(case, "microbatch", None) is not None,
    unavailable=_unavailable,
    repro=repro.microbatch_script,
    model_cases="a real model's forward is opaque to the oracle, which follows the suite's generic forward to predict the backward hooks",
)
