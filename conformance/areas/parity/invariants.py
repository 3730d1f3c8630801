"""Forward-method invariants (register_fsdp_forward_method, FSDP2; the FSDP1
summon_full_params workaround) and training parity under both APIs."""

from __future__ import annotations

from conformance.areas.common.catalog import DOC_FULLY_SHARD, VALUES_UNCHECKED, Catalog, NotChecked
from conformance.areas.common.fsdp1_oracle import fsdp1_case_tags
from conformance.areas.common.fsdp2_oracle import fsdp2_case_tags
from conformance.areas.common.training_oracle import TrainingPrediction
from conformance.areas.common.violations import backend_tag, violation
from conformance.areas.parity.observation import TrainObservation
from conformance.case.spec import CaseSpec
from conformance.case.violation import Violation

catalog = Catalog()


def parity_ranks_tags(spec: CaseSpec, pred: TrainingPrediction, obs: list) -> set[str]:
    """A rank disagreement in a PARITY run (runner's RANKS-AGREE): an FSDP2
    case's tags, so that a known failure that moves one rank's losses more
    than another's (a lost gradient) can match it; none for FSDP1, whose
    rank-dependent structure RANKS-AGREE checks on its own scenario."""
    if pred.api == "fsdp2" and pred.fsdp2 is not None:
        return fsdp2_case_tags(spec, pred.fsdp2)
    return set()


@catalog.invariant(
    "PARITY",
    group="parity",
    api="fsdp1|fsdp2",
    scenario="train",
    statement="A few optimizer steps (SGD, Adam) under FSDP1 (either use_orig_params) or FSDP2 match single-process training: losses and final parameters within tolerance (compared while the reference stays finite and grows less than 1000x; a parameter's tolerance widened by 4 times the float32 reference's own distance from the same training in float64); frozen parameters unchanged with grad None. On a case FSDP must reject but accepts (a tie below its users' common ancestor), what training does is recorded as the consequence (tag outside:<rule>), not skipped.",
    source=f"{DOC_FULLY_SHARD}; FullyShardedDataParallel docstring; DESIGN.md PARITY",
)
def check_training(spec: CaseSpec, pred: TrainingPrediction, obs: TrainObservation) -> list[Violation] | NotChecked:
    if pred.applicable and not pred.consequence_recorded:
        return NotChecked(f"training is not promised for this case: {pred.applicable}")
    if pred.applicable and obs.wrap_error:
        return NotChecked(f"outside the promise ({pred.applicable}), and FSDP rejected it at wrap: {obs.wrap_error}")
    tags = {f"api:{pred.api}", f"optim:{spec.train.optimizer if spec.train else 'SGD'}", backend_tag(obs)}
    if pred.applicable:  # FSDP accepted a case it must reject: what training does is the consequence, recorded
        tags |= {"outside-promise", f"outside:{pred.rule}"}
    if pred.api == "fsdp1":
        tags |= fsdp1_case_tags(spec, pred.fsdp1)
    else:
        tags |= fsdp2_case_tags(spec, pred.fsdp2)
    if pred.frozen:
        tags.add("frozen")
    if obs.wrap_error or obs.step_error:
        where = f" (outside the promise: {pred.applicable}; FSDP accepted it)" if pred.applicable else ""
        return [violation("PARITY", f"training raised {obs.wrap_error or obs.step_error}{where}", tags, "kind:raised")]
    out = []
    frozen = set(pred.frozen)
    for fqn, none in obs.frozen_grads_none:
        if not none:
            out.append(violation("PARITY", f"frozen parameter {fqn} has a gradient", tags, "kind:frozen-grad"))
    if obs.backend == "fake":
        return out or VALUES_UNCHECKED
    if pred.applicable and not out and obs.losses_close is not False and all(p.close is not False for p in obs.params):
        return NotChecked(f"outside the promise ({pred.applicable}): FSDP accepted it and trained as single-process training did")
    if not obs.ref_stable:
        return out or NotChecked("the single-process reference diverged: its values are not comparable")
    if obs.losses_close is False:
        out.append(violation("PARITY", f"losses {list(obs.losses)} differ from single-process {list(obs.ref_losses)}", tags, "kind:loss"))
    for p in obs.params:
        if p.fqn in frozen and not p.unchanged:
            out.append(violation("PARITY", f"frozen parameter {p.fqn} changed", tags, "kind:frozen-changed"))
        elif p.close is False:
            out.append(violation("PARITY", f"{p.fqn} after training differs from single-process by {p.max_diff:.3g}", tags, "kind:param"))
    return out


INVARIANTS = tuple(catalog.invariants)
