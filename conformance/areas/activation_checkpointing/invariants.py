"""AC-PARITY, AC-STATE-DICT, AC-ALLGATHER: activation checkpointing
(checkpoint_wrapper, torch.utils.checkpoint, selective AC, the composable
checkpoint) inside, around and across FSDP1 units and FSDP2 groups."""

from __future__ import annotations

from collections import Counter

from conformance.areas.activation_checkpointing.observation import ACObservation
from conformance.areas.activation_checkpointing.oracle import FREED_READ, RESHARDED_READ, ACPrediction, wrappers_that_may_be_units
from conformance.areas.common.catalog import VALUES_UNCHECKED, Catalog, NotChecked
from conformance.areas.common.violations import backend_tag, violation
from conformance.case.spec import CaseSpec
from conformance.case.violation import Violation

catalog = Catalog()

DOC_AC = ("torch.utils.checkpoint.checkpoint docstring (tensors of the checkpointed function are not kept alive but "
          "recomputed by re-invoking it in the backward pass as needed for gradient computation; use_reentrant=True "
          "needs an input that requires grad); checkpoint_wrapper docstring (all calls of the wrapped module "
          "checkpoint); create_selective_checkpoint_contexts docstring (the policy chooses which ops are recomputed); "
          "torch.distributed._composable.checkpoint docstring (the composable form of the same)")
DOC_KEYS = ("checkpoint_wrapper (ActivationWrapper: its state_dict post-hook strips _checkpoint_wrapped_module., its "
            "load_state_dict pre-hook adds it back); FullyShardedDataParallel.state_dict / fully_shard's state_dict "
            "(the unwrapped module's FQNs)")
DOC_GATHER = ("fully_shard docstring (reshard_after_forward: reshard after forward, all-gather again in backward); "
              "FullyShardedDataParallel docstring (FULL_SHARD, BACKWARD_PRE); the comm oracle "
              "(conformance/areas/common/comm_oracle.py) over the case's units; torch.utils.checkpoint.checkpoint "
              "docstring (the region is recomputed in the backward pass as needed for gradient computation: inside "
              "the backward of the units that hold it)")


def error_tag(text: str) -> str:
    """The mechanism of an error, for findings to match on."""
    if "out of bounds for storage of size 0" in text or "but its data is not allocated yet" in text or FREED_READ in text:
        return "error:freed-storage"  # a parameter (view) over a flat parameter FSDP already freed
    if RESHARDED_READ in text:
        return "error:resharded-view"  # FSDP1 use_orig_params=True: the parameter is its rank's shard again
    if "got mixed torch.Tensor and DTensor" in text:
        return "error:mixed-tensor-dtensor"  # a module run with its FSDP2 parameters back to sharded DTensors
    if "encountered during backward but not found in storage" in text:
        return "error:sac-op-mismatch"  # selective AC's cache saw another op sequence in the recompute
    return "error:other"


def sac_op_tag(text: str) -> tuple[str, ...]:
    """Which op selective AC's cache missed: a profiler annotation (FSDP's
    own record_function calls) or a computing op."""
    if "encountered during backward but not found in storage" not in text:
        return ()
    op = text.split("invocation index")[0]  # "<op> invocation index N encountered during backward ..."
    return ("sac-op:record-function",) if "profiler._record_function" in op else ("sac-op:compute",)


def read_tags(text: str, pred: ACPrediction) -> tuple[str, ...]:
    """Whose read the adapter's guard caught: a tied parameter read by a
    user outside the checkpoint_wrapper's size-policy unit that holds it
    (the unit below the tie's common ancestor: outside:tie-below-lca)."""
    if RESHARDED_READ not in text:
        return ()
    words = text.split(RESHARDED_READ)[0].split()  # "RuntimeError: <name> read in forward as ..."
    name = (words[-1] if words else "").replace("_checkpoint_wrapped_module.", "").replace("_fsdp_wrapped_module.", "")
    return ("read:tie-outside-unit",) if name in pred.tie_reads_outside else ()


def _raised(inv: str, obs: ACObservation, tags: set[str], pred: ACPrediction, *, state_dict: bool = False) -> list[Violation] | NotChecked | None:
    if obs.plain_error and (obs.step_error or (state_dict and obs.state_dict_error)):
        # FSDP fails without checkpointing too: the failure is not AC's
        # (the PARITY and comm areas check FSDP itself)
        return NotChecked(f"the same FSDP training without AC raised too ({obs.plain_error}): not checkpointing's failure")
    for at, err in (("ac", obs.ac_error), ("wrap", obs.wrap_error), ("training", obs.step_error)):
        if err:
            return [violation(inv, f"{at} raised {err}", tags, "kind:raised", f"at:{at}", error_tag(err), *sac_op_tag(err),
                              *read_tags(err, pred))]
    if state_dict and obs.state_dict_error:
        return [violation(inv, f"state_dict raised {obs.state_dict_error}", tags, "kind:state-dict-raised", "at:state-dict")]
    return None


@catalog.invariant(
    "AC-PARITY",
    group="activation_checkpointing",
    api="fsdp1|fsdp2",
    scenario="activation-checkpointing",
    statement="With activation checkpointing (checkpoint_wrapper reentrant or not, torch.utils.checkpoint, selective AC, FSDP2's composable checkpoint) on modules inside, around or across FSDP1 units / FSDP2 groups, with ties and frozen parameters, 1..2 SGD steps on data that differs by rank match single-process training of the model without AC: every step's loss and every parameter after the steps (the gradients and optimizer steps, read through them) within PARITY's tolerance; frozen parameters unchanged with grad None.",
    source=f"{DOC_AC}; DESIGN.md PARITY",
)
def check_parity(spec: CaseSpec, pred: ACPrediction, obs: ACObservation) -> list[Violation] | NotChecked:
    if pred.applicable:
        return NotChecked(f"training is not promised for this case: {pred.applicable}")
    tags = set(pred.tags) | {backend_tag(obs)}
    raised = _raised("AC-PARITY", obs, tags, pred)
    if raised is not None:
        return raised
    out = []
    for fqn, none in obs.frozen_grads_none:
        if not none:
            out.append(violation("AC-PARITY", f"frozen parameter {fqn} has a gradient", tags, "kind:frozen-grad"))
    if obs.backend == "fake":
        return out or VALUES_UNCHECKED
    if not obs.ref_stable:
        return out or NotChecked("the single-process reference diverged: its values are not comparable")
    if obs.losses_close is False:
        out.append(violation("AC-PARITY", f"losses {list(obs.losses)} differ from single-process {list(obs.ref_losses)}", tags, "kind:loss"))
    frozen = set(pred.training.frozen)
    for p in obs.params:
        if p.fqn in frozen and not p.unchanged:
            out.append(violation("AC-PARITY", f"frozen parameter {p.fqn} changed", tags, "kind:frozen-changed"))
        elif p.close is False:
            out.append(violation("AC-PARITY", f"{p.fqn} after training differs from single-process by {p.max_diff:.3g}", tags, "kind:param"))
    return out


@catalog.invariant(
    "AC-STATE-DICT",
    group="activation_checkpointing",
    api="fsdp1|fsdp2",
    scenario="activation-checkpointing",
    statement="After training with activation checkpointing under FSDP, model.state_dict() raises nothing and its keys are the unwrapped model's: no _checkpoint_wrapped_module (or FSDP) prefix, none missing, none added.",
    source=DOC_KEYS,
)
def check_state_dict(spec: CaseSpec, pred: ACPrediction, obs: ACObservation) -> list[Violation] | NotChecked:
    if pred.applicable:
        return NotChecked(f"training is not promised for this case: {pred.applicable}")
    tags = set(pred.tags)
    raised = _raised("AC-STATE-DICT", obs, tags, pred, state_dict=True)
    if raised is not None:
        return raised
    got, want = set(obs.state_dict_keys), set(obs.plain_keys)
    if got == want:
        return []
    extra, missing = sorted(got - want), sorted(want - got)
    kind = "kind:wrapper-prefix" if any("_checkpoint_wrapped_module" in k for k in extra) else "kind:keys"
    return [violation("AC-STATE-DICT", f"state dict keys differ: extra {extra[:6]}, missing {missing[:6]}", tags, kind)]


def _counts(rows) -> Counter:
    return Counter({(step, phase, group): n for step, phase, group, n in rows})


@catalog.invariant(
    "AC-ALLGATHER",
    group="activation_checkpointing",
    api="fsdp1|fsdp2",
    scenario="activation-checkpointing",
    statement="Recomputing checkpointed regions in backward all-gathers no more than the unit structure implies: every step's parameter all-gathers, per phase and per FSDP2 group / FSDP1 unit (nested units each), are those the comm oracle predicts for the case without AC (a non-root unit gathered in forward and once more for its backward; FSDP1 with its default FULL_SHARD and BACKWARD_PRE), with AC inside, around, across or on the units; a unit in a checkpointed region whose parameters are all frozen, which has no backward gather of its own, may be gathered in backward for the recompute, at most once per gather of its forward.",
    source=DOC_GATHER,
)
def check_allgather(spec: CaseSpec, pred: ACPrediction, obs: ACObservation) -> list[Violation] | NotChecked:
    if pred.applicable:
        return NotChecked(f"training is not promised for this case: {pred.applicable}")
    tags = set(pred.tags)
    raised = _raised("AC-ALLGATHER", obs, tags, pred)
    if raised is not None:
        return raised
    if obs.plain_error:
        return NotChecked(f"the same FSDP training without AC raised ({obs.plain_error}): the unit structure is not realized")
    exp = pred.expect(obs.world_size)
    if exp.why:
        return NotChecked(f"the comm oracle promises no collectives for this case: {exp.why}")
    want: Counter = Counter()
    for i, it in enumerate(exp.iterations):
        for c in it.collectives:
            if c.op == "all_gather":
                want[(i, c.phase, c.group.split(", ")[0])] += 1
    got = _counts(obs.gathers)
    if got == want:
        return []
    # a frozen unit in a checkpointed region has no backward gather of its
    # own; re-invoking its forward in the recompute reads its parameters:
    # at most once per gather of its forward in that step
    recompute = Counter({(step, "backward", g): n for (step, phase, g), n in want.items()
                         if phase == "forward" and g in pred.frozen_in_region and not want[(step, "backward", g)]})
    plain = None if obs.plain_gathers is None else _counts(obs.plain_gathers)
    # whether the same FSDP run without AC gathers as the oracle says: where
    # it does not, the deviation is FSDP's unit structure, not AC's
    tags.add("without-ac:unknown" if plain is None else "without-ac:as-oracle" if plain == want else "without-ac:differs")
    out = []
    for key in sorted(set(want) | set(got)):
        if not want[key] <= got[key] <= want[key] + recompute[key]:
            step, phase, group = key
            kind = "kind:extra-gathers" if got[key] > want[key] else "kind:missing-gathers"
            without = "" if plain is None else f", {plain[key]} without AC"
            where = f" {'group' if spec.plan.api == 'fsdp2' else 'unit'} {group or '<root>'}"
            implied = f"{want[key]}" + (f" (+ up to {recompute[key]} for its recompute)" if recompute[key] else "")
            out.append(violation("AC-ALLGATHER", f"step {step} {phase}{where}: {got[key]} all-gathers with AC where the unit "
                                 f"structure implies {implied}{without}", tags, kind, f"phase:{phase}"))
    return out


DOC_RECOMPUTE = ("torch.utils.checkpoint.checkpoint docstring ('the unsaved tensors are recomputed by re-invoking function in "
                 "the backward pass as needed for gradient computation'; the reentrant variant re-runs the forward of the "
                 "checkpointed region in backward); checkpoint_wrapper / torch.distributed._composable.checkpoint (the same "
                 "checkpointing of a module); upstream test_checkpoint_wrapper.py (counts the wrapped forward's calls)")


@catalog.invariant(
    "AC-RECOMPUTE",
    group="activation_checkpointing",
    api="fsdp1|fsdp2",
    scenario="activation-checkpointing",
    statement="Checkpointing under FSDP recomputes what it promises: in every step, a checkpointed module whose forward saved tensors for backward (measured on the same FSDP run without AC, where AC leaves the units as they are: not a checkpoint_wrapper that FSDP1's size policy may make a unit) runs its forward again during that step's backward, none runs in backward more often than it ran in forward, and checkpointing changes how often none runs in forward. Counts need no values: both tiers.",
    source=DOC_RECOMPUTE,
)
def check_recompute(spec: CaseSpec, pred: ACPrediction, obs: ACObservation) -> list[Violation] | NotChecked:
    if pred.applicable:
        return NotChecked(f"training is not promised for this case: {pred.applicable}")
    tags = set(pred.tags)
    if obs.ac_error or obs.wrap_error or obs.step_error:
        return NotChecked("checkpointing, wrapping or training with AC raised (AC-PARITY reports it): no step to count")
    if obs.plain_error:
        return NotChecked(f"the same FSDP training without AC raised ({obs.plain_error}): nothing to measure what is saved")
    plain = {(s, t): (f, saved) for s, t, f, _, saved in obs.plain_calls}
    # a wrapper the size policy may make a unit: with AC the target is
    # sharded on its own, so what its forward saves without AC (as part of
    # another unit, e.g. a mixed one whose frozen parameters' views require
    # grad under use_orig_params=True) says nothing of what it saves with AC
    # (thorough seed 1976322998: modeldict0's one frozen weight)
    restructured = wrappers_that_may_be_units(spec)
    out = []
    for step, target, fwd, bwd, _ in obs.calls:
        plain_fwd, saved = plain.get((step, target), (0, 0))
        if fwd != plain_fwd:
            out.append(violation("AC-RECOMPUTE", f"step {step}: {target}'s forward ran {fwd} times in forward with AC, {plain_fwd} without",
                                 tags, "kind:forward-calls"))
        elif fwd and saved and not bwd and target not in restructured:
            out.append(violation("AC-RECOMPUTE", f"step {step}: {target} saved {saved} tensors for backward without AC, and with AC "
                                 "its forward never ran again in backward: nothing was recomputed", tags, "kind:not-recomputed"))
        elif bwd > fwd:
            out.append(violation("AC-RECOMPUTE", f"step {step}: {target}'s forward ran {bwd} times in backward, {fwd} in forward",
                                 tags, "kind:extra-recompute"))
    if not obs.calls:
        return NotChecked("no checkpointed module was counted")
    return out


INVARIANTS = tuple(catalog.invariants)
