"""Forward-method invariants (register_fsdp_forward_method, FSDP2; the FSDP1
summon_full_params workaround) and training parity under both APIs."""

from __future__ import annotations

from conformance.invariants.catalog import S004, invariant
from conformance.invariants.fsdp2 import DOC_FULLY_SHARD, DOC_REGISTER, _v, applies, backend_tag, case_tags
from conformance.observations import CallObservation, FSDP2Observation, TrainObservation
from conformance.oracle.fsdp2 import CallPrediction, FSDP2Prediction
from conformance.oracle.methods import ParityPrediction, SummonPrediction
from conformance.case.spec import CaseSpec
from conformance.case.violation import Violation


def call_tags(spec: CaseSpec, pred: FSDP2Prediction, c: CallPrediction) -> set[str]:
    tags = {"method:root" if c.module == "" else "method:nonroot"}
    if c.method == -1:
        return {"call:forward"}
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
            out.append(_v(inv, f"call {c.index}: no record of {r.fqn} {where}", tags, "kind:unprobed"))
        elif got[0] != "full":
            kind = "kind:entry-sharded" if r.step == -1 else "kind:read-sharded"
            out.append(_v(inv, f"call {c.index}: {r.fqn} is {got[0]} {where}, expected unsharded", tags, kind))
        elif obs.values_meaningful and got[1] is False:
            out.append(_v(inv, f"call {c.index}: {r.fqn} {where} differs from the reference's value", tags, "kind:value"))
    return out


def _check_allgathers(inv: str, c: CallPrediction, o: CallObservation, obs: FSDP2Observation, tags) -> list[Violation]:
    if obs.world_size < 2:
        return []  # one rank has nothing to gather
    if c.exact and o.allgathers != c.unshards:
        return [_v(inv, f"call {c.index}: {o.allgathers} all-gathers, expected {c.unshards}", tags, "kind:allgather-count")]
    if not c.exact and c.unshards and not o.allgathers:
        return [_v(inv, f"call {c.index}: no all-gather, expected at least one", tags, "kind:allgather-count")]
    return []


@invariant(
    "FWD-ALLGATHER",
    area="forward_methods",
    api="fsdp2",
    scenario="fsdp2",
    statement="Inside a registered method the module's parameters are unsharded (full shape, the reference's values) and the all-gathers that unsharded them ran.",
    source=f"{S004}; {DOC_REGISTER}",
)
def check_allgather(spec: CaseSpec, pred: FSDP2Prediction, obs: FSDP2Observation) -> list[Violation]:
    if not applies(pred) or obs.wrap_error:
        return []
    base = case_tags(spec, pred)
    probes = _probes(obs)
    out = []
    for c, o in _paired(pred, obs):
        if c.method == -1 or not c.patched or c.nested or o.error:
            continue
        tags = base | call_tags(spec, pred, c)
        out += _check_reads("FWD-ALLGATHER", c, probes, obs, tags, entry=True, own_group=pred.group_index(c.module))
        out += _check_allgathers("FWD-ALLGATHER", c, o, obs, tags)
    return out


@invariant(
    "FWD-PARITY",
    area="forward_methods",
    api="fsdp2",
    scenario="fsdp2",
    statement=(
        "A registered method's output, and the gradients through it, equal the unsharded reference model's on every rank "
        "(gradients: unless a method reads another group's parameter directly, which no hook keeps alive for backward)."
    ),
    source=f"{S004}; {DOC_REGISTER}",
)
def check_parity(spec: CaseSpec, pred: FSDP2Prediction, obs: FSDP2Observation) -> list[Violation]:
    if not applies(pred) or obs.wrap_error:
        return []
    base = case_tags(spec, pred) | {backend_tag(obs)}
    out = []
    for c, o in _paired(pred, obs):
        if not c.in_promise:
            continue
        tags = base | call_tags(spec, pred, c)
        if o.error:
            out.append(_v("FWD-PARITY", f"call {c.index} raised {o.error}", tags, "kind:raised"))
        elif obs.values_meaningful and o.close is False:
            out.append(_v("FWD-PARITY", f"call {c.index} (method {c.method}) output differs from the reference's by {o.max_diff:.3g}", tags, "kind:output"))
    if not pred.backward_promised:
        return out  # a method reads another group's parameter directly: its gradients are not promised
    if obs.backward_error:
        out.append(_v("FWD-PARITY", f"backward raised {obs.backward_error}", base, "kind:backward-raised"))
    if obs.values_meaningful and obs.backward_ran:
        for g in obs.grads:
            if g.grad_none != g.ref_grad_none:
                out.append(_v("FWD-PARITY", f"{g.fqn}: grad None is {g.grad_none}, the reference's {g.ref_grad_none}", base, "kind:grad-none"))
            elif g.close is False:
                out.append(_v("FWD-PARITY", f"gradient of {g.fqn} differs from the reference's by {g.max_diff:.3g}", base, "kind:grad"))
    return out


@invariant(
    "FWD-RESHARD",
    area="forward_methods",
    api="fsdp2",
    scenario="fsdp2",
    statement="After a registered method (and after forward), each group is resharded as its reshard_after_forward says (None: True, False for the root).",
    source=f"{DOC_REGISTER} (optionally frees parameters post-forward depending on reshard_after_forward); {DOC_FULLY_SHARD}",
)
def check_reshard(spec: CaseSpec, pred: FSDP2Prediction, obs: FSDP2Observation) -> list[Violation]:
    if not applies(pred) or obs.wrap_error:
        return []
    base = case_tags(spec, pred)
    index = {frozenset(g.modules): i for i, g in enumerate(obs.groups)}
    out = []
    for c, o in _paired(pred, obs):
        if o.error or not c.patched:
            continue
        tags = base | call_tags(spec, pred, c)
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
                    _v("FWD-RESHARD", f"after call {c.index} (method {c.method}) group [{where}] (reshard_after_forward={g.reshard}) is {got}", tags | gtags, kind)
                )
    return out


@invariant(
    "FWD-NOOP",
    area="forward_methods",
    api="fsdp2",
    scenario="fsdp2",
    statement="register_fsdp_forward_method on a module that is not an FSDP module changes nothing (and never raises).",
    source=f"{S004} (no-op so that it can be called even if the FSDP wrapping changes); {DOC_REGISTER}",
)
def check_noop(spec: CaseSpec, pred: FSDP2Prediction, obs: FSDP2Observation) -> list[Violation]:
    if pred.supported or obs.wrap_error:
        return []
    base = case_tags(spec, pred)
    fsdp = set(pred.fsdp_paths)  # every name: a method's module may be a shared module's other path
    out = []
    for r in obs.registrations:
        m = spec.methods[r.method]
        if m.module in fsdp or not m.register:
            continue
        if r.error:
            out.append(_v("FWD-NOOP", f"registering {m.name} on non-FSDP module {m.module} raised {r.error}", base, "kind:raised"))
        if r.patched or r.fsdp_module:
            out.append(_v("FWD-NOOP", f"registering {m.name} on non-FSDP module {m.module} patched it", base, "kind:patched"))
    for path, is_fsdp, err in obs.missing:
        if path not in fsdp and err:
            out.append(_v("FWD-NOOP", f"registering a missing name on non-FSDP module {path} raised {err}", base, "kind:raised"))
    return out


@invariant(
    "FWD-MISSING",
    area="forward_methods",
    api="fsdp2",
    scenario="fsdp2",
    statement="Registering a method name an FSDP module lacks raises ValueError.",
    source=DOC_REGISTER,
)
def check_missing(spec: CaseSpec, pred: FSDP2Prediction, obs: FSDP2Observation) -> list[Violation]:
    if pred.supported or obs.wrap_error:
        return []
    base = case_tags(spec, pred)
    fsdp = set(pred.fsdp_paths)  # every name: a method's module may be a shared module's other path
    out = []
    for path, _, err in obs.missing:
        if path in fsdp and err != "ValueError":
            kind = "kind:no-error" if err is None else "kind:wrong-type"
            out.append(_v("FWD-MISSING", f"registering a missing name on FSDP module {path or '<root>'} raised {err}, not ValueError", base, kind))
    return out


@invariant(
    "FWD-NESTED",
    area="forward_methods",
    api="fsdp2",
    scenario="fsdp2",
    statement="A registered method that calls FSDP submodules, self.forward or self(...) sees unsharded parameters throughout, runs the all-gathers it needs and matches the reference.",
    source=f"{S004} (awgu: nested FSDP submodules run forward normally; weifengpy: fsdp_hook(forward_features(fsdp_hook)))",
)
def check_nested(spec: CaseSpec, pred: FSDP2Prediction, obs: FSDP2Observation) -> list[Violation]:
    if not applies(pred) or obs.wrap_error:
        return []
    base = case_tags(spec, pred)
    probes = _probes(obs)
    out = []
    for c, o in _paired(pred, obs):
        if c.method == -1 or not c.patched or not c.nested:
            continue
        tags = base | call_tags(spec, pred, c)
        if o.error:
            out.append(_v("FWD-NESTED", f"call {c.index} raised {o.error}", tags, "kind:raised"))
            continue
        out += _check_reads("FWD-NESTED", c, probes, obs, tags, entry=True, own_group=pred.group_index(c.module))
        out += _check_allgathers("FWD-NESTED", c, o, obs, tags)
        if c.in_promise and obs.values_meaningful and o.close is False:
            out.append(_v("FWD-NESTED", f"call {c.index} output differs from the reference's by {o.max_diff:.3g}", tags, "kind:output"))
    return out


@invariant(
    "FWD-ISOLATION",
    area="forward_methods",
    api="fsdp2",
    scenario="fsdp2",
    statement=(
        "Registering a method on one instance changes no other instance (other modules of the class, another model): "
        "the same method of another instance runs without FSDP's hooks (no all-gather of its own) and gives the reference's output."
    ),
    source=f"{DOC_REGISTER} (patches the method on ``module``); {S004}",
)
def check_isolation(spec: CaseSpec, pred: FSDP2Prediction, obs: FSDP2Observation) -> list[Violation]:
    if pred.supported or obs.wrap_error:
        return []
    # the backend: the sibling check below compares outputs with the reference
    base = case_tags(spec, pred) | {backend_tag(obs)}
    out = [
        _v("FWD-ISOLATION", f"registering {spec.methods[r.method].name} on {spec.methods[r.method].module or '<root>'} changed another instance", base, "kind:leaked")
        for r in obs.registrations
        if not r.others_unchanged
    ]
    if not applies(pred):
        return out
    for c, o in _paired(pred, obs):
        reg = _registered_sibling(spec, c.method)
        if reg is None:
            continue
        tags = base | call_tags(spec, pred, c) | {"method:sibling"}
        what = f"call {c.index}: {spec.methods[c.method].name} of {c.module or '<root>'} (registered on {reg} only)"
        if o.error:
            if c.in_promise:
                out.append(_v("FWD-ISOLATION", f"{what} raised {o.error}", tags, "kind:leaked-call"))
            continue
        if obs.world_size >= 2 and c.exact and o.allgathers != c.unshards:
            out.append(_v("FWD-ISOLATION", f"{what} ran {o.allgathers} all-gathers, expected {c.unshards}: FSDP's hooks ran for it", tags, "kind:leaked-hooks"))
        if c.in_promise and obs.values_meaningful and o.close is False:
            out.append(_v("FWD-ISOLATION", f"{what}: output differs from the reference's by {o.max_diff:.3g}", tags, "kind:leaked-output"))
    return out


def _registered_sibling(spec: CaseSpec, index: int) -> str | None:
    """For an unregistered method: the path of another module of the same
    class on which the same method name is registered, else None. Read from
    the case's module graph (graph_of), so that a CaseSpec and a ModelCase
    are looked at alike; a ModelCase's methods are all its root's, so it has
    no such sibling."""
    if index == -1:
        return None
    from conformance.case.target import graph_of

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


@invariant(
    "FWD-SUMMON",
    area="forward_methods",
    api="fsdp1",
    scenario="fsdp1-methods",
    statement="FSDP1's workaround: a root method run inside summon_full_params(recurse=False), reading parameters the root unit manages, gives the unsharded reference's output on every rank.",
    source=f"{S004} (composer: summon_full_params(self.model, writeback=False, recurse=False) around generate())",
)
def check_summon(spec: CaseSpec, pred: SummonPrediction, obs: FSDP2Observation) -> list[Violation]:
    if pred.fsdp1.error is not None:
        return []
    tags = {"api:fsdp1", f"uop:{str(spec.plan.use_orig_params).lower()}"}
    if pred.fsdp1.ties:
        tags.add("tie")
    if obs.wrap_error:
        return [_v("FWD-SUMMON", f"FSDP raised {obs.wrap_error}", tags, "kind:raised")]
    got = {c.index: c for c in obs.calls}
    out = []
    for c in pred.calls:
        o = got.get(c.index)
        if o is None or not c.in_promise:
            continue
        if o.error:
            out.append(_v("FWD-SUMMON", f"call {c.index} raised {o.error}", tags, "kind:raised"))
        elif obs.values_meaningful and o.close is False:
            out.append(_v("FWD-SUMMON", f"call {c.index} output differs from the reference's by {o.max_diff:.3g}", tags, "kind:output"))
    return out


def parity_ranks_tags(spec: CaseSpec, pred: ParityPrediction, obs: list) -> set[str]:
    """A rank disagreement in a PARITY run (runner's RANKS-AGREE): an FSDP2
    case's tags, so that a known failure that moves one rank's losses more
    than another's (a lost gradient) can match it; none for FSDP1, whose
    rank-dependent structure RANKS-AGREE checks on its own scenario."""
    if pred.api == "fsdp2" and pred.fsdp2 is not None:
        return case_tags(spec, pred.fsdp2)
    return set()


@invariant(
    "PARITY",
    area="parity",
    api="fsdp1|fsdp2",
    scenario="train",
    statement="A few optimizer steps (SGD, Adam) under FSDP1 (either use_orig_params) or FSDP2 match single-process training: losses and final parameters within tolerance (compared while the reference stays finite and grows less than 1000x); frozen parameters unchanged with grad None.",
    source=f"{DOC_FULLY_SHARD}; FullyShardedDataParallel docstring; DESIGN.md PARITY",
)
def check_training(spec: CaseSpec, pred: ParityPrediction, obs: TrainObservation) -> list[Violation]:
    if pred.applicable:
        return []
    tags = {f"api:{pred.api}", f"optim:{spec.train.optimizer if spec.train else 'SGD'}", backend_tag(obs)}
    if pred.api == "fsdp1":
        from conformance.invariants.fsdp1 import case_tags as fsdp1_tags

        tags |= fsdp1_tags(spec, pred.fsdp1)
    else:
        tags |= case_tags(spec, pred.fsdp2)
    if pred.frozen:
        tags.add("frozen")
    if obs.wrap_error or obs.step_error:
        return [_v("PARITY", f"training raised {obs.wrap_error or obs.step_error}", tags, "kind:raised")]
    out = []
    frozen = set(pred.frozen)
    for fqn, none in obs.frozen_grads_none:
        if not none:
            out.append(_v("PARITY", f"frozen parameter {fqn} has a gradient", tags, "kind:frozen-grad"))
    if not obs.values_meaningful:
        return out
    if obs.losses_close is False:
        out.append(_v("PARITY", f"losses {list(obs.losses)} differ from single-process {list(obs.ref_losses)}", tags, "kind:loss"))
    for p in obs.params:
        if p.fqn in frozen and not p.unchanged:
            out.append(_v("PARITY", f"frozen parameter {p.fqn} changed", tags, "kind:frozen-changed"))
        elif p.close is False:
            out.append(_v("PARITY", f"{p.fqn} after training differs from single-process by {p.max_diff:.3g}", tags, "kind:param"))
    return out
