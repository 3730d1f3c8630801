"""MP-DTYPES and ACCUM: mixed precision and gradient accumulation over a
training schedule (steps, freeze changes, microbatches), both APIs."""

from __future__ import annotations

from conformance.areas.common.catalog import Catalog, NotChecked
from conformance.areas.common.fsdp1_oracle import predict_fsdp1
from conformance.areas.common.fsdp2_oracle import (
    container_given_to_fully_shard,
    group_rerun,
    group_rerun_after_frozen_embedding,
    list_group_completed_by_frozen_embedding,
    predict_fsdp2,
)
from conformance.areas.common.violations import backend_tag, fsdp1_cause_tags, violation
from conformance.areas.schedule.observation import ScheduleObservation
from conformance.areas.schedule.oracle import (
    EPS,
    SchedulePrediction,
    frozen_unit_passes_input_through,
    group_mixes_accumulated_and_fresh,
    group_unrun_under_no_sync,
    no_shard_accumulates_synced,
    no_shard_tied_left_unsharded,
    no_shard_unfrozen_stale_mask,
    no_shard_units_left_unsharded,
    no_shard_unsynced_tied_low_precision,
    pipeline_tolerance,
    stale_hook_states,
    step_tolerance,
    unit_strategy,
    units_dropping_synced_grad,
    units_unsynced_by_last_microbatch,
    unsynced_no_shard_frozen,
    used_params,
)
from conformance.case.model_case import is_model_case
from conformance.case.spec import CaseSpec
from conformance.case.target import graph_of
from conformance.case.violation import Violation

catalog = Catalog()

DOC_MP2 = "MixedPrecisionPolicy docstring (param_dtype: unsharded parameters and compute; reduce_dtype: gradient reduction, defaults to param_dtype; output_dtype; cast_forward_inputs)"
DOC_MP1 = "MixedPrecision docstring (param_dtype, reduce_dtype, buffer_dtype: cast in the first forward and kept thereafter, keep_low_precision_grads: gradients in the reduction dtype, else upcast to full precision; cast_forward_inputs, cast_root_forward_inputs; its note: 'For the root FSDP instance, its cast_root_forward_inputs takes precedence over its cast_forward_inputs')"
DOC_SYNC = "FullyShardedDataParallel.no_sync docstring (gradients accumulate in module variables, synchronized in the first forward-backward out of the context); FSDPModule.set_requires_gradient_sync docstring (accumulate without communication; reduce_dtype accumulation)"


def _smallest_unit_numel(spec: CaseSpec) -> int | None:
    """FSDP1: the fewest elements one sharded unit's flat parameter holds."""

    g = graph_of(spec)
    # a NO_SHARD unit (a CustomWrap kwarg) keeps its whole flat parameter on every rank
    sizes = [sum(g.numel(g.resolve_param(f)) for f in u.managed) for u in predict_fsdp1(spec).units
             if u.managed and unit_strategy(spec, u.path) != "NO_SHARD"]
    return min(sizes) if sizes else None


def _small_unit_accumulates_synced(spec: CaseSpec, world_size: int) -> bool:
    """FSDP1: a sharded unit with fewer elements than ranks whose trainable
    parameters two microbatches of a step that synchronizes each one use
    (the second backward meets the first's reduced gradient)."""
    g = graph_of(spec)
    small = [u for u in predict_fsdp1(spec).units if u.managed and unit_strategy(spec, u.path) != "NO_SHARD"
             and sum(g.numel(g.resolve_param(f)) for f in u.managed) < world_size]
    for st in spec.schedule.steps:
        if st.sync_every:
            used = [used_params(spec, mb.skip) - set(st.frozen) for mb in st.microbatches]
            if any(sum(bool(set(u.managed) & x) for x in used) > 1 for u in small):
                return True
    return False


def _root_casts_by_cast_forward_inputs(spec: CaseSpec, pred: SchedulePrediction) -> bool:
    """FSDP1 casts an instance's forward inputs in its pre-forward wherever
    cast_forward_inputs is set and the instance has a handle (parameters of
    its own): the root's too, so cast_root_forward_inputs=False does not keep
    a root that manages parameters from casting (_runtime_utils._pre_forward)."""
    pr = spec.schedule.precision
    if pred.api != "fsdp1" or pr is None or pred.compute_dtype == "float32":
        return False
    if not pr.cast_forward_inputs or pr.cast_root_forward_inputs:
        return False
    return any(u.path == "" and u.managed for u in predict_fsdp1(spec).units)


def case_tags(spec: CaseSpec, pred: SchedulePrediction, world_size: int = 2) -> set[str]:
    """Facts about a schedule case that known_failures.toml entries match on."""
    s = spec.schedule
    tags = {f"api:{pred.api}", f"optim:{s.optimizer}", f"param:{pred.compute_dtype}", f"reduce:{pred.reduce_dtype}"}
    if pred.api == "fsdp1":
        tags.add(f"uop:{str(spec.plan.use_orig_params).lower()}")
        tags.add("policy:none" if spec.plan.policy is None else "policy:some")
        smallest = _smallest_unit_numel(spec)
        if smallest is not None and smallest < world_size:
            tags.add("unit-smaller-than-world")  # a rank's shard of it is empty
            if not is_model_case(spec) and _small_unit_accumulates_synced(spec, world_size):
                tags.add("unit:small-accumulates-synced")  # fsdp1-accumulated-grad-wrong-unit-smaller-than-world's mechanism
    if any(len(st.microbatches) > 1 and st.sync_every for st in s.steps):
        tags.add("accumulate-synced")
    pr = s.precision
    if pr is not None and pr.keep_low_precision_grads:
        tags.add("keep-low-precision-grads")
    if pr is not None and pr.buffer_dtype:
        tags.add("buffer-dtype")
    if _root_casts_by_cast_forward_inputs(spec, pred):
        tags.add("root:casts-by-cast-forward-inputs")  # fsdp1-root-casts-inputs-despite-cast-root-false's mechanism
    if pred.api == "fsdp2" and container_given_to_fully_shard(spec):
        tags.add("container-subclass")  # a ModuleList/ModuleDict subclass with a forward, given to fully_shard
    if len({st.frozen for st in s.steps}) > 1:
        tags.add("freeze-changes")
        if pred.api == "fsdp2" and _group_trainable_later(spec):
            tags.add("group-trainable-later")
    if pred.api == "fsdp2" and not is_model_case(spec) and _multi_frozen_embedding(spec):
        tags.add("group:multi-frozen-embedding")  # fsdp2-frozen-list-group-freed-in-backward's mechanism
    if any(st.frozen for st in s.steps):
        tags.add("frozen")
        if pred.api == "fsdp2" and _group_rerun_after_frozen_embedding(spec):
            tags.add("group:rerun-after-frozen-embedding")
    if any(len(st.microbatches) > 1 and not st.sync_every for st in s.steps):
        tags.add("no-sync")
        if pred.api == "fsdp2" and _group_rerun(spec):
            tags.add("group:rerun")  # a list group's module runs again after the group completed
    if any(mb.skip for st in s.steps for mb in st.microbatches):
        tags.add("skips")
    if s.first >= 0:
        tags.add("method-first")
    if spec.ties or (is_model_case(spec) and any(len(graph_of(spec).aliases(pid)) > 1 for pid in graph_of(spec).param_info)):
        tags.add("tied")  # a real model's ties are in its graph
    if pred.compute_dtype != "float32":
        tags.add("param-dtype-low")
    if pred.reduce_dtype != "float32":
        tags.add("reduce-dtype-low")

    if any(frozen_unit_passes_input_through(spec, set(st.frozen), mb.skip) for st in s.steps for mb in st.microbatches):
        tags.add("unit:frozen-passthrough")  # fsdp1-frozen-unit-returning-its-input-fails-backward's mechanism
    unsynced = units_unsynced_by_last_microbatch(spec)
    if unsynced:
        tags.add("unit:unsynced-by-last-microbatch")  # fsdp1-no-sync-unit-unused-in-last-microbatch's mechanism
        if any(unit_strategy(spec, u) == "NO_SHARD" for u in unsynced):
            tags.add("unit:unsynced-no-shard")  # ... in its NO_SHARD form: the gradient is never all-reduced
            if unsynced_no_shard_frozen(spec):
                tags.add("unit:unsynced-no-shard-frozen")  # ... a frozen parameter of the unit keeps a gradient view
    if no_shard_unsynced_tied_low_precision(spec, world_size):
        tags.add("unit:no-shard-unsynced-tied-low-precision")  # fsdp1-no-shard-no-sync-tied-param-low-precision's mechanism
    if no_shard_unfrozen_stale_mask(spec, world_size):
        tags.add("unit:no-shard-stale-grad-none-mask")  # fsdp1-no-shard-unfrozen-param-loses-no-sync-grad's mechanism
    stale = stale_hook_states(spec)
    if "changed" in stale:
        tags.add("unit:stale-hook-state")  # fsdp1-unfreeze-frozen-unit-orig-params's mechanism
    if "kept" in stale:
        tags.add("unit:stale-trainable-hook")  # fsdp1-mixed-precision-forward-without-backward's mechanism
    if pred.api == "fsdp2" and _group_mixes_accumulated_and_fresh(spec):
        tags.add("group:accumulated-and-fresh")  # fsdp2-accumulated-grads-mixed-reduce-dtype's mechanism
    if pred.api == "fsdp2" and _group_unrun_under_no_sync(spec):
        tags.add("group:unrun-under-no-sync")  # fsdp2-no-sync-unrun-group-reduce-dtype's mechanism
    if units_dropping_synced_grad(spec):
        tags.add("unit:synced-grad-dropped")  # fsdp1-synced-accumulation-unused-unit-drops-grad's mechanism
    left = set(no_shard_units_left_unsharded(spec, world_size).values())
    if "unused" in left:
        tags.add("unit:no-shard-left-unsharded")  # fsdp1-no-shard-unused-unit-params-unregistered's mechanism
    if "frozen" in left:
        tags.add("unit:no-shard-frozen-left-unsharded")  # fsdp1-no-shard-frozen-unit-params-unregistered's, trained later
    tied_left = no_shard_tied_left_unsharded(spec, world_size)
    if "frozen" in tied_left:
        tags.add("unit:no-shard-frozen-tied-left-unsharded")  # ... its tied form, read by the summon the step ends with
    if "unused" in tied_left:
        tags.add("unit:no-shard-tied-left-unsharded")  # fsdp1-no-shard-unused-unit-params-unregistered's tied form, likewise
    if no_shard_accumulates_synced(spec):
        tags.add("unit:no-shard-synced-accumulation")  # fsdp1-no-shard-synced-accumulation-in-reduce-dtype's mechanism
    if any(not used_params(spec, mb.skip) - set(st.frozen) for st in s.steps for mb in st.microbatches):
        tags.add("forward-only")  # a microbatch whose loss needs no gradient: no backward
    return tags


def _multi_frozen_embedding(spec: CaseSpec) -> bool:
    """A list group completed, in some microbatch, by an Embedding frozen in
    that step: its output needs no gradient (the fully_shard area's tag,
    conformance.areas.common.fsdp2_oracle.fsdp2_case_tags, with each step's
    own mask and skips: a freeze change can freeze the Embedding later)."""
    import torch

    groups = predict_fsdp2(spec, torch.__version__).groups
    return list_group_completed_by_frozen_embedding(spec, groups) or any(
        list_group_completed_by_frozen_embedding(spec, groups, set(st.frozen), mb.skip) for st in spec.schedule.steps for mb in st.microbatches)


def _group_rerun_after_frozen_embedding(spec: CaseSpec) -> bool:
    """In some microbatch, a list group's module runs again after a frozen
    Embedding completed the group's forward (see
    conformance.areas.common.fsdp2_oracle.group_rerun_after_frozen_embedding)."""
    import torch


    groups = predict_fsdp2(spec, torch.__version__).groups
    return any(
        group_rerun_after_frozen_embedding(spec, groups, set(st.frozen), mb.skip) for st in spec.schedule.steps for mb in st.microbatches
    )


def _group_unrun_under_no_sync(spec: CaseSpec) -> bool:
    import torch

    return group_unrun_under_no_sync(spec, predict_fsdp2(spec, torch.__version__).groups)


def _group_mixes_accumulated_and_fresh(spec: CaseSpec) -> bool:
    import torch

    return group_mixes_accumulated_and_fresh(spec, predict_fsdp2(spec, torch.__version__).groups)


def _group_rerun(spec: CaseSpec) -> bool:
    """In some microbatch, a list group's module runs forward again after
    the group completed (conformance.areas.common.fsdp2_oracle.group_rerun)."""
    import torch

    groups = predict_fsdp2(spec, torch.__version__).groups
    return any(group_rerun(spec, groups, mb.skip) for st in spec.schedule.steps for mb in st.microbatches)


def _group_trainable_later(spec: CaseSpec) -> bool:
    """An FSDP2 group all of whose parameters are frozen in the first step
    and some of which train in a later one (the group's dtypes are set at
    its first forward, from the parameters trainable then)."""
    import torch


    steps = spec.schedule.steps
    for grp in predict_fsdp2(spec, torch.__version__).groups:
        if grp.managed and set(grp.managed) <= set(steps[0].frozen):
            if any(not set(grp.managed) <= set(st.frozen) for st in steps[1:]):
                return True
    return False


# Fragments of torch's error messages -> a tag known failures match on.
ERRORS = {
    "_saved_grad_shard": "error:saved-grad-shard",
    "attempting to assign a gradient with dtype": "error:grad-dtype-mismatch",
    "expects uniform gradient dtype": "error:mixed-grad-dtypes",
    "_post_backward_hook_state": "error:post-backward-hook-state",
    "has no attribute '_unsharded_param'": "error:no-unsharded-param",
    "its data is not allocated yet": "error:data-not-allocated",
    # Adam's and AdamW's lerp over a low-precision gradient of a full-precision parameter
    "expected dtype float for `end` but got dtype": "error:optimizer-grad-dtype",
    "out of bounds for storage of size 0": "error:freed-storage",  # a parameter read over its freed unsharded storage
    # a unit's pre-backward hook found it in backward already (its reshard-only hook ran first)
    "expected to be in states [<TrainingState.IDLE: 1>] but current state is TrainingState.FORWARD_BACKWARD": "error:pre-backward-state",
}


def error_tags(obs: ScheduleObservation) -> set[str]:
    """What one rank raised, as tags: where, the exception type, ERRORS."""
    if obs.wrap_error:
        return {"at:wrap"}
    if not obs.step_error:
        return set()
    error = obs.step_error.partition(": ")[2].partition(":")[0]  # "step S microbatch M: Type: message"
    where = "at:optimizer" if "optimizer" in obs.step_error else "at:gradients" if "gradients" in obs.step_error else "at:microbatch"
    return {f"error:{error}", where, *(t for frag, t in ERRORS.items() if frag in obs.step_error), *fsdp1_cause_tags(obs.step_error)}


def _raised(inv: str, obs: ScheduleObservation, tags: set[str]) -> list[Violation] | NotChecked:
    if obs.wrap_error:
        return [violation(inv, f"wrapping raised {obs.wrap_error}", tags, "kind:raised", *error_tags(obs))]
    if obs.step_error:
        return [violation(inv, f"training raised at {obs.step_error}", tags, "kind:raised", *error_tags(obs))]
    return []


def ranks_tags(spec: CaseSpec, pred: SchedulePrediction, obs: list[ScheduleObservation]) -> set[str]:
    """A rank disagreement on a schedule (runner's RANKS-AGREE): the case's
    tags and what each rank raised (a failure that depends on which rank's
    shard holds a parameter makes the ranks disagree)."""
    tags = case_tags(spec, pred, obs[0].world_size)
    for o in obs:
        tags |= error_tags(o)
    return tags


def _floating(dtypes: tuple[str, ...] | None) -> str:
    return "/".join(sorted(set(dtypes or ()))) or "no floating"


def _no_cast_setting(spec: CaseSpec) -> str:
    return "cast_forward_inputs=False" if spec.plan.api == "fsdp2" else "cast_root_forward_inputs=False"


@catalog.invariant(
    "MP-DTYPES",
    group="schedule",
    api="fsdp1|fsdp2",
    scenario="schedule",
    statement="Under MixedPrecision / MixedPrecisionPolicy, forward computes in param_dtype (parameters and inputs), the root's forward gets its inputs as fed where the policy promises no cast there (FSDP2: cast_forward_inputs=False; FSDP1: cast_root_forward_inputs=False, which takes precedence over the root's cast_forward_inputs), gradients are reduced in reduce_dtype and end in the parameters' dtype (FSDP1 keep_low_precision_grads: the reduction dtype), buffers keep theirs (FSDP1: buffer_dtype), the output is output_dtype; results match fp32 training within a dtype-aware tolerance up to a step whose promised pipeline leaves its dtypes' range (a gradient past float16's largest value reduced in float16 is inf as promised); whatever the freeze schedule and whichever forward runs first.",
    source=f"{DOC_MP2}; {DOC_MP1}",
)
def check_mp_dtypes(spec: CaseSpec, pred: SchedulePrediction, obs: ScheduleObservation) -> list[Violation] | NotChecked:
    if pred.applicable:
        return NotChecked(f"the schedule is not promised for this case: {pred.applicable}")
    tags = case_tags(spec, pred, obs.world_size) | {backend_tag(obs)}
    out = _raised("MP-DTYPES", obs, tags)
    if obs.wrap_error:
        return out
    for f in obs.forwards:
        bad_in = [d for d in f.inputs if d != pred.compute_dtype]
        if bad_in:
            out.append(violation("MP-DTYPES", f"step {f.step}: {f.path or '<root>'}'s forward got {bad_in[0]} inputs, not {pred.compute_dtype}", tags, "kind:input-dtype"))
        for name, d in f.params:
            if d != pred.compute_dtype:
                out.append(violation("MP-DTYPES", f"step {f.step}: {f.path or '<root>'}.{name} is {d} inside forward, not {pred.compute_dtype}", tags, "kind:compute-dtype"))
        for name, d in f.buffers:
            if d != pred.buffer_dtype:
                out.append(violation("MP-DTYPES", f"step {f.step}: buffer {f.path or '<root>'}.{name} is {d} inside forward, not {pred.buffer_dtype}", tags, "kind:buffer-dtype"))
    for name, d in obs.buffers_after:
        if d != pred.buffer_dtype:
            out.append(violation("MP-DTYPES", f"buffer {name} is {d} after training, not {pred.buffer_dtype}", tags, "kind:buffer-dtype"))
    for mb in obs.microbatches:
        if mb.handed is not None and mb.handed != mb.fed:
            # cast:param-dtype: the inputs cast to param_dtype, as a flag-driven cast would (the finding's form);
            # cast:other: any other change of what was fed
            how = "cast:param-dtype" if mb.handed and set(mb.handed) == {pred.compute_dtype} else "cast:other"
            out.append(violation("MP-DTYPES", f"step {mb.step} microbatch {mb.index}: the root's forward got {_floating(mb.handed)} inputs where "
                                 f"FSDP promises no cast ({_no_cast_setting(spec)}), not {_floating(mb.fed)} as fed", tags, "kind:root-input-cast", how))
        bad = sorted({d for _, d in mb.reduces if d != pred.reduce_dtype})
        if bad:
            out.append(violation("MP-DTYPES", f"step {mb.step} microbatch {mb.index}: gradients reduced in {bad}, not {pred.reduce_dtype}", tags, "kind:reduce-dtype"))
        if pred.output_dtype and mb.output_dtype != pred.output_dtype:
            out.append(violation("MP-DTYPES", f"step {mb.step} microbatch {mb.index}: output is {mb.output_dtype}, not output_dtype {pred.output_dtype}", tags, "kind:output-dtype"))
    for g in obs.grads:
        if g.dtype is not None and g.dtype != pred.grad_dtype:
            out.append(violation("MP-DTYPES", f"step {g.step}: gradient of {g.fqn} is {g.dtype}, not {pred.grad_dtype}", tags, "kind:grad-dtype"))
    for p in obs.params:
        if p.dtype != "float32":
            out.append(violation("MP-DTYPES", f"step {p.step}: {p.fqn} is {p.dtype} outside forward, not its own float32", tags, "kind:param-dtype"))
    if obs.values_meaningful:
        out += _values("MP-DTYPES", pred, obs, tags)
    return _dedupe(out)


def _values(inv: str, pred: SchedulePrediction, obs: ScheduleObservation, tags: set[str]) -> list[Violation] | NotChecked:
    """The values against fp32 training, up to the first step whose promised
    pipeline leaves its dtypes' range (overflow_steps: a gradient beyond
    float16's 65504 reduced in float16 is inf as promised; fp32 training is
    no bound from there on, each later step starting from those values)."""
    out = []
    stop = min(obs.overflow_steps, default=len(obs.rounding_noise) + 1_000_000)

    def tol(step: int) -> float:
        noise = obs.rounding_noise[step] if step < len(obs.rounding_noise) else 0.0
        return step_tolerance(pred, noise)

    for mb in obs.microbatches:
        if mb.step >= stop:
            continue
        if mb.loss_err > tol(mb.step):
            out.append(violation(inv, f"step {mb.step} microbatch {mb.index}: loss differs from single-process training by {mb.loss_err:.3g} (relative; tolerance {tol(mb.step):.3g})", tags, "kind:loss"))
    frozen = dict(enumerate(pred.frozen_by_step))
    for g in obs.grads:
        if g.step < stop and g.err is not None and g.fqn not in frozen[g.step] and g.err > tol(g.step):
            out.append(violation(inv, f"step {g.step}: gradient of {g.fqn} differs from single-process training by {g.err:.3g} (relative; tolerance {tol(g.step):.3g})", tags, "kind:grad"))
    if pred.compare_params:
        for p in obs.params:
            if p.step < stop and p.fqn not in frozen[p.step] and p.err is not None and p.err > tol(p.step):
                out.append(_param_violation(inv, pred, p, tol(p.step), tags))
    return out


def _param_violation(inv: str, pred: SchedulePrediction, p, tol: float, tags: set[str]) -> Violation:
    """kind:param; kind:unused-param where FSDP1 (use_orig_params=True) gave
    the parameter a zero gradient in this or an earlier step where it was
    unused while its unit was not (the optimizer state then differs too)."""
    msg = f"step {p.step}: {p.fqn} after the step differs from single-process training by {p.err:.3g} (relative; tolerance {tol:.3g})"
    if not pred.reference_zero_grads:
        unused = [i for i, zero in enumerate(pred.unused_in_used_unit[: p.step + 1]) if p.fqn in zero]
        if unused:
            return violation(inv, f"{msg}; unused in step {unused[0]} while its FSDP unit's other parameters were used", tags, "kind:unused-param")
    return violation(inv, msg, tags, "kind:param")


def _dedupe(vs: list[Violation]) -> list[Violation] | NotChecked:
    """One violation per kind: a wrong dtype shows in every step and module."""
    seen, out = set(), []
    for v in vs:
        kind = next((t for t in v.tags if t.startswith("kind:")), "")
        if kind not in seen:
            seen.add(kind)
            out.append(v)
    return out


@catalog.invariant(
    "MP-PIPELINE",
    group="schedule",
    api="fsdp1|fsdp2",
    scenario="schedule",
    statement="Under FSDP2 or FSDP1 (with or without mixed precision), every rank's microbatch losses and the gradients the optimizer sees equal an emulation of the promised pipeline on one process, to fp32 rounding (with more than two ranks, beyond the element-wise bound on how far two orders of their sum in reduce_dtype can land apart: no order is promised): parameters in param_dtype for forward and backward; FSDP2: floating inputs cast to param_dtype by every module given to fully_shard (cast_forward_inputs) and the root's output to output_dtype, each rank's gradients reduced in reduce_dtype (their mean over ranks), with gradient sync disabled accumulated in reduce_dtype, the sharded gradient in the parameter's dtype accumulating the reductions; FSDP1: buffers in buffer_dtype, inputs cast to param_dtype at the root (cast_root_forward_inputs) and at every other FSDP instance with cast_forward_inputs, gradients reduced in reduce_dtype (their mean over ranks) and cast back to the parameter's dtype, the sharded gradient (FlatParameter or original parameter, use_orig_params either way) accumulating the reductions of synced microbatches. FSDP1 documents no dtype for gradients accumulated under no_sync: the gradients of a step with an unsynced microbatch are not compared (its losses are), nor those kept by keep_low_precision_grads (a known deviation of their dtype).",
    source=f"{DOC_MP2}; reduce_dtype: 'If also gradient reduction is disabled via set_requires_gradient_sync, then FSDP will accumulate gradients using reduce_dtype'; upstream test_fully_shard_mixed_precision.py (the reference casts, reduces and accumulates by hand and compares exactly); {DOC_MP1}: param_dtype 'the dtype for model parameters during forward and backward and thus the dtype for forward and backward computation', reduce_dtype 'the dtype for gradient reduction', keep_low_precision_grads False: 'FSDP upcasts gradients to full precision after the backward pass'; upstream test_fsdp_mixed_precision.py (_reduce_scatter_validate_mp checks the reduction's dtype; its models train against DDP, whose gradient is the mean over ranks: FSDP1's docstrings name no averaging themselves, the mean is the data-parallel convention PARITY and ACCUM hold it to); FSDP1's power-of-two gradient pre- and post-division (_init_utils: DefaultState._get_gradient_predivide_factor) is implemented, not documented: with two ranks both divisions are exact, so the promised mean rounds the same",
)
def check_mp_pipeline(spec: CaseSpec, pred: SchedulePrediction, obs: ScheduleObservation) -> list[Violation] | NotChecked:
    if pred.emulation:
        return NotChecked(pred.emulation)
    if not obs.values_meaningful:
        return NotChecked("the fake tier's collectives move no data: values are not compared")
    if obs.wrap_error or obs.step_error or obs.peer_failed:
        return NotChecked("training raised: MP-DTYPES and ACCUM report it")
    if obs.emulation_error:
        return NotChecked(f"the emulated pipeline itself failed: {obs.emulation_error}")
    tags = case_tags(spec, pred, obs.world_size) | {backend_tag(obs)}
    tol = pipeline_tolerance(pred)
    # from a step whose promised pipeline leaves its dtypes' range on, whether
    # a value is inf depends on where the mean's division falls (before or
    # after the sum: FSDP's pre- and post-division factors, undocumented)
    stop = min(obs.overflow_steps, default=1_000_000)
    out = []
    for mb in obs.microbatches:
        if mb.step >= stop:
            continue
        if mb.emulated_loss_err is not None and mb.emulated_loss_err > tol:
            out.append(violation("MP-PIPELINE", f"step {mb.step} microbatch {mb.index}: loss differs from the emulated pipeline's by {mb.emulated_loss_err:.3g} (relative; tolerance {tol:.3g})", tags, "kind:loss"))
    frozen = dict(enumerate(pred.frozen_by_step))
    for g in obs.grads:
        # reuse slack for the reused parameters' gradients only, per microbatch of the step
        gtol = pipeline_tolerance(pred, g.fqn, len(spec.schedule.steps[g.step].microbatches))
        if g.step < stop and g.emulated_err is not None and g.fqn not in frozen[g.step] and g.emulated_err > gtol:
            # a few roundings of reduce_dtype, or more (a findings' match can tell a rounding from a wrong value)
            size = "off:rounding" if g.emulated_err <= 4 * EPS[pred.reduce_dtype] else "off:large"
            out.append(violation("MP-PIPELINE", f"step {g.step}: gradient of {g.fqn} differs from the emulated pipeline's by {g.emulated_err:.3g} (relative; tolerance {gtol:.3g}; reduce_dtype {pred.reduce_dtype})", tags, "kind:grad", size))
    if not any(mb.emulated_loss_err is not None for mb in obs.microbatches):
        return NotChecked("no microbatch was emulated")
    return _dedupe(out)


@catalog.invariant(
    "ACCUM",
    group="schedule",
    api="fsdp1|fsdp2",
    scenario="schedule",
    statement="K microbatches with gradient sync disabled on all but the last (FSDP1 no_sync, FSDP2 set_requires_gradient_sync(False)) give the gradients of one large batch over every rank's data, whichever parameters each microbatch uses: no reduction inside the disabled microbatches, gradients and updates as single-process training (up to a step whose promised reduction leaves reduce_dtype's range), frozen parameters without gradient and unchanged.",
    source=DOC_SYNC,
)
def check_accum(spec: CaseSpec, pred: SchedulePrediction, obs: ScheduleObservation) -> list[Violation] | NotChecked:
    if pred.applicable:
        return NotChecked(f"the schedule is not promised for this case: {pred.applicable}")
    tags = case_tags(spec, pred, obs.world_size) | {backend_tag(obs)}
    out = _raised("ACCUM", obs, tags)
    if obs.wrap_error:
        return out
    for mb in obs.microbatches:
        if not mb.synced and mb.reduces:
            out.append(violation("ACCUM", f"step {mb.step} microbatch {mb.index}: gradient sync was disabled, yet {mb.reduces[0][0]} ran", tags, "kind:reduced-unsynced"))
    frozen = dict(enumerate(pred.frozen_by_step))
    for g in obs.grads:
        if g.fqn in frozen[g.step] and not g.none:
            out.append(violation("ACCUM", f"step {g.step}: frozen {g.fqn} has a gradient", tags, "kind:frozen-grad"))
    for p in obs.params:
        if p.fqn in frozen[p.step] and not p.unchanged:
            out.append(violation("ACCUM", f"step {p.step}: frozen {p.fqn} changed", tags, "kind:frozen-changed"))
    if obs.values_meaningful:
        out += _values("ACCUM", pred, obs, tags)
    return _dedupe(out)


INVARIANTS = tuple(catalog.invariants)
