"""FSDP2 invariants: parameter groups, frozen parameters, parameters shared
between groups."""

from __future__ import annotations

from collections import Counter

from conformance.areas.common.catalog import DOC_FULLY_SHARD, DOC_REGISTER, S004, VALUES_UNCHECKED, Catalog, NotChecked
from conformance.areas.common.fsdp2_oracle import TIE_CHECK_SINCE, CallPrediction, FSDP2Prediction, fsdp2_case_tags
from conformance.areas.common.observation import CallObservation
from conformance.areas.common.violations import backend_tag, freed_storage_tags, violation
from conformance.areas.fully_shard.observation import FSDP2Observation
from conformance.case.spec import CaseSpec
from conformance.case.target import graph_of
from conformance.case.violation import Violation
from conformance.case.violation import set_diff as _diff

catalog = Catalog()

TIE_MARKS = ("shared", "tied", "fully_shard([")


def applies(pred: FSDP2Prediction) -> bool:
    """The case is within what FSDP2 promises and not rejected for a split tie."""
    return not pred.supported and not (pred.split_ties and pred.tie_check)


def outside(pred: FSDP2Prediction, obs: FSDP2Observation) -> NotChecked | None:
    """Why nothing of a group or method promise can be checked on this
    example: outside what FSDP2 promises, a split tie this torch rejects
    (FSDP2-TIES checks that), or fully_shard raised (FSDP2-GROUPS reports it)."""
    if pred.supported:
        return NotChecked(f"outside FSDP2's promise: {pred.supported}")
    if pred.split_ties and pred.tie_check:
        return NotChecked("a parameter two groups see, which this torch rejects (FSDP2-TIES)")
    if obs.wrap_error:
        return NotChecked("fully_shard raised (FSDP2-GROUPS reports it)")
    return None


def _method_calls(pred: FSDP2Prediction, obs: FSDP2Observation) -> list[tuple[CallPrediction, CallObservation]]:
    """The calls of a registered method (the root's forward aside)."""
    return [(c, o) for c, o in _paired(pred, obs) if c.method >= 0 and c.patched]


NO_METHOD = NotChecked("no registered forward method is called")


@catalog.invariant(
    "FSDP2-GROUPS",
    group="fsdp2",
    api="fsdp2",
    scenario="fsdp2",
    statement="fully_shard applied bottom-up makes one parameter group per call, holding the parameters of module.parameters() not assigned by an earlier call on a submodule nor passed as ignored_params.",
    source=DOC_FULLY_SHARD,
)
def check_groups(spec: CaseSpec, pred: FSDP2Prediction, obs: FSDP2Observation) -> list[Violation] | NotChecked:
    if not applies(pred):
        return outside(pred, obs)
    tags = fsdp2_case_tags(spec, pred)
    if obs.wrap_error:
        return [violation("FSDP2-GROUPS", f"fully_shard raised {obs.wrap_error}", tags, "kind:raised")]
    got = {frozenset(g.modules): g for g in obs.groups}
    out = []
    for g in pred.groups:
        key = frozenset(g.modules)
        where = ", ".join(m or "<root>" for m in g.modules)
        if key not in got:
            out.append(violation("FSDP2-GROUPS", f"no FSDP state holds exactly the modules [{where}]", tags, "kind:missing-group"))
            continue
        managed = got.pop(key).managed
        if Counter(managed) != Counter(set(managed)):
            out.append(violation("FSDP2-GROUPS", f"group [{where}] manages a parameter twice: {sorted(f for f, n in Counter(managed).items() if n > 1)}", tags, "kind:duplicated"))
        if set(managed) != set(g.managed):
            out.append(violation("FSDP2-GROUPS", f"group [{where}]: {_diff(set(managed), set(g.managed))}", tags, "kind:managed"))
    for key in got:
        out.append(violation("FSDP2-GROUPS", f"unexpected FSDP state for modules {sorted(key)}", tags, "kind:extra-group"))
    return out


@catalog.invariant(
    "FSDP2-FROZEN",
    group="fsdp2",
    api="fsdp2",
    scenario="fsdp2",
    statement="Mixed requires_grad in one group is accepted silently; frozen parameters end with grad None and unchanged values; trainable gradients equal the unsharded reference's.",
    source=f"{DOC_FULLY_SHARD}; DESIGN.md FSDP2-FROZEN (FSDP2 shards per parameter: no flat-parameter restriction)",
)
def check_frozen(spec: CaseSpec, pred: FSDP2Prediction, obs: FSDP2Observation) -> list[Violation] | NotChecked:
    if not applies(pred):
        return outside(pred, obs)
    if not pred.frozen:
        return NotChecked("no frozen parameter")
    tags = fsdp2_case_tags(spec, pred) | {backend_tag(obs)}
    if obs.wrap_error:
        return [violation("FSDP2-FROZEN", f"fully_shard raised {obs.wrap_error}", tags, "kind:raised")]
    out = [violation("FSDP2-FROZEN", f"warned: {w!r}", tags, "kind:warned") for w in obs.warnings if "requires_grad" in w]
    # a called method reads another group's parameter directly: the backward
    # through it is not promised (spec source 004), as FWD-PARITY says; a
    # frozen parameter must still get no gradient where a backward ran
    promised = pred.backward_promised
    if obs.backward_error and promised:
        out.append(violation("FSDP2-FROZEN", f"backward raised {obs.backward_error}", tags | _nested_anywhere(obs) | freed_storage_tags(obs.backward_error),
                             "kind:backward-raised"))
    if obs.read_error:
        out.append(violation("FSDP2-FROZEN", f"reading the parameters' and gradients' full values after backward raised {obs.read_error}",
                             tags, "kind:raised", "at:read"))
    frozen = set(pred.frozen)
    for gr in obs.grads:
        if gr.fqn in frozen:
            if not gr.grad_none:
                out.append(violation("FSDP2-FROZEN", f"frozen parameter {gr.fqn} has a gradient", tags, "kind:frozen-grad"))
            if obs.values_meaningful and not gr.unchanged:
                out.append(violation("FSDP2-FROZEN", f"frozen parameter {gr.fqn} changed", tags, "kind:frozen-changed"))
        elif not promised:
            continue
        elif obs.values_meaningful and obs.backward_ran and gr.close is False:
            out.append(violation("FSDP2-FROZEN", f"gradient of {gr.fqn} differs from the reference's by {gr.max_diff:.3g}", tags, "kind:grad"))
        elif obs.backward_ran and gr.grad_none != gr.ref_grad_none:
            # a trainable parameter left without a gradient: after a call that ran its module's forward inside, that call's doing
            out.append(violation("FSDP2-FROZEN", f"{gr.fqn}: grad None is {gr.grad_none}, the reference's {gr.ref_grad_none}",
                                 tags | _nested_anywhere(obs), "kind:grad-none"))
    if not out and not promised and obs.backward_error:
        return NotChecked("a called method reads another group's parameter directly: its gradients are not promised (spec source 004)")
    return out


@catalog.invariant(
    "FSDP2-TIES",
    group="fsdp2",
    api="fsdp2",
    scenario="fsdp2",
    statement=(
        "A parameter that two groups see is rejected with an error naming it (torch >= "
        f"{TIE_CHECK_SINCE[0]}.{TIE_CHECK_SINCE[1]}) or managed once (earlier releases); "
        "grouped with fully_shard([a, b]) it is managed once and its aliases stay one tensor. Silent duplication is a finding."
    ),
    source=f"{DOC_FULLY_SHARD}; torch {TIE_CHECK_SINCE[0]}.{TIE_CHECK_SINCE[1]} lazy-init check (pytorch#176225, huggingface/accelerate#4171)",
)
def check_ties(spec: CaseSpec, pred: FSDP2Prediction, obs: FSDP2Observation) -> list[Violation] | NotChecked:
    if pred.supported:
        return NotChecked(f"outside FSDP2's promise: {pred.supported}")
    if not pred.tied:
        return NotChecked("no tied parameter")
    tags = fsdp2_case_tags(spec, pred)
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
        return [violation("FSDP2-TIES", f"tied parameter(s) {names} seen by two groups {detail}; expected {want}", tags, f"kind:{outcome}")]
    out = []
    if error:
        return [violation("FSDP2-TIES", f"grouped tie rejected: {error}", tags, "kind:raised")]
    for fqn, aliases in pred.tied:
        if counts.get(fqn, 0) > 1:
            out.append(violation("FSDP2-TIES", f"tied parameter {fqn} is managed by {counts[fqn]} groups", tags, "kind:duplicated"))
        if intact.get(fqn) is False:
            out.append(violation("FSDP2-TIES", f"aliases {list(aliases)} no longer share one tensor", tags, "kind:broken"))
    return out


def call_tags(spec: CaseSpec, pred: FSDP2Prediction, c: CallPrediction, o: CallObservation | None = None,
              obs: FSDP2Observation | None = None) -> set[str]:
    """The facts of one call: the method's steps (predicted) and, given its
    observation, what it was seen to do (observed:nested-forward: its module's
    forward ran inside it; observed:sharded-read: an op read a sharded
    parameter after that; observed:after-nested-forward: an earlier call's did;
    observed:after-wrong-reshard: the call before left a group in the state
    its reshard_after_forward does not give)."""
    tags = {"call:forward"} if c.method == -1 else {"method:root" if c.module == "" else "method:nonroot"}
    if o is not None:
        tags |= observed_tags(o)
        if obs is not None and any(p.nested_forwards for p in obs.calls if p.index < o.index):
            tags.add("observed:after-nested-forward")
        if obs is not None and _left_wrong(pred, obs, o.index - 1):
            tags.add("observed:after-wrong-reshard")
    if c.method == -1:
        return tags
    m = spec.methods[c.method]
    ops = {s.op for s in m.steps}
    if "call" in ops:
        tags.add("method:calls-self")
    if "forward" in ops:
        tags.add("method:calls-forward")
    if "child" in ops:
        tags.add("method:calls-child")
    if c.nested:
        tags.add("method:nested")
    tied = {a for _, aliases in pred.tied for a in aliases}
    if any(s.op == "param" and (f"{m.module}.{s.target}" if m.module else s.target) in tied for s in m.steps):
        tags.add("method:tied-read")
    gi = pred.group_index(c.module)
    if gi is not None:
        tags.add(f"reshard:{str(pred.groups[gi].reshard).lower()}")
    if any(cl.method == c.method and cl.times > 1 for cl in spec.calls):
        tags.add("call:repeated")
    return tags


def _left_wrong(pred: FSDP2Prediction, obs: FSDP2Observation, index: int) -> bool:
    """Whether call ``index`` left a group sharded or unsharded against its
    reshard_after_forward (what FWD-RESHARD reports of that call): a later
    call then starts from a state no promise covers."""
    got = {c.index: c for c in obs.calls}.get(index)
    want = next((c for c in pred.calls if c.index == index), None)
    if got is None or want is None:
        return False
    where = {frozenset(g.modules): i for i, g in enumerate(obs.groups)}
    for gi, sharded in enumerate(want.sharded_after):
        oi = where.get(frozenset(pred.groups[gi].modules))
        if sharded is not None and oi is not None and oi < len(got.group_states) and got.group_states[oi] != ("sharded" if sharded else "full"):
            return True
    return False


def observed_tags(o: CallObservation) -> set[str]:
    tags = set()
    if o.nested_forwards:
        tags.add("observed:nested-forward")
    if o.sharded_reads:
        tags.add("observed:sharded-read")
    return tags


def _nested_anywhere(obs: FSDP2Observation) -> set[str]:
    """observed:nested-forward when any call ran its module's forward inside
    it (for what follows the calls: backward, gradients)."""
    return {"observed:nested-forward"} if any(c.nested_forwards for c in obs.calls) else set()


def _paired(pred: FSDP2Prediction, obs: FSDP2Observation) -> list[tuple[CallPrediction, CallObservation]]:
    got = {c.index: c for c in obs.calls}
    return [(c, got[c.index]) for c in pred.calls if c.index in got]


def _probes(obs: FSDP2Observation) -> dict[tuple[int, int, str], tuple[str, bool | None]]:
    return {(p.call, p.step, p.fqn): (p.state, p.equal) for p in obs.probes}


def _check_reads(inv: str, c: CallPrediction, probes, obs, tags, *, entry: bool, own_group: int | None) -> list[Violation]:
    out = []
    for r in c.reads:
        if r.step == -1 and (not entry or r.group != own_group):
            continue
        if not r.full:
            continue
        got = probes.get((c.index, r.step, r.fqn))
        where = "on entry" if r.step == -1 else f"at step {r.step}"
        if got is None:
            out.append(violation(inv, f"call {c.index}: no record of {r.fqn} {where}", tags, "kind:unprobed"))
        elif got[0] != "full":
            kind = "kind:entry-sharded" if r.step == -1 else "kind:read-sharded"
            out.append(violation(inv, f"call {c.index}: {r.fqn} is {got[0]} {where}, expected unsharded", tags, kind))
        elif obs.values_meaningful and got[1] is False:
            out.append(violation(inv, f"call {c.index}: {r.fqn} {where} differs from the reference's value", tags, "kind:value"))
    return out


def _check_allgathers(inv: str, c: CallPrediction, o: CallObservation, obs: FSDP2Observation, tags) -> list[Violation]:
    if obs.world_size < 2:
        return []  # one rank has nothing to gather
    if c.exact and o.allgathers != c.unshards:
        return [violation(inv, f"call {c.index}: {o.allgathers} all-gathers, expected {c.unshards}", tags, "kind:allgather-count")]
    if not c.exact and c.unshards and not o.allgathers:
        return [violation(inv, f"call {c.index}: no all-gather, expected at least one", tags, "kind:allgather-count")]
    return []


@catalog.invariant(
    "FWD-ALLGATHER",
    group="forward_methods",
    api="fsdp2",
    scenario="fsdp2",
    statement="Inside a registered method the module's parameters are unsharded (full shape, the reference's values) and the all-gathers that unsharded them ran.",
    source=f"{S004}; {DOC_REGISTER}",
)
def check_allgather(spec: CaseSpec, pred: FSDP2Prediction, obs: FSDP2Observation) -> list[Violation] | NotChecked:
    why = outside(pred, obs)
    if why:
        return why
    calls = [(c, o) for c, o in _method_calls(pred, obs) if not c.nested and not o.error]
    if not calls:
        return NotChecked("no call of a registered method that returned and calls no nested FSDP module (FWD-NESTED)")
    base = fsdp2_case_tags(spec, pred)
    probes = _probes(obs)
    out = []
    for c, o in calls:
        tags = base | call_tags(spec, pred, c, o, obs)
        out += _check_reads("FWD-ALLGATHER", c, probes, obs, tags, entry=True, own_group=pred.group_index(c.module))
        out += _check_allgathers("FWD-ALLGATHER", c, o, obs, tags)
    return out


@catalog.invariant(
    "FWD-PARITY",
    group="forward_methods",
    api="fsdp2",
    scenario="fsdp2",
    statement=(
        "A registered method's output, and the gradients through it, equal the unsharded reference model's on every rank "
        "(gradients: unless a method reads another group's parameter directly, which no hook keeps alive for backward)."
    ),
    source=f"{S004}; {DOC_REGISTER}",
)
def check_parity(spec: CaseSpec, pred: FSDP2Prediction, obs: FSDP2Observation) -> list[Violation] | NotChecked:
    why = outside(pred, obs)
    if why:
        return why
    if not _method_calls(pred, obs):
        return NO_METHOD
    base = fsdp2_case_tags(spec, pred) | {backend_tag(obs)}
    out = []
    for c, o in _paired(pred, obs):
        if not c.in_promise:
            continue
        tags = base | call_tags(spec, pred, c, o, obs)
        if o.error:
            out.append(violation("FWD-PARITY", f"call {c.index} raised {o.error}", tags, "kind:raised"))
        elif obs.values_meaningful and o.close is False:
            out.append(violation("FWD-PARITY", f"call {c.index} (method {c.method}) output differs from the reference's by {o.max_diff:.3g}", tags, "kind:output"))
    if not pred.backward_promised:  # a method reads another group's parameter directly: its gradients are not promised
        return out or (VALUES_UNCHECKED if not obs.values_meaningful else out)  # on the fake tier the outputs compared nothing
    after = base | _nested_anywhere(obs)
    if obs.backward_error:
        out.append(violation("FWD-PARITY", f"backward raised {obs.backward_error}", after | freed_storage_tags(obs.backward_error), "kind:backward-raised"))
    if obs.read_error:
        out.append(violation("FWD-PARITY", f"reading the parameters' and gradients' full values after backward raised {obs.read_error}",
                             after, "kind:raised", "at:read"))
    if obs.values_meaningful and obs.backward_ran:
        for g in obs.grads:
            if g.grad_none != g.ref_grad_none:
                out.append(violation("FWD-PARITY", f"{g.fqn}: grad None is {g.grad_none}, the reference's {g.ref_grad_none}", after, "kind:grad-none"))
            elif g.close is False:
                out.append(violation("FWD-PARITY", f"gradient of {g.fqn} differs from the reference's by {g.max_diff:.3g}", after, "kind:grad"))
    if not out and not obs.values_meaningful:
        return VALUES_UNCHECKED  # nothing raised; outputs and gradients carry no values here
    return out


@catalog.invariant(
    "FWD-RESHARD",
    group="forward_methods",
    api="fsdp2",
    scenario="fsdp2",
    statement="After a registered method (and after forward), each group is resharded as its reshard_after_forward says (None: True, False for the root).",
    source=f"{DOC_REGISTER} (optionally frees parameters post-forward depending on reshard_after_forward); {DOC_FULLY_SHARD}",
)
def check_reshard(spec: CaseSpec, pred: FSDP2Prediction, obs: FSDP2Observation) -> list[Violation] | NotChecked:
    why = outside(pred, obs)
    if why:
        return why
    calls = [(c, o) for c, o in _paired(pred, obs) if c.patched and not o.error]
    if not any(c.method >= 0 for c, _ in calls):
        return NO_METHOD
    base = fsdp2_case_tags(spec, pred)
    index = {frozenset(g.modules): i for i, g in enumerate(obs.groups)}
    out = []
    for c, o in calls:
        tags = base | call_tags(spec, pred, c, o, obs)
        for gi, want in enumerate(c.sharded_after):
            oi = index.get(frozenset(pred.groups[gi].modules))
            if want is None or oi is None or oi >= len(o.group_states):
                continue
            got = o.group_states[oi]
            if got != ("sharded" if want else "full"):
                g = pred.groups[gi]
                where = ", ".join(m or "<root>" for m in g.modules)
                kind = "kind:not-resharded" if want else "kind:resharded"
                gtags = {f"group-reshard:{str(g.reshard).lower()}"} | ({"group-kind:multi"} if len(g.modules) > 1 else set())
                out.append(
                    violation("FWD-RESHARD", f"after call {c.index} (method {c.method}) group [{where}] (reshard_after_forward={g.reshard}) is {got}", tags | gtags, kind)
                )
    return out


@catalog.invariant(
    "FWD-NOOP",
    group="forward_methods",
    api="fsdp2",
    scenario="fsdp2",
    statement="register_fsdp_forward_method on a module that is not an FSDP module changes nothing (and never raises).",
    source=f"{S004} (no-op so that it can be called even if the FSDP wrapping changes); {DOC_REGISTER}",
)
def check_noop(spec: CaseSpec, pred: FSDP2Prediction, obs: FSDP2Observation) -> list[Violation] | NotChecked:
    if pred.supported:
        return NotChecked(f"outside FSDP2's promise: {pred.supported}")
    if obs.wrap_error:
        return NotChecked("fully_shard raised (FSDP2-GROUPS reports it)")
    fsdp = set(pred.fsdp_paths)  # every name: a method's module may be a shared module's other path
    if not any(m.register and m.module not in fsdp for m in spec.methods) and all(p in fsdp for p, _, _ in obs.missing):
        return NotChecked("no method is registered on a module that is not an FSDP module")
    base = fsdp2_case_tags(spec, pred)
    out = []
    for r in obs.registrations:
        m = spec.methods[r.method]
        if m.module in fsdp or not m.register:
            continue
        if r.error:
            out.append(violation("FWD-NOOP", f"registering {m.name} on non-FSDP module {m.module} raised {r.error}", base, "kind:raised"))
        if r.patched or r.fsdp_module:
            out.append(violation("FWD-NOOP", f"registering {m.name} on non-FSDP module {m.module} patched it", base, "kind:patched"))
    for path, is_fsdp, err in obs.missing:
        if path not in fsdp and err:
            out.append(violation("FWD-NOOP", f"registering a missing name on non-FSDP module {path} raised {err}", base, "kind:raised"))
    return out


@catalog.invariant(
    "FWD-MISSING",
    group="forward_methods",
    api="fsdp2",
    scenario="fsdp2",
    statement="Registering a method name an FSDP module lacks raises ValueError.",
    source=DOC_REGISTER,
)
def check_missing(spec: CaseSpec, pred: FSDP2Prediction, obs: FSDP2Observation) -> list[Violation] | NotChecked:
    if pred.supported:
        return NotChecked(f"outside FSDP2's promise: {pred.supported}")
    if obs.wrap_error:
        return NotChecked("fully_shard raised (FSDP2-GROUPS reports it)")
    base = fsdp2_case_tags(spec, pred)
    fsdp = set(pred.fsdp_paths)  # every name: a method's module may be a shared module's other path
    out = []
    for path, _, err in obs.missing:
        if path in fsdp and err != "ValueError":
            kind = "kind:no-error" if err is None else "kind:wrong-type"
            out.append(violation("FWD-MISSING", f"registering a missing name on FSDP module {path or '<root>'} raised {err}, not ValueError", base, kind))
    return out


@catalog.invariant(
    "FWD-NESTED",
    group="forward_methods",
    api="fsdp2",
    scenario="fsdp2",
    statement="A registered method that calls FSDP submodules, self.forward or self(...) sees unsharded parameters throughout, runs the all-gathers it needs and matches the reference.",
    source=f"{S004} (awgu: nested FSDP submodules run forward normally; weifengpy: fsdp_hook(forward_features(fsdp_hook)))",
)
def check_nested(spec: CaseSpec, pred: FSDP2Prediction, obs: FSDP2Observation) -> list[Violation] | NotChecked:
    why = outside(pred, obs)
    if why:
        return why
    calls = [(c, o) for c, o in _method_calls(pred, obs) if c.nested]
    if not calls:
        return NotChecked("no registered method calls a nested FSDP module, self.forward or self(...)")
    base = fsdp2_case_tags(spec, pred)
    probes = _probes(obs)
    out = []
    for c, o in calls:
        tags = base | call_tags(spec, pred, c, o, obs)
        if o.error:
            out.append(violation("FWD-NESTED", f"call {c.index} raised {o.error}", tags, "kind:raised"))
            continue
        out += _check_reads("FWD-NESTED", c, probes, obs, tags, entry=True, own_group=pred.group_index(c.module))
        out += _check_allgathers("FWD-NESTED", c, o, obs, tags)
        if c.in_promise and obs.values_meaningful and o.close is False:
            out.append(violation("FWD-NESTED", f"call {c.index} output differs from the reference's by {o.max_diff:.3g}", tags, "kind:output"))
    return out


@catalog.invariant(
    "FWD-ISOLATION",
    group="forward_methods",
    api="fsdp2",
    scenario="fsdp2",
    statement=(
        "Registering a method on one instance changes no other instance (other modules of the class, another model): "
        "the same method of another instance runs without FSDP's hooks (no all-gather of its own) and gives the reference's output."
    ),
    source=f"{DOC_REGISTER} (patches the method on ``module``); {S004}",
)
def check_isolation(spec: CaseSpec, pred: FSDP2Prediction, obs: FSDP2Observation) -> list[Violation] | NotChecked:
    if pred.supported:
        return NotChecked(f"outside FSDP2's promise: {pred.supported}")
    if obs.wrap_error:
        return NotChecked("fully_shard raised (FSDP2-GROUPS reports it)")
    if not any(m.register for m in spec.methods):
        return NotChecked("no method is registered")
    # the backend: the sibling check below compares outputs with the reference
    base = fsdp2_case_tags(spec, pred) | {backend_tag(obs)}
    out = [
        violation("FWD-ISOLATION", f"registering {spec.methods[r.method].name} on {spec.methods[r.method].module or '<root>'} changed another instance", base, "kind:leaked")
        for r in obs.registrations
        if not r.others_unchanged
    ]
    if not applies(pred):
        return out
    for c, o in _paired(pred, obs):
        reg = _registered_sibling(spec, c.method)
        if reg is None:
            continue
        tags = base | call_tags(spec, pred, c, o, obs) | {"method:sibling"}
        what = f"call {c.index}: {spec.methods[c.method].name} of {c.module or '<root>'} (registered on {reg} only)"
        if o.error:
            if c.in_promise:
                out.append(violation("FWD-ISOLATION", f"{what} raised {o.error}", tags, "kind:leaked-call"))
            continue
        if obs.world_size >= 2 and c.exact and o.allgathers != c.unshards:
            out.append(violation("FWD-ISOLATION", f"{what} ran {o.allgathers} all-gathers, expected {c.unshards}: FSDP's hooks ran for it", tags, "kind:leaked-hooks"))
        if c.in_promise and obs.values_meaningful and o.close is False:
            out.append(violation("FWD-ISOLATION", f"{what}: output differs from the reference's by {o.max_diff:.3g}", tags, "kind:leaked-output"))
    return out


def _registered_sibling(spec: CaseSpec, index: int) -> str | None:
    """For an unregistered method: the path of another module of the same
    class on which the same method name is registered, else None. Read from
    the case's module graph (graph_of), so that a CaseSpec and a ModelCase
    are looked at alike; a ModelCase's methods are all its root's, so it has
    no such sibling."""
    if index == -1:
        return None

    m = spec.methods[index]
    if m.register:
        return None
    others = [x for x in spec.methods if x.register and x.name == m.name and x.module != m.module]
    if not others:
        return None
    nodes = graph_of(spec).nodes
    for x in others:
        if nodes[x.module].cls == nodes[m.module].cls:
            return x.module or "<root>"
    return None


INVARIANTS = tuple(catalog.invariants)
