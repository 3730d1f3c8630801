"""COMM-COUNTS, COMM-ORDER (FSDP2), COMM-FSDP1-COUNTS, COMM-FSDP1-PREFETCH:
what FSDP communicates in each iteration, collective by collective, and in
which order, against the oracle (conformance.areas.comm.oracle)."""

from __future__ import annotations

from collections import Counter

from conformance.areas.comm.observation import CommObservation
from conformance.areas.comm.oracle import CommPrediction, Expected, refreeze_tags
from conformance.areas.common.catalog import Catalog, NotChecked
from conformance.areas.common.comm_checks import collective_key, compare_collectives, compare_events
from conformance.areas.common.fsdp2_oracle import container_given_to_fully_shard
from conformance.areas.common.violations import violation
from conformance.case.spec import CaseSpec
from conformance.case.violation import Violation

catalog = Catalog()

UPSTREAM = "pytorch test/distributed/_composable/fsdp/test_fully_shard_comm.py"
DOC_RESHARD = "fully_shard docstring (reshard_after_forward: True / False / None / int)"
DOC_MP = "MixedPrecisionPolicy / MixedPrecision docstrings (param_dtype: the all-gather; reduce_dtype: the reduction)"
DOC_PREFETCH = "FSDPModule.set_modules_to_forward_prefetch / set_modules_to_backward_prefetch docstrings"
DOC_FSDP1 = "FullyShardedDataParallel docstring (sharding_strategy, backward_prefetch, forward_prefetch, limit_all_gathers); BackwardPrefetch docstring"


def case_tags(spec: CaseSpec, obs: CommObservation) -> set[str]:
    c = spec.comm
    tags = {f"api:{spec.plan.api}", f"world:{'1' if obs.world_size == 1 else 'n'}"}
    if c.param_dtype or c.reduce_dtype:
        tags.add("mixed-precision")
    if spec.plan.api == "fsdp2":
        rafs = {g.reshard_after_forward for g in spec.plan.groups}
        tags |= {f"reshard:{'int' if isinstance(r, int) and not isinstance(r, bool) else str(r).lower()}" for r in rafs}
        if c.forward_prefetch:
            tags.add("prefetch:forward-explicit")
        if c.backward_prefetch:
            tags.add("prefetch:backward-explicit")
        if container_given_to_fully_shard(spec):
            tags.add("container-subclass")  # a ModuleList/ModuleDict subclass with a forward, given to fully_shard
    else:
        tags |= {f"strategy:{c.sharding_strategy}", f"backward_prefetch:{c.fsdp1_backward_prefetch}",
                 f"uop:{str(spec.plan.use_orig_params).lower()}"}
        if c.fsdp1_forward_prefetch:
            tags.add("forward_prefetch")
        if c.fsdp1_no_sync:
            tags.add("no_sync")
    tags |= refreeze_tags(spec)
    return tags


# what FSDP raised, as the tags the recorded findings name
ERRORS = {
    "attempting to assign a gradient with dtype": "error:grad-dtype-mismatch",
}


def _expected(pred: CommPrediction, obs: CommObservation) -> Expected | NotChecked:
    exp = pred.expect(obs.world_size)
    if exp.why:
        return NotChecked(exp.why)
    return exp


def _raised(inv: str, obs: CommObservation, tags: set[str]) -> list[Violation]:
    if not obs.error:
        return []
    return [violation(inv, f"FSDP raised ({obs.error})", tags, "kind:raised", *(t for frag, t in ERRORS.items() if frag in obs.error))]


def _check_counts(inv: str, spec: CaseSpec, pred: CommPrediction, obs: CommObservation) -> list[Violation] | NotChecked:
    exp = _expected(pred, obs)
    if isinstance(exp, NotChecked):
        return exp
    tags = case_tags(spec, obs)
    return _raised(inv, obs, tags) + compare_collectives(inv, exp, obs, tags)


@catalog.invariant(
    "COMM-COUNTS",
    group="comm",
    api="fsdp2",
    scenario="comm",
    statement="Each iteration, every FSDP2 parameter group issues exactly the oracle's collectives: one all-gather in forward, one in backward where reshard_after_forward reshards (over the int's ranks for an int), one reduce-scatter of its trainable parameters only (none for a frozen group; trainable as requires_grad says in that iteration, after a freeze or unfreeze following an iteration that ran a backward), no all-reduce; each with the promised numel, ranks and dtype (param_dtype for all-gathers, reduce_dtype for reductions); a one-rank mesh issues none.",
    source=f"{DOC_RESHARD}; {DOC_MP}; {UPSTREAM} (test_fully_shard_communication_count, test_set_reshard_after_forward); test_fully_shard_frozen.py (reduce-scatter numel = trainable numel)",
)
def check_counts(spec: CaseSpec, pred: CommPrediction, obs: CommObservation) -> list[Violation] | NotChecked:
    return _check_counts("COMM-COUNTS", spec, pred, obs)


@catalog.invariant(
    "COMM-ORDER",
    group="comm",
    api="fsdp2",
    scenario="comm",
    statement="Each iteration's sequence of FSDP2 unshard / reshard / post-backward events (with the group's training state) equals the oracle's: unshard on a group's first pre-forward, explicit forward prefetches right after it, reshard after forward as reshard_after_forward says; in backward the pre-backward unshard, then the explicit backward prefetches or else the group before it in post-forward order, post-backward (with its reshard) once each group's inputs have their gradients, the rest in the root's final callback.",
    source=f"{DOC_PREFETCH} (the default \"prefetches the next FSDP module based on the reverse post-forward order\"); {UPSTREAM} (TestFullyShardPrefetch: test_fully_shard_backward_prefetch, test_set_modules_to_forward_prefetch, test_set_modules_to_backward_prefetch)",
)
def check_order(spec: CaseSpec, pred: CommPrediction, obs: CommObservation) -> list[Violation] | NotChecked:
    exp = _expected(pred, obs)
    if isinstance(exp, NotChecked):
        return exp
    if exp.order_why:
        return NotChecked(exp.order_why)
    tags = case_tags(spec, obs)
    out = _raised("COMM-ORDER", obs, tags)
    out += compare_events("COMM-ORDER", exp, obs, tags)
    return out


@catalog.invariant(
    "COMM-FSDP1-COUNTS",
    group="comm",
    api="fsdp1",
    scenario="comm",
    statement="Each iteration, every FSDP1 unit issues exactly the oracle's collectives whatever backward_prefetch, forward_prefetch and limit_all_gathers say: an all-gather in forward (sharded strategies), one in backward where FULL_SHARD freed the parameters after forward (never the root's), a reduce-scatter of its flat parameter (an all-reduce under NO_SHARD) when it has a trainable parameter in that iteration (use_orig_params=True: after a freeze or unfreeze following an iteration that ran a backward, as requires_grad then says; a unit frozen whole sends none), none inside no_sync(), where SHARD_GRAD_OP also keeps the unsharded parameters after backward (the next forward gathers nothing); numel the padded flat parameter, dtypes param_dtype and reduce_dtype.",
    source=f"{DOC_FSDP1}; FullyShardedDataParallel.no_sync docstring (gradients accumulate and are synchronized in the first forward-backward after it); MixedPrecision docstring; test/distributed/fsdp/test_fsdp_comm.py (upstream: communication counts per sharding strategy, with and without no_sync)",
)
def check_fsdp1_counts(spec: CaseSpec, pred: CommPrediction, obs: CommObservation) -> list[Violation] | NotChecked:
    return _check_counts("COMM-FSDP1-COUNTS", spec, pred, obs)


@catalog.invariant(
    "COMM-FSDP1-PREFETCH",
    group="comm",
    api="fsdp1",
    scenario="comm",
    statement="Each FSDP1 all-gather is issued where the prefetch settings say: a unit's own in its pre-forward or pre-backward hook unless prefetched; with BACKWARD_PRE the previous unit in post-forward order's in the current unit's pre-backward hook (before its gradient computation), with BACKWARD_POST in its post-backward hook (after it), with None never early; with forward_prefetch, from the second iteration, the next unit's in the current unit's pre-forward; all-gathers in the oracle's order.",
    source=f"{DOC_FSDP1} (BACKWARD_PRE: \"prefetches the next set of parameters before the current set of parameters' gradient computation\"; BACKWARD_POST: after it; forward_prefetch: \"explicitly prefetches the next upcoming all-gather while executing in the forward pass\")",
)
def check_fsdp1_prefetch(spec: CaseSpec, pred: CommPrediction, obs: CommObservation) -> list[Violation] | NotChecked:
    exp = _expected(pred, obs)
    if isinstance(exp, NotChecked):
        return exp
    tags = case_tags(spec, obs)
    out = _raised("COMM-FSDP1-PREFETCH", obs, tags)
    compared = False
    for i, (want, got) in enumerate(zip(exp.iterations, obs.iterations)):
        if Counter(collective_key(c) for c in want.collectives) != Counter(collective_key(c) for c in got.collectives):
            continue  # COMM-FSDP1-COUNTS reports what differs; the order of different sets means nothing
        compared = True
        # the all-gathers only: when a reduce-scatter runs is autograd's
        # business (the post-backward hook fires when the gradient is ready)
        w = [(c.phase, c.op, c.group, c.context) for c in want.collectives if c.op == "all_gather"]
        g = [(c.phase, c.op, c.group, c.context) for c in got.collectives if c.op == "all_gather"]
        if all(_same(a, b) for a, b in zip(w, g)) and len(w) == len(g):
            continue
        k = next(j for j, (a, b) in enumerate(zip(w, g)) if not _same(a, b))
        kind = "kind:context" if w[k][:3] == g[k][:3] else "kind:order"
        if _not_prefetched(w[k], g[k:]):
            kind = "kind:not-prefetched"
        out.append(violation("COMM-FSDP1-PREFETCH", f"iteration {i}: collective {k} is {_fmt1(g[k])}, promised {_fmt1(w[k])} "
                                                   f"(promised {[_fmt1(x) for x in w]}, seen {[_fmt1(x) for x in g]})", tags, kind))
    if not compared and not out:
        return NotChecked("the collectives differ from the promised ones in every iteration (COMM-FSDP1-COUNTS)")
    return out


def _not_prefetched(want, rest) -> bool:
    """The promised all-gather ``want`` is a prefetch (issued in another
    unit's hook), and from the first difference on (``rest``, the seen
    all-gathers from there) every unit all-gathers in its own pre-backward
    hook, ``want``'s unit among them: nothing was prefetched there. Where
    the prefetched unit is not the next in the hooks' own order
    (BACKWARD_POST's target is the previous unit in post-forward order: a
    parent after its nested child), the first difference is another unit's
    own all-gather. A prefetch of another unit instead (off by one) is an
    order, not this."""
    own = f"pre_backward {want[2]}"
    if own in want[3].split(" or "):
        return False  # its own hook was promised: not a prefetch
    for c in rest:
        if c[3] != f"pre_backward {c[2]}":
            return False  # something was prefetched (or gathered elsewhere) before want's unit gathered
        if c[:3] == want[:3]:
            return True
    return False


def _same(want, got) -> bool:
    """An all-gather where promised; a promised context "A or B" (a
    prefetch the docs leave to autograd's hook order) is met by either."""
    return want[:3] == got[:3] and got[3] in want[3].split(" or ")


def _fmt1(c) -> str:
    return f"{c[1]} {c[2] or '<root>'} in {c[3] or '?'}"


INVARIANTS = tuple(catalog.invariants)
