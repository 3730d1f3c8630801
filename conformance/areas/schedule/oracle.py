"""What FSDP promises for a training schedule (MP-DTYPES, ACCUM): the dtypes
compute, reduction, gradients, buffers and outputs run in, from the
MixedPrecision / MixedPrecisionPolicy docstrings, and the value tolerance a
comparison with fp32 single-process training gets. Pure: no torch.distributed."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from conformance.areas.common.fsdp1_oracle import grad_carrying, predict_fsdp1
from conformance.case.model_case import is_model_case
from conformance.case.spec import CaseSpec, CustomWrap, MethodStep, Precision
from conformance.case.target import graph_of, params_without_grad, runs_in

F32 = "float32"
# Value tolerance by the lowest precision a run involves, relative to
# 1 + max |reference| (bf16 keeps 8 significant bits, fp16 11; a few steps of
# rounding in forward, backward and the reduction stay well inside these,
# a wrong scale or a lost microbatch is far outside).
TOLERANCE = {F32: 1e-4, "float16": 1.5e-2, "bfloat16": 8e-2}
# ... unless the case is ill-conditioned in its compute dtype: where the
# reference itself, computed in that dtype (one process, parameters and
# inputs cast), lands further from fp32 training (large intermediate values
# cancelling, seed 66), FSDP's mixed precision may too, by a small factor:
# it rounds at other points (per-unit casts, a low-precision reduction,
# each rank's own loss), so its error is of the same order, not the same
# sample. A lost microbatch or a doubled gradient stays far outside.
NOISE_FACTOR = 4.0


def step_tolerance(pred: "SchedulePrediction", rounding_noise: float) -> float:
    """The tolerance of one step's values, given the step's rounding noise
    (ScheduleObservation.rounding_noise)."""
    return max(pred.tolerance, NOISE_FACTOR * rounding_noise)


@dataclass(frozen=True)
class SchedulePrediction:
    api: str
    applicable: str  # "" or why the case is outside what the API promises
    input_dtype: str  # what the test feeds the model (the user casts when FSDP will not)
    compute_dtype: str  # managed parameters and floating inputs inside every forward
    reduce_dtype: str  # the gradient reduce-scatter / all-reduce
    grad_dtype: str  # .grad after backward, as the optimizer sees it
    buffer_dtype: str  # buffers inside forward and after it
    output_dtype: str | None  # the root's output (None: no promise beyond compute)
    tolerance: float
    compare_params: bool  # parameters after a step are comparable (SGD, or full precision)
    frozen_by_step: tuple[tuple[str, ...], ...]
    trainable: tuple[str, ...]  # canonical FQNs
    # FSDP1, per step: the trainable parameters the step does not use while
    # another parameter of their unit (frozen or not) is used. FSDP1 reduces whole
    # FlatParameters, so these get a zero gradient, not None: a step of a
    # stateful optimizer (momentum, Adam, weight decay), where single-process
    # training skips them.
    unused_in_used_unit: tuple[tuple[str, ...], ...] = ()
    # ... and the reference gives them that zero gradient too: with
    # use_orig_params=False "the optimizer sees the sharded FlatParameters
    # themselves" (spec source 000); with use_orig_params=True it sees the
    # original parameters, whose gradient single-process training leaves None
    reference_zero_grads: bool = False
    # MP-PIPELINE: "" where FSDP's promised pipeline is emulated (see
    # pipeline_tolerance), else why not
    emulation: str = ""
    reused: bool = False  # a parameter or module used more than once in a forward (see pipeline_tolerance)
    # ... which parameters: canonical FQNs reached by more than one name (a
    # tie, a shared module's); every one where the case has forward methods
    # (a method may read or rerun any of them)
    reused_params: tuple[str, ...] = ()
    reuse_all: bool = False
    # FSDP1: (unit path, its managed canonical FQNs), for a flat parameter's tolerance
    unit_params: tuple[tuple[str, tuple[str, ...]], ...] = ()


# MP-PIPELINE: the promised pipeline emulated on one process (each rank's
# forward and backward with parameters and inputs in param_dtype, its
# gradients accumulated and reduced in reduce_dtype) rounds exactly as FSDP
# does where the order of the reduction cannot matter: with two ranks (a + b
# = b + a, and any power-of-two pre- or post-division is exact). More ranks
# may be summed in another order (a ring, a tree): no order is promised, so
# the emulation bounds, element by element, how far any two orders can land
# apart (reduction_slack) and only the distance beyond that bound counts. A
# gradient accumulated in bf16 instead of fp32 is off by bf16's rounding
# (about 3e-3), far outside the fp32 slack.
PIPELINE_SLACK = 8 * 2.0 ** -24
EPS = {F32: 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


# A parameter or module used more than once in a forward (a tie, a shared
# module, a forward method) gets several gradient contributions in one
# backward: autograd sums them in the order they arrive, which FSDP's own
# autograd hooks may change. No order is promised: a few roundings of the
# compute dtype there.
REUSE_ROUNDINGS = 4


FLAT = "<flat parameter of "


def is_reused(pred: "SchedulePrediction", fqn: str | None) -> bool:
    """Whether the value named ``fqn`` may sum several gradient contributions
    of one backward in an unpromised order: a reused parameter's gradient,
    an FSDP1 flat parameter's holding one; ``fqn`` None (a loss, or a case
    with forward methods): whether the case reuses anything. Every other
    leaf gets one contribution per use of its module, and the activations
    of the generic forward at most two (a + b = b + a), so nothing else
    depends on the order autograd (or FSDP's hooks) sums in.

    Under FSDP2 a case with ties once had a non-reused parameter's gradient
    off by two fp32 roundings (seed 4711, reduce_dtype float16, not
    explained yet): such a gradient gets a few fp32 roundings more
    (pipeline_tolerance), never the compute dtype's."""
    if not pred.reused:
        return False
    if fqn is None or pred.reuse_all:
        return True
    if fqn.startswith(FLAT):
        path = fqn[len(FLAT):-1]
        managed = dict(pred.unit_params).get("" if path == "the root" else path)
        return managed is None or bool(set(managed) & set(pred.reused_params))
    return fqn in pred.reused_params


def reuse_slack(pred: "SchedulePrediction") -> float:
    """The slack of a value that sums a reused parameter's contributions."""
    return REUSE_ROUNDINGS * EPS[lowest(pred.compute_dtype, pred.reduce_dtype)] if pred.reused else 0.0


def other_slack(pred: "SchedulePrediction") -> float:
    """The slack of any other gradient of a case that reuses something: a
    few fp32 roundings under FSDP2 (see is_reused: seed 4711), none under
    FSDP1."""
    return REUSE_ROUNDINGS * PIPELINE_SLACK if pred.reused and pred.api == "fsdp2" else 0.0


def pipeline_tolerance(pred: "SchedulePrediction", fqn: str | None = None, microbatches: int = 1) -> float:
    """MP-PIPELINE's tolerance of a loss (``fqn`` None) or of the gradient
    of ``fqn`` (canonical FQN, or an FSDP1 flat parameter's label) after a
    step of ``microbatches`` backwards, beyond the element-wise
    reduction_slack of a world of more than two ranks. A reused parameter's
    gradient gets reuse_slack per microbatch: each backward's gradient may
    round to another reduce_dtype value than the emulation's (its
    contributions summed in another order), and the accumulation (in
    reduce_dtype under no_sync) carries every such difference on (thorough
    seed 16651: FSDP2, float16, a module shared three ways, three
    microbatches: 8 units of float16 roundoff, passing with two microbatches
    or with float32 reduction)."""
    if is_reused(pred, fqn):
        return PIPELINE_SLACK + reuse_slack(pred) * max(1, microbatches)
    return PIPELINE_SLACK + other_slack(pred)


# Recursive summation of n terms in any order (any binary tree) rounds to
# within gamma_(n-1) * sum |x_i| ~ (n-1) u sum |x_i| of the exact sum (Higham,
# Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 4.4); two
# orders land at most twice that apart. A mean over a world that is not a
# power of two divides with one rounding (u |mean|) on each side. The 1%
# covers the bound's second-order terms.
ORDER_MARGIN = 1.01


def reduction_slack(contributions: list, world_size: int, reduced, u: float):
    """The element-wise distance two summation orders of ``contributions``
    (each rank's gradient, in reduce_dtype) may put between their means
    over ``world_size`` ranks (``reduced``: one of them), ``u`` the unit
    roundoff of reduce_dtype; zeros with two ranks or fewer (any order is
    the same order). Terms a rank does not contribute are zeros: adding one
    is exact.

    Plus, where a contribution is subnormal in reduce_dtype (or becomes so
    halved): FSDP divides each rank's gradient by a power of two before the
    sum (FSDP1 and FSDP2 pre- and post-division against overflow:
    implemented, not documented), which is exact for normal numbers only; a
    subnormal one rounds to its spacing, and the sum may then round the
    other way: one rounding of the mean on each side and the subnormal
    spacing per contribution (thorough seed 71, float16, two ranks: a
    -3.4e-05 contribution moved the mean by one ulp)."""
    if world_size > 2 and len(contributions) >= 2:
        mag = contributions[0].float().abs()
        for c in contributions[1:]:
            mag = mag + c.float().abs()
        exact_division = world_size & (world_size - 1) == 0
        out = 2 * ORDER_MARGIN * (len(contributions) - 1) * u * mag / world_size
        out = out if exact_division else out + 2 * ORDER_MARGIN * u * reduced.float().abs()
    else:
        out = reduced.float().abs() * 0.0
    if len(contributions) < 2:
        return out  # one contribution: its division alone, which rounds as the mean's does
    import torch

    fi = torch.finfo(contributions[0].dtype)
    spacing = fi.tiny * fi.eps  # the subnormal numbers' spacing
    sub = torch.zeros_like(out, dtype=torch.bool)
    for c in contributions:
        sub |= (c != 0) & (c.float().abs() < world_size * fi.tiny)
    extra = 2 * ORDER_MARGIN * u * reduced.float().abs() + len(contributions) * spacing
    return torch.where(sub, out + extra, out)


def emulation_reason(spec: CaseSpec, api: str) -> str:
    if is_model_case(spec):
        return "a real model computes in dtypes of its own between FSDP's boundaries: its pipeline is not emulated"
    if spec.plan.ignored_params or spec.plan.ignored_modules:
        return "ignored parameters are not FSDP's: their pipeline is not emulated"
    return ""


def cast_paths(api: str, pr: Precision | None, fsdp_paths: list[str]) -> set[str]:
    """The canonical paths of the modules whose floating forward inputs the
    promised pipeline casts to param_dtype (none without one). FSDP2: every
    module given to fully_shard unless cast_forward_inputs=False. FSDP1: the
    root where cast_root_forward_inputs ("overriding the value of
    cast_forward_inputs"), every other instance where cast_forward_inputs."""
    if pr is None or pr.param_dtype is None:
        return set()
    if api == "fsdp2":
        return set(fsdp_paths) if pr.cast_forward_inputs is not False else set()
    out = {p for p in fsdp_paths if p} if pr.cast_forward_inputs else set()
    if pr.cast_root_forward_inputs:
        out.add("")
    return out


def effective(pr: Precision | None, api: str) -> dict:
    """The dtypes a precision setting means (docstring defaults applied)."""
    pr = pr or Precision()
    param = pr.param_dtype or F32
    reduce = pr.reduce_dtype or pr.param_dtype or F32
    cast = pr.cast_forward_inputs if pr.cast_forward_inputs is not None else api == "fsdp2"
    root_casts = cast if api == "fsdp2" else pr.cast_root_forward_inputs
    return dict(param=param, reduce=reduce, root_casts=root_casts)


def used_params(spec: CaseSpec, skip: tuple[str, ...]) -> set[str]:
    """Canonical FQNs of the parameters a forward that passes over the
    modules at ``skip`` (spec paths) reads; a real model's: those its
    target's loss gives a gradient (its forward skips nothing)."""
    g = graph_of(spec)
    if is_model_case(spec):
        return {f for f, _ in g.named_parameters()} - params_without_grad(spec.target)
    return g.reads_through(tuple(skip), None)


def frozen_unit_passes_input_through(spec: CaseSpec, frozen: set[str], skip: tuple[str, ...]) -> bool:
    """FSDP1: some non-root unit, every parameter it manages in ``frozen``,
    whose module, in a forward that passes over ``skip``, returns its input
    tensor itself (no parameter or buffer of its own, not a torch layer,
    every child passed over or such a module too). FSDP1 hooks an all-frozen
    unit's reshard on its input's gradient at pre-forward and its
    pre-backward on its output at post-forward: one tensor then."""
    if is_model_case(spec) or spec.plan.api != "fsdp1":
        return False
    g = graph_of(spec)
    skipped = set(skip)
    frozen = set(frozen)  # the step's mask decides requires_grad (the tree's is the wrap-time one)

    def through(nid: str) -> bool:
        node = g.nodes[nid]
        if node.params or node.buffers or g.is_torch(nid, ("Linear", "Embedding", "LayerNorm")):
            return False
        return all((child == (f"{nid}.{name}" if nid else name) and child in skipped) or through(child)
                   for name, child in node.children)

    for u in predict_fsdp1(spec).units:
        if u.path and u.managed and set(u.managed) <= frozen and _runs(u.path, skip) and through(g.resolve_module(u.path)):
            return True
    return False


def units_unsynced_by_last_microbatch(spec: CaseSpec) -> tuple[str, ...]:
    """FSDP1: the units (canonical paths) whose flat parameter a no_sync()
    microbatch of a step gives a gradient while the step's last
    (synchronizing) microbatch gives it none: the no_sync docstring promises
    their accumulated gradient is synchronized by that microbatch, whose
    backward never runs their post-backward hook. A microbatch gives it one
    where it reads a trainable parameter of the unit, or, with
    use_orig_params=True, any parameter of a unit with a trainable one (a
    frozen parameter's forward value is then a view of the flat parameter,
    which requires grad: thorough seed 914417134, the BlockList unit's frozen
    Linear the only one read under no_sync())."""
    if is_model_case(spec) or spec.plan.api != "fsdp1":
        return ()
    units = predict_fsdp1(spec).units
    out: set[str] = set()
    for st in spec.schedule.steps:
        if st.sync_every or len(st.microbatches) < 2:
            continue
        earlier = set().union(*(used_params(spec, mb.skip) for mb in st.microbatches[:-1]))
        last = used_params(spec, st.microbatches[-1].skip)
        for u in units:
            gives_grad = grad_carrying([u], set(u.managed) - set(st.frozen), spec.plan.use_orig_params)
            if gives_grad & earlier and not gives_grad & last:
                out.add(u.path)
    return tuple(sorted(out))


def units_dropping_synced_grad(spec: CaseSpec) -> tuple[str, ...]:
    """FSDP1: the sharded units (canonical paths; NO_SHARD keeps no separate
    sharded gradient) some trainable parameter of which a microbatch of a
    step synchronizing every microbatch uses, while a later microbatch of
    that step runs the unit's forward, its output needing a gradient (a
    trainable parameter read by then), and reads none of the unit's
    trainable parameters. That backward's pre-backward hook moves the
    accumulated sharded gradient into _saved_grad_shard and clears .grad;
    no post-backward hook runs for the unit, and prepare_gradient_for_optim
    forwards _saved_grad_shard to .grad only after a post-backward hook,
    then deletes it: the earlier microbatches' gradient is dropped."""
    if is_model_case(spec) or spec.plan.api != "fsdp1":
        return ()
    out: set[str] = set()
    for st in spec.schedule.steps:
        if not st.sync_every or len(st.microbatches) < 2:
            continue
        frozen = set(st.frozen)
        for u in predict_fsdp1(spec).units:
            trainable = set(u.managed) - frozen
            if not trainable or unit_strategy(spec, u.path) == "NO_SHARD":
                continue
            got_grad = False
            for mb in st.microbatches:
                used = used_params(spec, mb.skip)
                if got_grad and not trainable & used and _runs(u.path, mb.skip) and graph_of(spec).reads_through(mb.skip, u.path) - frozen:
                    out.add(u.path)
                got_grad = got_grad or bool(trainable & used)
    return tuple(sorted(out))


def no_shard_accumulates_synced(spec: CaseSpec) -> bool:
    """FSDP1: some NO_SHARD unit (unit_strategy) with a trainable parameter
    that two microbatches of a step synchronizing every microbatch both use:
    NO_SHARD's post-backward all-reduces the accumulated .grad, the earlier
    microbatches' reduced gradient included, cast to reduce_dtype, where the
    sharded strategies accumulate the reductions in the parameter's dtype."""
    if is_model_case(spec) or spec.plan.api != "fsdp1":
        return False
    units = [u for u in predict_fsdp1(spec).units if unit_strategy(spec, u.path) == "NO_SHARD"]
    for st in spec.schedule.steps:
        if not st.sync_every or len(st.microbatches) < 2:
            continue
        for u in units:
            trainable = set(u.managed) - set(st.frozen)
            if sum(bool(trainable & used_params(spec, mb.skip)) for mb in st.microbatches) > 1:
                return True
    return False


def _no_shard_units(spec: CaseSpec, world_size: int) -> list:
    """FSDP1: the units with parameters that run NO_SHARD: unit_strategy
    says so, or there is one rank (FSDP1 then runs every strategy as
    NO_SHARD)."""
    return [u for u in predict_fsdp1(spec).units if u.managed and (world_size == 1 or unit_strategy(spec, u.path) == "NO_SHARD")]


def _tied_no_shard_units(spec: CaseSpec, world_size: int) -> list:
    """_no_shard_units holding a tied parameter (one with two names)."""
    g = graph_of(spec)
    return [u for u in _no_shard_units(spec, world_size) if any(len(g.aliases(g.resolve_param(f))) > 1 for f in u.managed)]


def no_shard_units_left_unsharded(spec: CaseSpec, world_size: int) -> dict[str, str]:
    """FSDP1, use_orig_params=True: the NO_SHARD units (unit_strategy; every
    unit on one rank, where FSDP1 runs FULL_SHARD as NO_SHARD) that some
    microbatch leaves holding plain-tensor views and that something then
    reads: canonical path -> how the first such microbatch left it. It runs
    the unit's forward, its output needing a gradient, and its backward
    gives the unit's flat parameter none: "unused", it reads none of the
    unit's trainable parameters; "frozen", the unit is all frozen then and
    its input needs no gradient (else FSDP registers its reshard-only hook
    on that input), or it does but an earlier forward-only microbatch (its
    loss needing no gradient) ran the all-frozen unit since the last
    backward: that forward registered the reshard-only hook state on inputs
    no backward reaches, this forward finds it registered and registers
    none, and the backward's final callback only drops the stale state
    (thorough seed 195964: Sequential(Embedding, frozen Linear), the Linear
    a NO_SHARD unit, a microbatch skipping the Embedding between two that
    run it; unfrozen two steps later, its gradient was lost). The
    pre-backward hook unshards the unit (the original
    parameters swapped for plain tensor views); no post-backward hook runs,
    and _catch_all_reshard takes NO_SHARD's flat parameter for already
    resharded: named_parameters() lacks the views. What reads it then:
    - a later microbatch reading a parameter of the unit that is trainable
      there: its gradient lands on the views, not on the parameter the
      optimizer holds;
    - a later microbatch reading a parameter trainable when the unit was
      left and frozen since: the freeze (requires_grad_ on
      named_parameters()) never reaches the unregistered parameter, which
      gets a gradient (thorough seed 539271);
    - the summon_full_params(with_grads=True) that reads the step's
      gradients, where an earlier microbatch of the step gave the unit a
      gradient: it finds no .grad on the registered view, reads the
      gradient as zero and drops it from the flat gradient (thorough seed
      539271: 0.weight's gradient 0, the optimizer then steps without it;
      steps synchronizing every microbatch: an unsynchronized gradient left
      so is fsdp1-no-sync-unit-unused-in-last-microbatch's).
    A low param_dtype unshards into a buffer of its own, which the check
    does see (the unused form's corpus case with param_dtype bfloat16
    passes on gloo)."""
    pr = spec.schedule.precision
    if is_model_case(spec) or spec.plan.api != "fsdp1" or not spec.plan.use_orig_params or (pr is not None and pr.param_dtype not in (None, "float32")):
        return {}
    out: dict[str, str] = {}
    for u in _no_shard_units(spec, world_size):
        managed = set(u.managed)
        left, left_trainable = None, set()
        # the unit's hook state since the last backward: None (none), else
        # whether its flat parameter was trainable at the forward-only
        # microbatch that registered it (FSDP registers once; False: the
        # reshard-only hook, on inputs no backward reaches)
        registered: bool | None = None
        for st in spec.schedule.steps:
            frozen = set(st.frozen)
            gradient = False  # a microbatch of this step gave the unit a gradient
            for mb in st.microbatches:
                used = used_params(spec, mb.skip)
                read = managed & used
                if left and (read - frozen or read & frozen & left_trainable):
                    out[u.path] = left
                    break
                how = _leaves_unsharded(spec, u, frozen, mb.skip, stale=registered is False)
                if how and gradient:
                    out[u.path] = how
                    break
                if how and not left:
                    left, left_trainable = how, managed - frozen
                gradient = gradient or (st.sync_every and bool(read - frozen))  # a synchronized one: not the no_sync() finding's
                if used - frozen:  # a backward: its final callback drops every unit's hook state
                    registered = None
                elif _runs(u.path, mb.skip) and registered is None:
                    registered = bool(managed - frozen)
            if u.path in out:
                break
    return dict(sorted(out.items()))


def _leaves_unsharded(spec: CaseSpec, u, frozen: set[str], skip: tuple[str, ...], stale: bool = False) -> str | None:
    """How a microbatch (its frozen set and skips) leaves the NO_SHARD unit
    ``u`` holding plain-tensor views (see no_shard_units_left_unsharded):
    "unused", "frozen", or None where it does not. ``stale``: the unit's
    reshard-only hook state is left from a forward-only microbatch."""
    trainable = set(u.managed) - frozen
    used = used_params(spec, skip)
    if not _runs(u.path, skip) or trainable & used or not graph_of(spec).reads_through(skip, u.path) - frozen:
        return None
    if trainable:
        return "unused"
    if stale or not graph_of(spec).reads_through(skip, u.path, before=True) - frozen:
        return "frozen"
    return None


def no_shard_tied_left_unsharded(spec: CaseSpec, world_size: int) -> set[str]:
    """FSDP1, use_orig_params=True: how NO_SHARD units holding a tied
    parameter (two names) are left holding plain-tensor views by a
    microbatch that runs them ("unused" or "frozen", as in
    no_shard_units_left_unsharded: no post-backward hook runs, and
    _catch_all_reshard takes the flat parameter for already resharded).
    Whatever re-registers the views next asserts: the summon_full_params
    the step ends with (the gradients' with_grads=True read, or the
    values'), or a later microbatch's forward, whose post-forward reshard
    of a NO_SHARD unit is _use_sharded_views ->
    _use_unsharded_views(as_params=True). That re-registers the tied name
    from its primary, which is a plain tensor, and asserts ("as_params=True
    type(prim_param)=<class 'torch.Tensor'>"). "frozen": ci seed 777123;
    "unused" (a BlockList unit whose microbatch skips both its tied
    Linears): thorough seed 539271; "unused" by a step's first microbatch,
    the next one's forward asserting: thorough seed 191916010 (a torch-only
    torchrun reduction asserts the same, untied or FULL_SHARD it trains). A
    low param_dtype unshards into a buffer of its own, and the summon does
    not assert (the corpus case with param_dtype bfloat16 trains, checked on
    gloo)."""
    pr = spec.schedule.precision
    if is_model_case(spec) or spec.plan.api != "fsdp1" or not spec.plan.use_orig_params or (pr is not None and pr.param_dtype not in (None, "float32")):
        return set()
    out = set()
    for u in _tied_no_shard_units(spec, world_size):
        for st in spec.schedule.steps:
            for mb in st.microbatches:
                if _runs(u.path, mb.skip) and (how := _leaves_unsharded(spec, u, set(st.frozen), mb.skip)):
                    out.add(how)
    return out


def no_shard_unfrozen_stale_mask(spec: CaseSpec, world_size: int) -> tuple[str, ...]:
    """FSDP1, use_orig_params=True: the parameters (canonical FQNs) of NO_SHARD
    units (unit_strategy; every unit on one rank) whose no_sync() gradient a
    step drops after they were frozen and unfrozen. While a parameter is
    frozen and its unit has a gradient (a microbatch read one of the unit's
    trainable parameters), the next unshard's write-back (a later
    microbatch's forward, or the summon_full_params(with_grads=True) that
    reads the step's gradients, absent keep_low_precision_grads) finds its
    .grad None, zeroes its slice of the flat gradient and sets its
    _is_grad_none_mask entry. Only a synchronizing post-backward with the
    parameter trainable resets the entry (_reset_is_grad_none). Once
    unfrozen, a no_sync() microbatch that reads it, followed by a microbatch
    that runs the unit, loses that gradient: the reshard's
    _use_sharded_grad_views reads the stale mask and sets .grad to None, and
    the next write-back zeroes the slice."""
    pr = spec.schedule.precision
    if is_model_case(spec) or spec.plan.api != "fsdp1" or not spec.plan.use_orig_params:
        return ()
    summons = not (pr is not None and pr.keep_low_precision_grads)  # the adapter's full_grads
    out: set[str] = set()
    for u in _no_shard_units(spec, world_size):
        for p in u.managed:
            masked = False
            for st in spec.schedule.steps:
                frozen = set(st.frozen)
                trainable = set(u.managed) - frozen
                last = len(st.microbatches) - 1
                if p in frozen:
                    graded = False  # the unit holds a gradient by now
                    for mb in st.microbatches:
                        if graded and _runs(u.path, mb.skip):
                            masked = True
                        graded = graded or bool(trainable & used_params(spec, mb.skip))
                    masked = masked or (graded and summons)
                    continue
                if not masked:
                    continue
                for k, mb in enumerate(st.microbatches):
                    used = used_params(spec, mb.skip)
                    if not trainable & used:
                        continue  # no post-backward for the unit
                    if st.sync_every or k == last:
                        masked = False  # _reset_is_grad_none
                        break
                    if p in used and any(_runs(u.path, later.skip) for later in st.microbatches[k + 1:]):
                        out.add(p)
                        break
    return tuple(sorted(out))


def no_shard_unsynced_tied_low_precision(spec: CaseSpec, world_size: int) -> bool:
    """FSDP1, use_orig_params=True, a low param_dtype (without
    keep_low_precision_grads, fsdp1-keep-low-precision-grads-tied-param's
    ground): a NO_SHARD unit (unit_strategy; every unit on one rank) holding
    a tied parameter gets a gradient in a no_sync() microbatch, and a later
    microbatch of the step runs the unit. The no_sync() post-backward
    exposes the unsharded low-precision gradient through the views (the
    .data work-around); NO_SHARD's next reshard (_use_sharded_grad_views)
    re-points the tied name's gradient with a plain assignment, which
    raises on the dtype mismatch. The sharded strategies expose no sharded
    gradient there."""
    pr = spec.schedule.precision
    if is_model_case(spec) or spec.plan.api != "fsdp1" or not spec.plan.use_orig_params:
        return False
    if pr is None or pr.param_dtype in (None, "float32") or pr.keep_low_precision_grads:
        return False
    for u in _tied_no_shard_units(spec, world_size):
        for st in spec.schedule.steps:
            if st.sync_every:
                continue
            trainable = set(u.managed) - set(st.frozen)
            for k, mb in enumerate(st.microbatches[:-1]):
                if trainable & used_params(spec, mb.skip) and any(_runs(u.path, later.skip) for later in st.microbatches[k + 1:]):
                    return True
    return False


def unsynced_no_shard_frozen(spec: CaseSpec) -> bool:
    """FSDP1, use_orig_params=True: a NO_SHARD unit left unsynchronized by a
    step's last microbatch (units_unsynced_by_last_microbatch) holds a
    parameter frozen in that step: the no_sync() post-backward gave every
    parameter of the unit a view of the unreduced gradient
    (_use_unsharded_grad_views), the frozen one too, and no synchronizing
    post-backward takes it back: the frozen parameter has a gradient and the
    optimizer steps it."""
    if is_model_case(spec) or spec.plan.api != "fsdp1" or not spec.plan.use_orig_params:
        return False
    unsynced = set(units_unsynced_by_last_microbatch(spec))
    for u in predict_fsdp1(spec).units:
        if u.path in unsynced and unit_strategy(spec, u.path) == "NO_SHARD":
            if any(set(u.managed) & set(st.frozen) for st in spec.schedule.steps if not st.sync_every and len(st.microbatches) > 1):
                return True
    return False


def _runs(path: str, skip: tuple[str, ...]) -> bool:
    """The module at ``path`` runs in a microbatch that passes over ``skip``."""
    return not any(path == s or path.startswith(s + ".") for s in skip)


def stale_hook_states(spec: CaseSpec) -> set[str]:
    """FSDP1: a unit's forward registers its post-backward hook state once
    (a trainable flat parameter: a hook on that forward's AccumulateGrad; an
    all-frozen one: the reshard-only hook), and only a backward's final
    callback clears it, asserting it was registered for the flat parameter's
    requires_grad then. A forward-only microbatch (its loss needs no
    gradient) registers a state no backward of its own clears; the next
    backward meets it:
    - "changed": registered in the other requires_grad (a step froze or
      unfroze the unit in between): the final callback's assertion;
    - "kept": registered trainable and trainable still: the next backward
      reuses the earlier forward's hook (under param_dtype, on an
      AccumulateGrad that backward does not reach)."""
    if is_model_case(spec) or spec.plan.api != "fsdp1":
        return set()
    out: set[str] = set()
    for u in predict_fsdp1(spec).units:
        if not u.managed:
            continue
        state = None  # (requires_grad when registered, registered in a forward-only microbatch)
        for st in spec.schedule.steps:
            trainable = bool(set(u.managed) - set(st.frozen))
            for mb in st.microbatches:
                backward = bool(used_params(spec, mb.skip) - set(st.frozen))
                if state is None and _runs(u.path, mb.skip):
                    state = (trainable, not backward)
                if backward:
                    if state is not None and state[1] and state[0] != trainable:
                        out.add("changed")
                    elif state is not None and state[1] and trainable:
                        out.add("kept")
                    state = None
    return out


def group_unrun_under_no_sync(spec: CaseSpec, groups) -> bool:
    """FSDP2: a non-root group none of whose modules runs in some microbatch
    with gradient sync disabled (every microbatch of a step but its last,
    unless the step synchronizes each). ``groups``: the FSDP2 prediction's."""
    if is_model_case(spec):
        return False
    for st in spec.schedule.steps:
        unsynced = () if st.sync_every else st.microbatches[:-1]
        for mb in unsynced:
            if any(not grp.root and grp.managed and not any(_runs(m, mb.skip) for m in grp.modules) for grp in groups):
                return True
    return False


def group_mixes_accumulated_and_fresh(spec: CaseSpec, groups) -> bool:
    """FSDP2: in a step with gradient sync disabled but in its last
    microbatch, a group some trainable parameter of which the unsynced
    microbatches use (its gradient accumulated, in reduce_dtype) while the
    last microbatch uses another they do not (a fresh gradient, in
    param_dtype): the synchronizing reduce-scatter gets both."""
    if is_model_case(spec):
        return False
    for st in spec.schedule.steps:
        if st.sync_every or len(st.microbatches) < 2:
            continue
        earlier = set().union(*(used_params(spec, mb.skip) for mb in st.microbatches[:-1]))
        last = used_params(spec, st.microbatches[-1].skip)
        for grp in groups:
            trainable = set(grp.managed) - set(st.frozen)
            if trainable & earlier and (trainable & last) - earlier:
                return True
    return False


def unit_strategy(spec: CaseSpec, path: str) -> str:
    """FSDP1: the ShardingStrategy name of the unit at ``path`` (canonical):
    a CustomWrap policy's kwargs may give a unit its own; the rest inherit
    the root's, the schedule's sharding_strategy (FULL_SHARD by default).
    The root unit is the constructor's, wrapped with the root's kwargs
    whatever the policy's lambda returns for it (as WRAP-KWARGS expects:
    _construct_wrap_fn wraps only modules that are not the root; thorough
    seed 2511518773, torch 2.13.0: kwargs FULL_SHARD for '' under a
    NO_SHARD root, whose unit ran NO_SHARD)."""
    pol = spec.plan.policy
    if spec.plan.api == "fsdp1" and isinstance(pol, CustomWrap):
        g = graph_of(spec)
        unit = g.resolve_module(path)
        for t, kw in pol.kwargs:
            for k, v in kw:
                if k == "sharding_strategy" and unit != "" and g.resolve_module(t) == unit:
                    return v
    return spec.schedule.sharding_strategy if spec.schedule is not None else "FULL_SHARD"


def unused_in_used_unit(spec: CaseSpec) -> tuple[tuple[str, ...], ...]:
    """FSDP1, per step of the schedule: see SchedulePrediction."""

    units = [set(u.managed) for u in predict_fsdp1(spec).units]
    out = []
    for st in spec.schedule.steps:
        read = set().union(*(used_params(spec, mb.skip) for mb in st.microbatches))
        zero: set[str] = set()
        for managed in units:
            trainable = managed - set(st.frozen)
            # the unit is used when the step reads any of its parameters, a
            # frozen one too: FSDP1's forward reads them as views of the
            # unsharded FlatParameter, which needs a gradient when any of its
            # parameters does, so it gets one (ci seed 11530, torch 2.13.0:
            # a frozen proj0.weight read, the unit's only trainable proj1.bias
            # skipped, and SGD's momentum moved proj1.bias; with proj0 skipped
            # too it stayed)
            if trainable and managed & read:
                zero |= trainable - read
        out.append(tuple(sorted(zero)))
    return tuple(out)


def lowest(*dtypes: str) -> str:
    return max(dtypes, key=lambda d: TOLERANCE[d])


@functools.lru_cache(maxsize=256)
def predict_schedule(spec: CaseSpec) -> SchedulePrediction:
    s = spec.schedule
    api = spec.plan.api
    pr = s.precision or Precision()
    e = effective(pr, api)
    g = graph_of(spec)
    names = tuple(f for f, _ in g.named_parameters())
    why = ""
    if api == "fsdp1" and not spec.plan.use_orig_params and len({st.frozen for st in s.steps}) > 1:
        why = "FSDP1 with use_orig_params=False flattens parameters: requires_grad cannot change after wrapping"
    if not why and is_model_case(spec) and e["param"] != F32:
        # FSDP casts parameters (FSDP1 buffers too); the model's own
        # arithmetic must run in those dtypes
        err = runs_in(spec.target, e["param"], pr.buffer_dtype if api == "fsdp1" else None)
        if err:
            why = f"the unsharded model itself does not run with parameters in {e['param']}: {err}"
    if api == "fsdp1":
        # keep_low_precision_grads: "keeps the gradients in the dtype used for gradient reduction"
        grad = e["reduce"] if pr.keep_low_precision_grads else F32
        buffer = pr.buffer_dtype or F32
    else:
        grad, buffer = F32, F32  # FSDP2: the sharded parameter's dtype; buffers are not FSDP2's
    low = lowest(e["param"], e["reduce"], grad, pr.output_dtype or F32, pr.buffer_dtype or F32)
    return SchedulePrediction(
        api=api,
        applicable=why,
        input_dtype=F32 if e["root_casts"] else e["param"],
        compute_dtype=e["param"],
        reduce_dtype=e["reduce"],
        grad_dtype=grad,
        buffer_dtype=buffer,
        output_dtype=pr.output_dtype,
        tolerance=TOLERANCE[low],
        compare_params=low == F32 or s.optimizer == "SGD",
        frozen_by_step=tuple(tuple(st.frozen) for st in s.steps),
        trainable=names,
        unused_in_used_unit=unused_in_used_unit(spec) if api == "fsdp1" and not why else (),
        reference_zero_grads=api == "fsdp1" and not spec.plan.use_orig_params,
        emulation=why or emulation_reason(spec, api),
        reused=bool(spec.ties or spec.shared) or any(m.steps != (MethodStep("forward"),) for m in spec.methods),
        reused_params=tuple(sorted(g.param_fqn[pid] for pid in g.param_info if len(g.aliases(pid)) > 1)),
        # a method that only calls forward once computes what forward does
        reuse_all=any(m.steps != (MethodStep("forward"),) for m in spec.methods),
        unit_params=tuple((u.path, tuple(u.managed)) for u in predict_fsdp1(spec).units) if api == "fsdp1" and not why else (),
    )
