"""FSDP2 invariants: parameter groups, frozen parameters, parameters shared
between groups."""

from __future__ import annotations

from collections import Counter

from conformance.invariants.catalog import invariant
from conformance.observations import FSDP2Observation
from conformance.oracle.fsdp2 import TIE_CHECK_SINCE, FSDP2Prediction
from conformance.case.spec import CaseSpec
from conformance.case.violation import Violation
from conformance.case.violation import set_diff as _diff

DOC_FULLY_SHARD = "fully_shard docstring (parameter groups: module.parameters() less those assigned by earlier calls; reshard_after_forward; the list form)"
DOC_REGISTER = "register_fsdp_forward_method docstring"
TIE_MARKS = ("shared", "tied", "fully_shard([")


def case_tags(spec: CaseSpec, pred: FSDP2Prediction) -> set[str]:
    """Facts about an FSDP2 case that known_failures.toml entries match on."""
    tags = {"api:fsdp2"}
    if pred.split_ties:
        tags.add("tie:split")
    elif pred.tied:
        tags.add("tie:grouped")
    if spec.shared or pred.shared_modules:
        tags.add("shared-module")
    if pred.resharded:
        tags.add("group:resharded")  # fully_shard given a module an earlier group already holds
    if any(g.mixed for g in pred.groups):
        tags.add("frozen:mixed-group")
    if any(len(g.modules) > 1 for g in pred.groups):
        tags.add("group:multi")
    if any(len(g.modules) > 1 and g.reshard and any(_frozen_embedding(spec, m) for m in g.modules) for g in pred.groups):
        # a list group with a module whose output needs no gradient (the case
        # looks a frozen Embedding up with constant indices)
        tags.add("group:multi-frozen-embedding")
    if any(len(g.modules) > 1 for g in pred.groups) and group_rerun_after_frozen_embedding(spec, pred.groups, _frozen_fqns(spec)):
        tags.add("group:rerun-after-frozen-embedding")  # see that function
    if any(len(g.modules) > 1 and not g.reshard and any(_frozen_embedding(spec, m) for m in g.modules) and _runs_twice(spec, g.modules)
           for g in pred.groups):
        # the same, reshard_after_forward=False: the group runs twice in one
        # forward (a module of it registered under two names)
        tags.add("group:multi-frozen-embedding-rerun")
    if any(c.root_group_partial for c in pred.calls):
        # a call whose first FSDP group is a list group it runs only in part
        # (fsdp2-list-group-partial-call-stays-unsharded)
        tags.add("group:multi-partial-root")
    fsdp = set(pred.fsdp_paths)  # every name of those modules
    if getattr(spec, "target", None) is not None:  # a ModelCase: its methods' bodies are the model's
        from conformance.case.target import methods_calling_forward

        if "" in fsdp and any(m.register and m.name in methods_calling_forward(spec.target) for m in spec.methods):
            tags.add("method-calls-self")
    if any(_container_base(spec, path) for path in fsdp):
        tags.add("container-subclass")  # a ModuleList/ModuleDict subclass with a forward, given to fully_shard
    called = {c.method for c in spec.calls}
    if any(i in called and m.register and m.module in fsdp and any(s.op == "call" for s in m.steps) for i, m in enumerate(spec.methods)):
        tags.add("method-calls-self")  # a registered method that runs its module's forward hooks inside
    return tags


def backend_tag(obs) -> str:
    """The process group's backend, for the invariants that compare values with
    the reference (PARITY, MP-DTYPES, ACCUM, FSDP2-FROZEN, FWD-PARITY, FWD-ISOLATION): a known failure
    of one backend's collectives must not mask the others'."""
    return f"backend:{obs.backend}"


def _frozen_fqns(spec: CaseSpec) -> set[str]:
    """Canonical FQNs of the parameters the case builds frozen."""
    from conformance.case.target import graph_of

    g = graph_of(spec)
    return {g.param_fqn[pid] for pid in g.param_fqn if not g.requires_grad(pid)}


def _frozen_embedding(spec: CaseSpec, path: str) -> bool:
    """The module at ``path`` is an Embedding whose parameters are all frozen:
    its output needs no gradient (the indices never do)."""
    from conformance.case.target import graph_of

    g = graph_of(spec)
    try:
        nid = g.resolve_module(path)
    except KeyError:
        return False
    node = g.nodes[nid]
    return g.is_torch(nid, ("Embedding",), exact=True) and bool(node.params) and not any(g.requires_grad(pid) for _, pid in node.params)

def forward_calls(spec: CaseSpec, skip: tuple[str, ...] = ()) -> list[str]:
    """Node ids of the modules whose forward (and so whose FSDP hooks) the
    case's generic forward runs, in order, with multiplicity: a module
    registered under two parents runs once per parent; torch's own containers
    are walked, not called (conformance.case.build.call_child). ``skip``: spec paths
    a microbatch passes over (as conformance.oracle.schedule.used_params)."""
    from conformance.case.target import graph_of

    g = graph_of(spec)
    containers = ("ModuleList", "ModuleDict", "Sequential")
    skipped, out = set(skip), []

    def visit(nid: str, stack: tuple[str, ...]) -> None:
        if nid in stack:
            return  # a module that holds itself: never built
        if not g.is_torch(nid, containers, exact=True):
            out.append(nid)
        for name, child in g.nodes[nid].children:
            tree_child = child == (f"{nid}.{name}" if nid else name)
            if not (tree_child and child in skipped):
                visit(child, stack + (nid,))

    visit("", ())
    return out


def group_rerun_after_frozen_embedding(spec: CaseSpec, groups, frozen: set[str], skip: tuple[str, ...] = ()) -> bool:
    """A list group (fully_shard([a, b])) one of whose modules runs forward
    again after every module of the group has run, where the module whose
    forward completed the group is an Embedding whose parameters are all in
    ``frozen`` (canonical FQNs): its output needs no gradient, so the group's
    pre-backward hook sits on nothing the earlier runs' backward passes
    through (known failure fsdp2-list-group-reentered-loses-grad). ``groups``:
    the FSDP2 prediction's groups (canonical module paths)."""
    if getattr(spec, "tree", None) is None:  # a ModelCase: its own forward, order unknown
        return False
    from conformance.case.target import graph_of

    g = graph_of(spec)
    calls = forward_calls(spec, skip)
    for grp in groups:
        if len(grp.modules) < 2:
            continue
        try:
            members = {g.resolve_module(m) for m in grp.modules}
        except KeyError:
            continue
        remaining: set[str] = set()
        completed_by: str | None = None
        for nid in calls:
            if nid not in members:
                continue
            if not remaining:  # FSDP refills the group's to-run set at the first module of a pass
                if completed_by is not None:
                    node = g.nodes[completed_by]
                    if g.is_torch(completed_by, ("Embedding",)) and node.params and all(g.param_fqn[pid] in frozen for _, pid in node.params):
                        return True
                remaining = set(members)
            remaining.discard(nid)
            if not remaining:
                completed_by = nid
    return False
def _runs_twice(spec: CaseSpec, paths) -> bool:
    """Some module at ``paths`` has two names: the case's forward calls it
    under each."""
    from conformance.case.target import graph_of

    g = graph_of(spec)
    try:
        return any(len(g.module_aliases(g.resolve_module(p))) > 1 for p in paths)
    except KeyError:
        return False


def _container_base(spec: CaseSpec, path: str) -> bool:
    from conformance.case.spec import SpecError, module_at

    if getattr(spec, "tree", None) is None:  # a ModelCase: the target's own classes
        return False
    try:
        cls = module_at(spec.tree, path).cls
    except SpecError:
        return False
    return any(c.name == cls and c.base in ("ModuleList", "ModuleDict") for c in spec.classes)


def _v(inv: str, msg: str, tags: set[str], *extra: str) -> Violation:
    return Violation(inv, msg, frozenset(tags | set(extra)))


def applies(pred: FSDP2Prediction) -> bool:
    """The case is within what FSDP2 promises and not rejected for a split tie."""
    return not pred.supported and not (pred.split_ties and pred.tie_check)


@invariant(
    "FSDP2-GROUPS",
    area="fsdp2",
    api="fsdp2",
    scenario="fsdp2",
    statement="fully_shard applied bottom-up makes one parameter group per call, holding the parameters of module.parameters() not assigned by an earlier call on a submodule nor passed as ignored_params.",
    source=DOC_FULLY_SHARD,
)
def check_groups(spec: CaseSpec, pred: FSDP2Prediction, obs: FSDP2Observation) -> list[Violation]:
    if not applies(pred):
        return []
    tags = case_tags(spec, pred)
    if obs.wrap_error:
        return [_v("FSDP2-GROUPS", f"fully_shard raised {obs.wrap_error}", tags, "kind:raised")]
    got = {frozenset(g.modules): g for g in obs.groups}
    out = []
    for g in pred.groups:
        key = frozenset(g.modules)
        where = ", ".join(m or "<root>" for m in g.modules)
        if key not in got:
            out.append(_v("FSDP2-GROUPS", f"no FSDP state holds exactly the modules [{where}]", tags, "kind:missing-group"))
            continue
        managed = got.pop(key).managed
        if Counter(managed) != Counter(set(managed)):
            out.append(_v("FSDP2-GROUPS", f"group [{where}] manages a parameter twice: {sorted(f for f, n in Counter(managed).items() if n > 1)}", tags, "kind:duplicated"))
        if set(managed) != set(g.managed):
            out.append(_v("FSDP2-GROUPS", f"group [{where}]: {_diff(set(managed), set(g.managed))}", tags, "kind:managed"))
    for key in got:
        out.append(_v("FSDP2-GROUPS", f"unexpected FSDP state for modules {sorted(key)}", tags, "kind:extra-group"))
    return out


@invariant(
    "FSDP2-FROZEN",
    area="fsdp2",
    api="fsdp2",
    scenario="fsdp2",
    statement="Mixed requires_grad in one group is accepted silently; frozen parameters end with grad None and unchanged values; trainable gradients equal the unsharded reference's.",
    source=f"{DOC_FULLY_SHARD}; DESIGN.md FSDP2-FROZEN (FSDP2 shards per parameter: no flat-parameter restriction)",
)
def check_frozen(spec: CaseSpec, pred: FSDP2Prediction, obs: FSDP2Observation) -> list[Violation]:
    if not applies(pred) or not pred.frozen:
        return []
    tags = case_tags(spec, pred) | {backend_tag(obs)}
    if obs.wrap_error:
        return [_v("FSDP2-FROZEN", f"fully_shard raised {obs.wrap_error}", tags, "kind:raised")]
    out = [_v("FSDP2-FROZEN", f"warned: {w!r}", tags, "kind:warned") for w in obs.warnings if "requires_grad" in w]
    if obs.backward_error:
        out.append(_v("FSDP2-FROZEN", f"backward raised {obs.backward_error}", tags, "kind:backward-raised"))
    frozen = set(pred.frozen)
    for gr in obs.grads:
        if gr.fqn in frozen:
            if not gr.grad_none:
                out.append(_v("FSDP2-FROZEN", f"frozen parameter {gr.fqn} has a gradient", tags, "kind:frozen-grad"))
            if obs.values_meaningful and not gr.unchanged:
                out.append(_v("FSDP2-FROZEN", f"frozen parameter {gr.fqn} changed", tags, "kind:frozen-changed"))
        elif obs.values_meaningful and obs.backward_ran and gr.close is False:
            out.append(_v("FSDP2-FROZEN", f"gradient of {gr.fqn} differs from the reference's by {gr.max_diff:.3g}", tags, "kind:grad"))
        elif obs.backward_ran and gr.grad_none != gr.ref_grad_none:
            out.append(_v("FSDP2-FROZEN", f"{gr.fqn}: grad None is {gr.grad_none}, the reference's {gr.ref_grad_none}", tags, "kind:grad-none"))
    return out


@invariant(
    "FSDP2-TIES",
    area="fsdp2",
    api="fsdp2",
    scenario="fsdp2",
    statement=(
        "A parameter that two groups see is rejected with an error naming it (torch >= "
        f"{TIE_CHECK_SINCE[0]}.{TIE_CHECK_SINCE[1]}) or managed once (earlier releases); "
        "grouped with fully_shard([a, b]) it is managed once and its aliases stay one tensor. Silent duplication is a finding."
    ),
    source=f"{DOC_FULLY_SHARD}; torch {TIE_CHECK_SINCE[0]}.{TIE_CHECK_SINCE[1]} lazy-init check (pytorch#176225, huggingface/accelerate#4171)",
)
def check_ties(spec: CaseSpec, pred: FSDP2Prediction, obs: FSDP2Observation) -> list[Violation]:
    if not pred.tied or pred.supported:
        return []
    tags = case_tags(spec, pred)
    counts = Counter(f for g in obs.groups for f in g.managed)
    intact = dict(obs.ties_intact)
    # the split-tie check runs at lazy init: fully_shard or the first call
    error = obs.wrap_error or (obs.calls[0].error if obs.calls and pred.split_ties else None)
    if pred.split_ties:
        names = [t.fqn for t in pred.split_ties]
        if error:
            outcome = "error" if any(m in error for m in TIE_MARKS) else "unclear-error"
        elif any(counts.get(f, 0) > 1 for f in names):
            outcome = "duplicated"
        elif all(intact.get(f, True) for f in names):
            outcome = "once"
        else:
            outcome = "broken"
        if outcome in pred.tie_outcomes:
            return []
        want = " or ".join(pred.tie_outcomes)
        detail = {
            "duplicated": "is silently managed by several groups",
            "broken": "is split into separate tensors",
            "once": "is accepted and managed once",
            "unclear-error": f"is rejected without naming the tie: {error}",
            "error": f"is rejected: {error}",
        }[outcome]
        return [_v("FSDP2-TIES", f"tied parameter(s) {names} seen by two groups {detail}; expected {want}", tags, f"kind:{outcome}")]
    out = []
    if error:
        return [_v("FSDP2-TIES", f"grouped tie rejected: {error}", tags, "kind:raised")]
    for fqn, aliases in pred.tied:
        if counts.get(fqn, 0) > 1:
            out.append(_v("FSDP2-TIES", f"tied parameter {fqn} is managed by {counts[fqn]} groups", tags, "kind:duplicated"))
        if intact.get(fqn) is False:
            out.append(_v("FSDP2-TIES", f"aliases {list(aliases)} no longer share one tensor", tags, "kind:broken"))
    return out
