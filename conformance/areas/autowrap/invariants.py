"""FSDP1 auto-wrap, frozen-parameter and tie invariants."""

from __future__ import annotations

from collections import Counter

from conformance.areas.autowrap.observation import FROZEN_MARK, FrozenMessage, WrapObservation
from conformance.areas.common.catalog import DOC_FSDP, S000, Catalog, NotChecked
from conformance.areas.common.fsdp1_oracle import FSDP1Prediction, UnitPrediction, fsdp1_case_tags
from conformance.areas.common.ranks import ranks_agree
from conformance.areas.common.violations import violation
from conformance.case.spec import CaseSpec, CustomWrap
from conformance.case.target import graph_of
from conformance.case.violation import Violation
from conformance.case.violation import set_diff as _diff

catalog = Catalog()

STRUCTURE = "fsdp1-structure"  # no state_dict(): what most invariants need


def error_tags(obs: WrapObservation) -> set[str]:
    if obs.error is None:
        return set()
    if "uniform `requires_grad`" in obs.error.text:
        return {"error:uniform-requires-grad"}  # FlatParamHandle's generic check
    if "is already wrapped" in obs.error.text:
        return {"error:already-wrapped"}  # _recursive_wrap meeting its own wrapper
    if FROZEN_MARK in obs.error.text:
        return {"error:frozen-check"}  # _validate_frozen_params
    return {"error:other"}


def _not_wrapped(pred: FSDP1Prediction, obs: WrapObservation) -> NotChecked | None:
    """Why the structural checks have nothing to compare: FSDP1 must reject
    the case (FROZEN-ERROR checks that), or wrapping raised (WRAP-UNITS
    reports it)."""
    if pred.error is not None:
        return NotChecked("FSDP1 must reject the case: a mixed unit under use_orig_params=False (FROZEN-ERROR)")
    if obs.error is not None:
        return NotChecked("wrapping raised (WRAP-UNITS reports it)")
    return None


def _wrapped(pred: FSDP1Prediction, obs: WrapObservation) -> bool:
    """Both sides agree wrapping succeeded: the structural checks apply."""
    return pred.error is None and obs.error is None


def _managed_by_path(obs: WrapObservation) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for u in obs.units:
        out.setdefault(u.path, set()).update(u.managed)
    return out


@catalog.invariant(
    "WRAP-UNITS",
    scenario=STRUCTURE,
    group="wrap",
    api="fsdp1",
    statement="The FSDP units after auto-wrapping are exactly the policy's targets plus the root, each once.",
    source=f"{S000}; {DOC_FSDP}",
)
def check_wrap_units(spec: CaseSpec, pred: FSDP1Prediction, obs: WrapObservation) -> list[Violation] | NotChecked:
    tags = fsdp1_case_tags(spec, pred)
    if pred.error is None and obs.error is not None and not _tie_rejection(pred, obs):
        return [violation("WRAP-UNITS", f"wrapping raised {obs.error.category}: {obs.error.text.splitlines()[0]}", tags | error_tags(obs), "kind:raised")]
    if not _wrapped(pred, obs):
        return _not_wrapped(pred, obs)
    want = Counter(u.path for u in pred.units)
    got = Counter(u.path for u in obs.units)
    out = []
    for path in sorted(want.keys() - got.keys()):
        out.append(violation("WRAP-UNITS", f"module {path or '<root>'} should be an FSDP unit but is not", tags, "kind:missing-unit"))
    for path in sorted(got.keys() - want.keys()):
        out.append(violation("WRAP-UNITS", f"module {path or '<root>'} is an FSDP unit but the policy does not target it", tags, "kind:extra-unit"))
    for path, n in sorted(got.items()):
        if n > 1:
            out.append(violation("WRAP-UNITS", f"module {path or '<root>'} is wrapped by {n} FSDP units", tags, "kind:duplicate-unit"))
    return out


DOC_CUSTOM_POLICY = "CustomPolicy docstring (a non-empty dict overrides the root's kwargs for that module)"
ROOT_KWARGS = {"sharding_strategy": "FULL_SHARD", "forward_prefetch": False}  # what adapters.fsdp1.wrap gives the root


@catalog.invariant(
    "WRAP-KWARGS",
    scenario=STRUCTURE,
    group="wrap",
    api="fsdp1",
    statement="A unit whose CustomPolicy lambda returned a kwargs dict is built with those kwargs; every other unit with the root's.",
    source=DOC_CUSTOM_POLICY,
)
def check_wrap_kwargs(spec: CaseSpec, pred: FSDP1Prediction, obs: WrapObservation) -> list[Violation] | NotChecked:

    if not isinstance(spec.plan.policy, CustomWrap):
        return NotChecked("no CustomPolicy")
    if not _wrapped(pred, obs):
        return _not_wrapped(pred, obs)

    tags = fsdp1_case_tags(spec, pred)
    # Keyed by module, not by path: the policy's lambda sees a module, and a
    # shared module's unit is reported under its first name in
    # named_modules() order, which need not be the name the plan targets
    # (t2141: model1 targeted, its unit reported as model0.shared0).
    g = graph_of(spec)

    def node(path: str) -> str:
        try:
            return g.resolve_module(path)
        except KeyError:
            return path  # no module of the model: WRAP-UNITS reports it

    overrides = {node(t): dict(kw) for t, kw in spec.plan.policy.kwargs if t}  # the root is wrapped with the root's kwargs
    out = []
    for u in obs.units:
        if not u.kwargs:
            continue
        want = {**ROOT_KWARGS, **overrides.get(node(u.path), {})}
        if obs.world_size == 1 and want["sharding_strategy"] != "NO_SHARD":
            want["sharding_strategy"] = "NO_SHARD"  # FSDP's documented switch for a world of one
        got = dict(u.kwargs)
        wrong = sorted(k for k in want if k in got and got[k] != want[k])
        if wrong:
            detail = ", ".join(f"{k}={got[k]!r} (expected {want[k]!r})" for k in wrong)
            out.append(violation("WRAP-KWARGS", f"unit {u.path or '<root>'} was built with {detail}", tags, "kind:wrong-kwargs"))
    return out


@catalog.invariant(
    "WRAP-FQNS",
    scenario=STRUCTURE,
    group="wrap",
    api="fsdp1",
    statement="Per unit, torch's pre-wrap simulation, the post-wrap managed FQNs and the oracle agree.",
    source=f"{S000} (ezyang: _get_param_to_fqn(post) == _get_managed_param_to_fqn(pre))",
)
def check_wrap_fqns(spec: CaseSpec, pred: FSDP1Prediction, obs: WrapObservation) -> list[Violation] | NotChecked:
    if not _wrapped(pred, obs):
        return _not_wrapped(pred, obs)
    tags = fsdp1_case_tags(spec, pred)
    post = _managed_by_path(obs)
    sim: dict[str, set[str]] = {}
    for u in obs.units:
        if u.simulated is not None:
            sim.setdefault(u.path, set()).update(u.simulated)
    out = []
    for u in pred.units:
        if u.path not in post:
            continue  # WRAP-UNITS reports the missing unit
        where = u.path or "<root>"
        want = set(u.managed)
        if post[u.path] != want:
            out.append(violation("WRAP-FQNS", f"unit {where} manages {_diff(post[u.path], want)} after wrapping", tags, "kind:post-vs-oracle"))
        if u.path in sim and sim[u.path] != post[u.path]:
            out.append(
                violation("WRAP-FQNS", f"unit {where}: pre-wrap simulation says {_diff(sim[u.path], post[u.path])} against post-wrap", tags, "kind:sim-vs-post")
            )
    return out


@catalog.invariant(
    "WRAP-EXACTLY-ONCE",
    scenario=STRUCTURE,
    group="wrap",
    api="fsdp1",
    statement="Every non-ignored original parameter is managed by exactly one unit; ignored ones by none.",
    source=f"{DOC_FSDP}; {S000}",
)
def check_exactly_once(spec: CaseSpec, pred: FSDP1Prediction, obs: WrapObservation) -> list[Violation] | NotChecked:
    if not _wrapped(pred, obs):
        return _not_wrapped(pred, obs)
    tags = fsdp1_case_tags(spec, pred)
    counts = Counter(f for u in obs.units for f in u.managed)
    tied = {t.fqn for t in pred.ties}
    ignored = set(pred.ignored)
    out = []
    for fqn in pred.named_parameters:
        n = counts.get(fqn, 0)
        extra = {"param:tied"} if fqn in tied else set()
        if fqn in ignored and n:
            out.append(violation("WRAP-EXACTLY-ONCE", f"ignored parameter {fqn} is managed by {n} unit(s)", tags | extra, "kind:ignored-managed"))
        elif fqn not in ignored and n != 1:
            kind = "kind:unmanaged" if n == 0 else "kind:duplicated"
            out.append(violation("WRAP-EXACTLY-ONCE", f"parameter {fqn} is managed by {n} units", tags | extra, kind))
    return out


@catalog.invariant(
    "WRAP-STATE-DICT",
    scenario="fsdp1",
    group="wrap",
    api="fsdp1",
    statement="Clean state-dict FQNs (and named_parameters with use_orig_params=True) equal the unwrapped model's.",
    source=DOC_FSDP,
)
def check_state_dict(spec: CaseSpec, pred: FSDP1Prediction, obs: WrapObservation) -> list[Violation] | NotChecked:
    if not _wrapped(pred, obs):
        return _not_wrapped(pred, obs)
    tags = fsdp1_case_tags(spec, pred)
    if obs.state_dict_error and obs.state_dict_error.startswith("skipped:"):
        return NotChecked("no state_dict taken: the ranks built different units (RANKS-AGREE)")
    if obs.state_dict_error:
        return [violation("WRAP-STATE-DICT", f"state_dict() raised {obs.state_dict_error.splitlines()[0]}", tags, "kind:state-dict-raised")]
    out = []
    got, want = set(obs.state_dict_keys), set(pred.state_dict_keys)
    if got != want:
        # what kind of difference: keys missing, keys extra, FSDP's own flat-parameter keys
        shape = {"sd:missing"} if want - got else set()
        shape |= {"sd:extra"} if got - want else set()
        shape |= {"sd:flat-param"} if any("_flat_param" in k for k in got - want) else set()
        out.append(violation("WRAP-STATE-DICT", f"state_dict keys: {_diff(got, want)}", tags | shape, "kind:state-dict"))
    if spec.plan.use_orig_params:
        got, want = set(obs.named_parameters), set(pred.named_parameters)
        if got != want:
            out.append(violation("WRAP-STATE-DICT", f"named_parameters: {_diff(got, want)}", tags, "kind:named-parameters"))
    return out


# Which order differences a shared module explains.
# torch's known traversal bug (known failure fsdp1-frozen-check-shared-module-order)
# moves a shared module's subtree to its last registration; only modules in
# such a subtree can change places because of it. Any other order difference
# (siblings reversed, say) is not that finding and must stay a FAIL.


def _shared_prefixes(spec: CaseSpec) -> set[str]:
    out = set()
    for s in spec.shared:
        out.add(s.source)
        out.add(f"{s.parent}.{s.name}" if s.parent else s.name)
    return out


def _in_shared(spec: CaseSpec, path: str | None) -> bool:
    return path is not None and any(path == p or path.startswith(p + ".") for p in _shared_prefixes(spec))


def _order_outside_shared_agrees(spec: CaseSpec, got: list[str], want: list[str]) -> bool:
    """The two orders are the same once the modules of shared subtrees are left out."""
    return [m for m in got if not _in_shared(spec, m)] == [m for m in want if not _in_shared(spec, m)]


def _claims_shared_unit(spec: CaseSpec, units: tuple[UnitPrediction, ...], path: str | None) -> bool:
    """The same bug's other effect: torch's check visits a shared unit at its
    last registration, so a unit above an earlier registration (where
    _post_order_apply wraps it) is simulated first and its breadth-first walk
    claims the shared unit's parameters: ``path`` (not the root, whose
    simulation comes last) can look mixed although it is not."""
    if not path:
        return False

    g = graph_of(spec)
    for u in units:
        aliases = g.module_aliases(g.resolve_module(u.path))
        if len(aliases) > 1 and any(a.startswith(path + ".") for a in aliases[:-1]) and not aliases[-1].startswith(path + "."):
            return True
    return False


def _names_tags(spec: CaseSpec | None, fqns) -> set[str]:
    """What the FQNs a frozen-parameter message names are: ``names:aliased``
    if one is a parameter with more than one name (a tie, or a parameter of a
    shared module), ``names:unknown`` if one is no parameter of the model. A
    known finding about aliased parameters matches on the first, so that a
    message naming something the model lacks stays a FAIL."""
    if spec is None:
        return set()

    g, out = graph_of(spec), set()
    for fqn in fqns:
        try:
            pid = g.resolve_param(fqn)
        except KeyError:
            out.add("names:unknown")
            continue
        if len(g.aliases(pid)) > 1:
            out.add("names:aliased")
    if "names:unknown" in out:
        # a name the model lacks is no aliasing: the message is not explained by it
        out.discard("names:aliased")
    return out


def _named(spec: CaseSpec, msg: FrozenMessage) -> set[str]:
    return _names_tags(spec, (*(msg.trainable or ()), *(msg.frozen or ())))


def _frozen_mismatch(
    inv: str, msg: FrozenMessage, want: UnitPrediction, tags: set[str], numbers: bool, spec: CaseSpec | None = None,
    units: tuple[UnitPrediction, ...] = (),
) -> list[Violation] | NotChecked:
    where = want.path or "<root>"
    unit_tag = "unit:root" if want.path == "" else "unit:nonroot"
    if msg.module is None or msg.trainable is None:
        return [violation(inv, f"{msg.category} for {where} does not name the module and its parameters: {msg.text.splitlines()[0]!r}", tags, unit_tag, "kind:unparsed-message")]
    out = []
    if msg.module != want.path:
        moved = {"order:shared-subtree"} if spec is not None and (_in_shared(spec, msg.module) or _in_shared(spec, want.path)) else set()
        if spec is not None and _claims_shared_unit(spec, units, msg.module):
            moved.add("sim:claims-shared-unit")
        # names:aliased: the wrong module's message names a parameter with
        # two names (a shared module's, credited to another unit); one that
        # also names something the model lacks is names:unknown only (no
        # alias explains that)
        named = _named(spec, msg)
        named = {"names:unknown"} if "names:unknown" in named else named
        out.append(violation(inv, f"{msg.category} names module {msg.module or '<root>'}, expected {where}", tags | moved | named, unit_tag, "kind:wrong-module"))
        return out
    if set(msg.trainable) != set(want.trainable) or set(msg.frozen) != set(want.frozen):
        differ = (set(msg.trainable) ^ set(want.trainable)) | (set(msg.frozen or ()) ^ set(want.frozen))
        out.append(
            violation(inv, f"{msg.category} for {where}: trainable {_diff(set(msg.trainable), set(want.trainable))}; frozen {_diff(set(msg.frozen or ()), set(want.frozen))}", tags | _names_tags(spec, differ), unit_tag, "kind:wrong-fqns")
        )
    if numbers and (msg.total_numel, msg.trainable_numel) != (want.total_numel, want.trainable_numel):
        out.append(
            violation(inv, f"{msg.category} for {where} reports {msg.total_numel} numel instead of {msg.trainable_numel}; expected {want.total_numel} instead of {want.trainable_numel}", tags, unit_tag, "kind:wrong-numel")
        )
    return out


def _shared_parent_mix(spec: CaseSpec, err) -> set[str]:
    """mix:shared-parent: the mixed unit holds a parameter of a module that a
    shared module is registered under as its second name (a size policy may
    count the shared module's parameters there again and make that parent a
    unit of its own: fsdp1-callable-policy-wraps-shared-module-twice)."""
    parents = {s.parent for s in getattr(spec, "shared", ())}
    owners = {f.rpartition(".")[0] for f in tuple(err.trainable) + tuple(err.frozen)}
    return {"mix:shared-parent"} if parents & owners else set()


@catalog.invariant(
    "FROZEN-ERROR",
    scenario=STRUCTURE,
    group="frozen",
    api="fsdp1",
    statement="use_orig_params=False and a unit with mixed requires_grad: ValueError at wrap time naming the first violating unit in registration post-order, with its trainable and frozen FQNs.",
    source=S000,
)
def check_frozen_error(spec: CaseSpec, pred: FSDP1Prediction, obs: WrapObservation) -> list[Violation] | NotChecked:
    if pred.error is None:
        return NotChecked("no unit mixes requires_grad under use_orig_params=False")
    tags = fsdp1_case_tags(spec, pred)
    unit_tag = "unit:root" if pred.error.path == "" else "unit:nonroot"
    where = pred.error.path or "<root>"
    if obs.error is None:
        return [violation("FROZEN-ERROR", f"no error although unit {where} mixes requires_grad", tags | _shared_parent_mix(spec, pred.error),
                          unit_tag, "kind:no-error")]
    if obs.error.category != "ValueError":
        return [violation("FROZEN-ERROR", f"raised {obs.error.category}, not ValueError, for unit {where}: {obs.error.text.splitlines()[0]!r}", tags | error_tags(obs), unit_tag, "kind:wrong-type")]
    return _frozen_mismatch("FROZEN-ERROR", obs.error, pred.error, tags, numbers=False, spec=spec, units=pred.units)


@catalog.invariant(
    "FROZEN-WARN",
    scenario=STRUCTURE,
    group="frozen",
    api="fsdp1",
    statement="use_orig_params=True: one UserWarning per unit with mixed requires_grad, in post-order, with total and trainable numel and the FQNs.",
    source=S000,
)
def check_frozen_warn(spec: CaseSpec, pred: FSDP1Prediction, obs: WrapObservation) -> list[Violation] | NotChecked:
    if not spec.plan.use_orig_params or not pred.warnings:
        return NotChecked("no unit mixes requires_grad under use_orig_params=True")
    tags = fsdp1_case_tags(spec, pred)
    if obs.error is not None:
        return [violation("FROZEN-WARN", f"wrapping raised {obs.error.category} instead of warning: {obs.error.text.splitlines()[0]!r}", tags | error_tags(obs), "kind:raised")]
    got = {w.module: w for w in obs.warnings}
    out = []
    for want in pred.warnings:
        unit_tag = "unit:root" if want.path == "" else "unit:nonroot"
        w = got.pop(want.path, None)
        if w is None:
            out.append(violation("FROZEN-WARN", f"no warning for unit {want.path or '<root>'}, which mixes requires_grad", tags, unit_tag, "kind:missing-warning"))
            continue
        if w.category != "UserWarning":
            out.append(violation("FROZEN-WARN", f"{w.category} instead of UserWarning for {want.path or '<root>'}", tags, unit_tag, "kind:wrong-type"))
        out += _frozen_mismatch("FROZEN-WARN", w, want, tags, numbers=True, spec=spec)
    for path in got:
        out.append(violation("FROZEN-WARN", f"warning for unit {path or '<root>'}, which does not mix requires_grad", tags | _named(spec, got[path]), "kind:spurious-warning"))
    # The order of the warnings that are there, whatever else is wrong (a
    # missing root warning, a known failure, must not hide siblings warned in
    # the wrong order: a traversal-order mutant).
    want_paths, got_paths = {w.path for w in pred.warnings}, {w.module for w in obs.warnings}
    got_order = [w.module for w in obs.warnings if w.module in want_paths]
    want_order = [w.path for w in pred.warnings if w.path in got_paths]
    if got_order != want_order:
        moved = {"order:shared-subtree"} if _order_outside_shared_agrees(spec, got_order, want_order) else set()
        out.append(violation("FROZEN-WARN", f"warnings in order {got_order}, expected post-order {want_order}", tags | moved, "kind:order"))
    return out


@catalog.invariant(
    "FROZEN-CLEAN",
    scenario=STRUCTURE,
    group="frozen",
    api="fsdp1",
    statement="No frozen-parameter error and no warning when every unit's requires_grad is uniform.",
    source=S000,
)
def check_frozen_clean(spec: CaseSpec, pred: FSDP1Prediction, obs: WrapObservation) -> list[Violation] | NotChecked:
    if pred.error is not None or pred.warnings:
        return NotChecked("a unit mixes requires_grad (FROZEN-ERROR / FROZEN-WARN)")
    tags = fsdp1_case_tags(spec, pred)
    out = []
    if obs.error is not None and obs.error.module is not None:
        out.append(violation("FROZEN-CLEAN", f"frozen-parameter {obs.error.category} for {obs.error.module or '<root>'}, whose requires_grad is uniform", tags | _named(spec, obs.error), "kind:spurious-error"))
    for w in obs.warnings:
        out.append(violation("FROZEN-CLEAN", f"frozen-parameter warning for {w.module or '<root>'}, whose requires_grad is uniform", tags | _named(spec, w), "kind:spurious-warning"))
    return out


def _tie_rejection(pred: FSDP1Prediction, obs: WrapObservation) -> bool:
    """FSDP refused a case with a cross-unit tie with an error that says so."""
    if obs.error is None or not pred.ties:
        return False
    text = obs.error.text.lower()
    return any(w in text for w in ("shared", "tied", "tying"))


@catalog.invariant(
    "TIES",
    scenario=STRUCTURE,
    group="ties",
    api="fsdp1",
    statement="A parameter tied across modules is managed once, its aliases stay one tensor, and a unit below the users' lowest common ancestor is rejected with a clear error; silent duplication is a finding.",
    source=f"{S000} (awgu: shared parameters must be assigned to the lowest common ancestor or higher)",
)
def check_ties(spec: CaseSpec, pred: FSDP1Prediction, obs: WrapObservation) -> list[Violation] | NotChecked:
    if not pred.ties:
        return NotChecked("no tied parameter")
    if pred.error is not None:
        return NotChecked("FSDP1 must reject the case for a mixed unit (FROZEN-ERROR)")
    tags = fsdp1_case_tags(spec, pred)
    if obs.error is not None:
        if _tie_rejection(pred, obs) and any(t.below_lca for t in pred.ties):
            return []
        return [violation("TIES", f"wrapping raised {obs.error.category} without naming the tie: {obs.error.text.splitlines()[0]!r}", tags | error_tags(obs), "kind:unclear-rejection")]
    counts = Counter(f for u in obs.units for f in u.managed)
    intact = dict(obs.ties_intact)
    out = []
    for t in pred.ties:
        if counts.get(t.fqn, 0) > 1:
            out.append(violation("TIES", f"tied parameter {t.fqn} (aliases {list(t.aliases)}) is silently duplicated into {counts[t.fqn]} units", tags, "kind:duplicated"))
        if intact.get(t.fqn) is False:
            out.append(violation("TIES", f"aliases {list(t.aliases)} no longer share one tensor after wrapping", tags, "kind:broken"))
        if t.below_lca:
            out.append(
                violation("TIES", f"tied parameter {t.fqn} is managed by unit {t.unit or '<root>'} below its users' common ancestor {t.lca or '<root>'}, and FSDP accepted it silently", tags, "kind:below-lca-accepted")
            )
    return out


@catalog.invariant(
    "RANKS-AGREE",
    scenario="fsdp1",
    group="ranks",
    api="fsdp1",
    statement="Every rank wraps the same units with the same parameters and sees the same errors, warnings and state-dict keys.",
    source=f"{DOC_FSDP} (SPMD: every rank must construct the same FSDP instances, or collectives mismatch)",
    all_ranks=True,
)
def check_ranks_agree(spec: CaseSpec, pred: FSDP1Prediction, obs: list[WrapObservation]) -> list[Violation] | NotChecked:
    return ranks_agree(obs, fsdp1_case_tags(spec, pred)) if len(obs) > 1 else []


INVARIANTS = tuple(catalog.invariants)
