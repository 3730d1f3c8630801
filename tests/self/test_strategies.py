"""The strategies' own tests: drawn specs validate, build and round-trip; every
feature is generated; failures shrink to small trees; bad arguments fail early."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from conformance.case.build import build
from conformance.case.spec import (
    CONTAINER_BASES,
    CUSTOM_KWARGS,
    LEAF_TYPES,
    CaseSpec,
    ClassSpec,
    CustomWrap,
    LambdaWrap,
    ModuleSpec,
    ModuleWrap,
    ParamSpec,
    SizeBasedWrap,
    TransformerWrap,
    WrapPlan,
    module_at,
    validate,
)
from conformance.case.tree import join, walk
from conformance.strategies import (
    FREEZE_KINDS,
    POLICY_KINDS,
    SHARED_KINDS,
    TIE_KINDS,
    apply_freeze_mask,
    case_specs,
    freeze_masks,
    module_trees,
    policies,
    shared_modules,
    subtree_numels,
    ties,
    wrap_plans,
)

pytestmark = pytest.mark.selfcheck

_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


def _settings(n: int, **kw) -> settings:
    return settings(max_examples=n, database=None, deadline=None, suppress_health_check=_QUIET, **kw)


def _first(n: int) -> settings:
    """For find() where any example with the property serves (a spec to
    change into an invalid one): the first drawn, not shrunk (the shrink of
    one microbatch spec took up to 12 s)."""
    return _settings(n, phases=[Phase.generate])


# ---- facts about a spec, computed from the spec alone -----------------------------------


def _bases(spec: CaseSpec) -> dict[str, str]:
    return {c.name: c.base for c in spec.classes}


def _kind(spec: CaseSpec, cls: str) -> str:
    bases = _bases(spec)
    while cls in bases:
        cls = bases[cls]
    return cls


def _ancestors(spec: CaseSpec, cls: str) -> list[str]:
    bases = _bases(spec)
    out = [cls]
    while out[-1] in bases:
        out.append(bases[out[-1]])
    return out


def _parent(path: str) -> str | None:
    return None if path == "" else path.rpartition(".")[0]


def _depth(path: str) -> int:
    return 0 if path == "" else path.count(".") + 1


def _owner(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def _relation(a: str, b: str) -> str:
    """How module paths a and b relate (the words TIE_KINDS uses)."""
    if a == b:
        return "same_module"
    if _parent(a) == _parent(b):
        return "siblings"
    if _parent(a) == b or _parent(b) == a:
        return "parent_child"
    return "different_depths" if _depth(a) != _depth(b) else "cousins"


def _shared_relation(parent: str, source: str) -> str:
    if _parent(source) == parent:
        return "same_parent"
    if parent and _parent(parent) == _parent(source):
        return "siblings"
    if parent == "" or source.startswith(parent + "."):
        return "ancestor"
    return "other_branch"


def _is_head_tie(spec: CaseSpec, t) -> bool:
    return (
        module_at(spec.tree, _owner(t.source)).cls == "Embedding"
        and module_at(spec.tree, t.module).cls == "Linear"
        and t.name == "weight"
    )


def _freeze_kind(spec: CaseSpec) -> str | None:
    params = {join(p, q.name): q for p, m in walk(spec.tree) for q in m.params}
    if not params:
        return None
    trainable = {f for f, q in params.items() if q.requires_grad}
    if trainable == set(params):
        return "trainable"
    if not trainable:
        return "frozen"
    if trainable == {f for f in params if f.rpartition(".")[2] == "bias"}:
        return "biases"
    adapters = {f for f in params if any(part.startswith(("lora", "adapter")) for part in f.split(".")[:-1])}
    if trainable == adapters:
        return "adapters"
    # frozen_subtrees: the frozen parameters are exactly those below a few
    # inner modules (each holding two or more parameters), all else trainable.
    frozen = set(params) - trainable
    roots = [
        p for p, m in walk(spec.tree)
        if p and m.children and len(below := {f for f in params if f.startswith(p + ".")}) >= 2 and below <= frozen
    ]
    if roots and frozen == {f for f in params for r in roots if f.startswith(r + ".")}:
        return "frozen_subtrees"
    return "random"


def features(spec: CaseSpec) -> set[str]:
    """What a spec exercises, named for the coverage test."""
    out: set[str] = set()
    mods = list(walk(spec.tree))
    bases = _bases(spec)
    out.add(f"modules>={20 if len(mods) >= 20 else 10 if len(mods) >= 10 else 1}")
    if max(_depth(p) for p, _ in mods) == 4:
        out.add("depth 4")
    for c in spec.classes:
        if c.base in bases:
            out.add("class derives from a drawn class")
        if c.base != "Module" and c.base in CONTAINER_BASES:
            out.add(f"drawn {c.base} subclass")
    for path, m in mods:
        if m.cls in LEAF_TYPES or m.cls in CONTAINER_BASES:
            out.add(f"torch {m.cls}")
        elif m.params and m.children:
            out.add("params on an inner module")
        elif not m.params:
            out.add("parameterless drawn module")
        if m.buffers:
            out.add("buffer")
        kinds = ["leaf" if c.cls in LEAF_TYPES else "inner" for c in m.children]
        if "leaf" in kinds and "inner" in kinds and kinds.index("leaf") > kinds.index("inner"):
            out.add("inner registered before a leaf")
    for s in spec.shared:
        out.add(f"shared: {_shared_relation(s.parent, s.source)}")
    own = {join(p, q.name) for p, m in mods for q in m.params}
    for t in spec.ties:
        out.add("tie: embedding_head" if _is_head_tie(spec, t) else f"tie: {_relation(_owner(t.source), t.module)}")
        out.add("tie replaces a parameter" if join(t.module, t.name) in own else "tie adds an attribute")
    pol = spec.plan.policy
    out.add(f"policy: {type(pol).__name__ if pol is not None else None}")
    if isinstance(pol, CustomWrap) and pol.kwargs:
        out.add("policy: CustomWrap with kwargs")
    if isinstance(pol, (ModuleWrap, TransformerWrap)):
        used = {m.cls for _, m in mods}
        if set(pol.classes) & (set(LEAF_TYPES) | set(CONTAINER_BASES)):
            out.add("policy names a torch class")
        derived = {b for c in used if c in bases for b in _ancestors(spec, c)[1:]}
        if set(pol.classes) & derived & set(bases):
            out.add("policy matches a subclass by its drawn base")
    if isinstance(pol, SizeBasedWrap):
        sizes = set(subtree_numels(spec).values())
        for delta, word in ((0, "exact"), (1, "plus one"), (-1, "minus one")):
            if pol.min_num_params - delta in sizes:
                out.add(f"size policy: {word}")
    fk = _freeze_kind(spec)
    if fk:
        out.add(f"freeze: {fk}")
    if spec.plan.ignored_modules:
        out.add("ignored modules")
    if spec.plan.ignored_params:
        out.add("ignored params")
    out.add(f"use_orig_params={spec.plan.use_orig_params}")
    out.add(f"api={spec.plan.api}")
    return out


EXPECTED_FEATURES = (
    {"modules>=1", "modules>=10", "modules>=20", "depth 4"}
    | {"class derives from a drawn class", "params on an inner module", "parameterless drawn module", "buffer"}
    | {f"drawn {b} subclass" for b in ("ModuleList", "Sequential", "ModuleDict")}
    | {f"torch {c}" for c in (*LEAF_TYPES, "ModuleList", "Sequential", "ModuleDict")}
    | {"inner registered before a leaf"}
    | {f"shared: {k}" for k in SHARED_KINDS}
    | {f"tie: {k}" for k in TIE_KINDS}
    | {"tie replaces a parameter", "tie adds an attribute"}
    | {f"policy: {getattr(k, '__name__', k)}" for k in POLICY_KINDS}
    | {"policy: CustomWrap with kwargs", "policy names a torch class", "policy matches a subclass by its drawn base"}
    | {"size policy: exact", "size policy: plus one", "size policy: minus one"}
    | {f"freeze: {k}" for k in FREEZE_KINDS}
    | {"ignored modules", "ignored params", "use_orig_params=True", "use_orig_params=False", "api=fsdp1", "api=fsdp2"}
)


def _n_modules(spec: CaseSpec) -> int:
    return sum(1 for _ in walk(spec.tree))


# ---- every drawn spec is valid, builds, and round-trips ------------------------------------


def _check_structure(spec: CaseSpec, max_modules: int = 24, max_depth: int = 4) -> None:
    validate(spec)
    mods = list(walk(spec.tree))
    assert len(mods) <= max_modules
    assert max(_depth(p) for p, _ in mods) <= max_depth
    assert spec.tree.cls in _bases(spec), "the root is a drawn class (torch's classes have no usable forward there)"
    targets = {join(t.module, t.name) for t in spec.ties}
    for path, m in mods:
        assert m.cls != "Module", "nn.Module itself has no forward"
        if m.cls in CONTAINER_BASES:
            assert not m.params, "torch's containers never read parameters"
        for p in m.params:
            assert all(1 <= d <= 8 for d in p.shape)
    for s in spec.shared:
        assert module_at(spec.tree, s.parent).cls not in LEAF_TYPES
    params = {join(p, q.name): q for p, m in mods for q in m.params}
    for t in spec.ties:
        assert t.source not in targets, "no tie chains"
        if join(t.module, t.name) in params:
            assert params[join(t.module, t.name)].requires_grad == params[t.source].requires_grad
    pol = spec.plan.policy
    if isinstance(pol, SizeBasedWrap):
        sizes = set(subtree_numels(spec).values())
        assert {pol.min_num_params - 1, pol.min_num_params, pol.min_num_params + 1} & sizes
    if isinstance(pol, CustomWrap):
        for _, kw in pol.kwargs:
            assert all(v in CUSTOM_KWARGS[k] for k, v in kw)
    if spec.plan.api == "fsdp2":
        assert not spec.plan.ignored_modules
    assert not (spec.plan.ignored_modules and spec.plan.ignored_params)


@_settings(400)
@given(case_specs(apis=st.sampled_from(["fsdp1", "fsdp2"])))
def test_drawn_specs_are_valid_and_well_formed(spec):
    _check_structure(spec)
    assert CaseSpec.from_json(spec.to_json()) == spec
    ns: dict = {}
    exec(spec.to_python(), ns)
    assert ns["spec"] == spec


@_settings(120)
@given(case_specs())
def test_drawn_specs_build_and_run(spec):
    built = build(spec)
    model = built.model
    # ties and shared modules are the very objects the spec says
    for t in spec.ties:
        src = built.modules[_owner(t.source)]
        assert getattr(built.modules[t.module], t.name) is getattr(src, t.source.rpartition(".")[2])
    for s in spec.shared:
        assert getattr(built.modules[s.parent], s.name) is built.modules[s.source]
    for path, m in walk(spec.tree):
        for p in m.params:
            assert getattr(built.modules[path], p.name).requires_grad == p.requires_grad
    # subtree_numels is what module.parameters() holds in the built model
    sizes = subtree_numels(spec)
    for path, mod in built.modules.items():
        assert sum(p.numel() for p in mod.parameters()) == sizes[path], path
    out = model(built.example_input()).sum()
    if out.requires_grad:
        out.backward()
        for p in model.parameters():
            if p.requires_grad:
                assert p.grad is not None, "every trainable parameter takes part in forward"


@_settings(150)
@given(st.data())
def test_size_arguments_bound_the_tree(data):
    max_modules = data.draw(st.integers(1, 30), label="max_modules")
    max_depth = data.draw(st.integers(0, 5), label="max_depth")
    spec = data.draw(case_specs(max_modules=max_modules, max_depth=max_depth), label="spec")
    _check_structure(spec, max_modules, max_depth)


@_settings(100)
@given(case_specs(allow_ties=False, allow_shared=False, allow_ignored=False, freeze=False, policies=[None]))
def test_switches_turn_features_off(spec):
    assert not spec.ties and not spec.shared
    assert spec.plan.policy is None
    assert not spec.plan.ignored_modules and not spec.plan.ignored_params
    assert all(p.requires_grad for _, m in walk(spec.tree) for p in m.params)


# ---- the parts, each on its own -------------------------------------------------------------


@_settings(60)
@given(st.data())
def test_freeze_masks_of_each_kind(data):
    tree, classes = data.draw(module_trees(max_modules=12), label="tree")
    kind = data.draw(st.sampled_from(FREEZE_KINDS), label="kind")
    mask = data.draw(freeze_masks(tree, classes, kinds=[kind]), label="freeze mask")
    fqns = [join(p, q.name) for p, m in walk(tree) for q in m.params]
    assert list(mask) == fqns
    if kind == "trainable":
        assert all(mask.values())
    elif kind == "frozen":
        assert not any(mask.values())
    elif kind == "biases":
        assert all(v == (f.rpartition(".")[2] == "bias") for f, v in mask.items())
    elif kind == "adapters":
        assert all(v == any(x.startswith(("lora", "adapter")) for x in f.split(".")[:-1]) for f, v in mask.items())
    frozen_tree = apply_freeze_mask(tree, mask)
    assert {join(p, q.name): q.requires_grad for p, m in walk(frozen_tree) for q in m.params} == mask


@_settings(80)
@given(st.data())
def test_ties_of_each_kind(data):
    tree, classes = data.draw(module_trees(), label="tree")
    kind = data.draw(st.sampled_from(TIE_KINDS), label="kind")
    drawn = data.draw(ties(tree, classes, max_size=3, kinds=[kind]), label="ties")
    spec = CaseSpec(tree=tree, classes=classes, ties=drawn)  # validates
    assert len(drawn) <= 3
    for t in drawn:
        if kind == "embedding_head":
            assert _is_head_tie(spec, t)
        else:
            assert _relation(_owner(t.source), t.module) == kind


@_settings(80)
@given(st.data())
def test_shared_modules_of_each_kind(data):
    tree, classes = data.draw(module_trees(), label="tree")
    kind = data.draw(st.sampled_from(SHARED_KINDS), label="kind")
    drawn = data.draw(shared_modules(tree, classes, min_size=1, max_size=3, kinds=[kind]), label="shared")
    CaseSpec(tree=tree, classes=classes, shared=drawn)  # validates
    for s in drawn:
        assert _shared_relation(s.parent, s.source) == kind


def _hand_written_tree() -> tuple[ModuleSpec, tuple]:
    # Attribute names the strategies would otherwise pick for what they add.

    lin = ModuleSpec("shared0", "Linear", (ParamSpec("weight", (2, 2)),))
    block = ModuleSpec("b", "M", (ParamSpec("tied0", (2, 2)),), children=(ModuleSpec("tied1", "Linear", (ParamSpec("weight", (2, 2)),)),))
    return ModuleSpec("", "M", (ParamSpec("tied0", (2,)),), children=(lin, block)), (ClassSpec("M"),)


@_settings(40)
@given(st.data())
def test_added_names_avoid_a_hand_written_trees_names(data):
    tree, classes = _hand_written_tree()
    shared = data.draw(shared_modules(tree, classes, min_size=1), label="shared")
    drawn = data.draw(ties(tree, classes, min_size=1), label="ties")
    CaseSpec(tree=tree, classes=classes, shared=shared, ties=drawn)  # validates
    assert shared and drawn


@_settings(80)
@given(st.data())
def test_policies_and_plans_for_a_spec(data):
    spec = data.draw(case_specs(), label="spec")
    kind = data.draw(st.sampled_from(POLICY_KINDS), label="kind")
    pol = data.draw(policies(spec, kinds=[kind]), label="policy")
    assert pol is None if kind is None else isinstance(pol, kind)
    plan = data.draw(wrap_plans(spec, apis=st.just("fsdp2"), use_orig_params=st.just(True)), label="plan")
    new = CaseSpec(tree=spec.tree, classes=spec.classes, shared=spec.shared, ties=spec.ties, plan=plan)
    assert new.plan.api == "fsdp2" and new.plan.use_orig_params and not new.plan.ignored_modules


# ---- coverage: every feature is generated ------------------------------------------------


def test_every_feature_is_generated():
    seen: Counter = Counter()

    @_settings(1200, derandomize=True, phases=[Phase.generate])
    @given(case_specs(apis=st.sampled_from(["fsdp1", "fsdp2"])))
    def collect(spec):
        seen.update(features(spec))

    collect()
    missing = EXPECTED_FEATURES - set(seen)
    assert not missing, f"never generated: {sorted(missing)}; counts: {dict(seen)}"


# ---- shrinking ends at small trees ------------------------------------------------------


def _mixed_custom_target(spec: CaseSpec) -> bool:
    pol = spec.plan.policy
    if not isinstance(pol, CustomWrap):
        return False
    for t in pol.targets:
        grads = {q.requires_grad for _, m in walk(module_at(spec.tree, t), t) for q in m.params}
        if grads == {True, False}:
            return True
    return False


def _cross_module_tie(spec: CaseSpec) -> bool:
    return any(_owner(t.source) != t.module for t in spec.ties)


def _shared_leaf_in_other_branch(spec: CaseSpec) -> bool:
    return any(
        module_at(spec.tree, s.source).cls in LEAF_TYPES and _shared_relation(s.parent, s.source) == "other_branch"
        for s in spec.shared
    )


@pytest.mark.parametrize(
    "predicate", [_mixed_custom_target, _cross_module_tie, _shared_leaf_in_other_branch], ids=lambda f: f.__name__.strip("_")
)
def test_failures_shrink_to_small_trees(predicate):
    spec = find(case_specs(), predicate, settings=_settings(3000), random=random.Random(0))
    assert predicate(spec)
    assert _n_modules(spec) <= 5, spec.to_python()
    assert spec.seed == 0
    assert not spec.plan.ignored_modules and not spec.plan.ignored_params


# ---- argument validation -----------------------------------------------------------------


_TREE = ModuleSpec("", "M")


def _spec() -> CaseSpec:
    from conformance.case.spec import ClassSpec

    return CaseSpec(tree=_TREE, classes=(ClassSpec("M"),))


@pytest.mark.parametrize(
    "call",
    [
        lambda: case_specs(max_modules=0),
        lambda: case_specs(trees=(_TREE, ())),
        lambda: case_specs(max_modules=2.5),
        lambda: case_specs(max_modules=True),
        lambda: case_specs(max_depth=-1),
        lambda: case_specs(apis="fsdp1"),
        lambda: case_specs(use_orig_params=True),
        lambda: case_specs(policies=["ModuleWrap"]),
        lambda: case_specs(policies=[]),
        lambda: case_specs(policies=ModuleWrap),
        lambda: case_specs(allow_ties=1),
        lambda: case_specs(freeze="yes"),
        lambda: module_trees(max_modules=-3),
        lambda: module_trees(max_depth="4"),
        lambda: freeze_masks("tree"),
        lambda: freeze_masks(_TREE, kinds=["bogus"]),
        lambda: freeze_masks(_TREE, kinds="random"),
        lambda: ties(_TREE, max_size=-1),
        lambda: ties(_TREE, min_size=3, max_size=2),
        lambda: ties(_TREE, kinds=[]),
        lambda: shared_modules(_TREE, classes=["M"]),
        lambda: shared_modules(_TREE, kinds=["cousins"]),
        lambda: policies("spec"),
        lambda: policies(_spec(), kinds=[LambdaWrap, "Lambda"]),
        lambda: wrap_plans(_spec(), apis=["fsdp1"]),
        lambda: wrap_plans(_spec(), allow_ignored=None),
        lambda: subtree_numels(_TREE),
    ],
)
def test_bad_arguments_fail_at_call_time(call):
    with pytest.raises(InvalidArgument):
        call()


@pytest.mark.parametrize(
    "strategy, message",
    [
        (case_specs(apis=st.just("fsdp3")), "apis generated 'fsdp3'"),
        (case_specs(use_orig_params=st.just(1)), "use_orig_params generated 1"),
    ],
)
def test_a_strategy_that_generates_bad_values_fails_clearly(strategy, message):
    @_settings(1)
    @given(strategy)
    def draw(spec):
        pass

    with pytest.raises(InvalidArgument, match=message):
        draw()

# Drawing speed is measured by `fsdp-conformance bench` (draw ms per example),
# not by a timed test: this machine is shared and noisy.


def test_several_mixed_units_mixes_two_to_four_non_root_units():
    """several_mixed_units' contract: 2..4 non-root units, each with one
    parameter frozen among trainable ones (it gave one unit in a quarter of
    its draws, a repeated pick dropped), and no draw rejected for a policy
    that made too few units (it rejected five in six)."""
    from conformance.areas.common.fsdp1_oracle import predict_fsdp1
    from conformance.case.graph import ModelGraph
    from conformance.strategies.frozen_units import several_mixed_units

    seen = Counter()

    @settings(max_examples=60, deadline=None, database=None, suppress_health_check=_QUIET)
    @given(spec=several_mixed_units())
    def check(spec):
        g = ModelGraph(spec)
        mixed = [u for u in predict_fsdp1(spec).units
                 if u.path and len({g.requires_grad(g.resolve_param(f)) for f in u.managed}) == 2]
        assert 2 <= len(mixed) <= 4, (spec, mixed)
        seen[len(mixed)] += 1

    check()
    assert seen[2] and sum(seen.values()) >= 60


def _lin(name: str, bias: bool = True) -> ModuleSpec:
    return ModuleSpec(name, "Linear", (ParamSpec("weight", (2, 2)),) + ((ParamSpec("bias", (2,)),) if bias else ()))


@pytest.mark.parametrize(
    "children, room",
    [
        ((_lin("a"), _lin("b")), True),  # two siblings of two parameters each
        ((_lin("a"), _lin("b", bias=False)), False),  # the second holds one
        ((ModuleSpec("blk", "M", children=(_lin("a"), _lin("b"))),), True),  # disjoint below one child
        ((ModuleSpec("blk", "M", children=(_lin("a", bias=False), _lin("b", bias=False))),), False),  # only blk holds two
        ((ModuleSpec("blk", "M", children=(_lin("a", bias=False), _lin("b", bias=False))), _lin("c")), True),
    ],
)
def test_several_mixed_units_draws_only_trees_with_room_for_two_units(children, room):
    """The tree filter that replaced most of several_mixed_units' rejected
    draws: two non-root modules, neither inside the other, holding two
    parameters or more each (the root's own parameters do not count)."""
    from conformance.strategies.frozen_units import _room_for_two_units

    tree = ModuleSpec("", "M", (ParamSpec("scale", (2,)),), children=children)
    assert _room_for_two_units((tree, (ClassSpec("M"),))) is room


def test_several_mixed_units_aims_only_at_modules_with_a_disjoint_partner():
    """The fallback CustomWrap: a first pick that contains every other
    holder (blk here) would leave it one target short, a rejected draw; and
    parameters the plan ignores make no unit."""
    from conformance.strategies.frozen_units import _disjoint_targets

    tree = ModuleSpec("", "M", children=(ModuleSpec("blk", "M", children=(_lin("a"), _lin("b"), _lin("c"))),))
    spec = CaseSpec(tree=tree, classes=(ClassSpec("M"),), plan=WrapPlan(api="fsdp1", ignored_params=("blk.c.bias",)))
    validate(spec)
    seen = set()

    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=_QUIET)
    @given(st.data())
    def check(data):
        policy = data.draw(st.composite(lambda draw: _disjoint_targets(draw, spec))())
        seen.add(policy.targets)

    check()
    assert seen == {("blk.a", "blk.b")}


def test_init_specs_register_a_parameter_anew_only_under_fsdp2():
    """InitPlan.replace: FSDP2 draws it (on a parameter no other name
    reaches), FSDP1 never; validation refuses it where there is none."""
    import dataclasses

    from hypothesis.errors import NoSuchExample

    from conformance.case.spec import (
        ClassSpec,
        InitPlan,
        ModuleSpec,
        ParamSpec,
        ShardGroup,
        SpecError,
        TiedParam,
        WrapPlan,
        replaced_parameter,
    )
    from conformance.strategies.init_order import init_specs

    spec = find(init_specs(api="fsdp2"), lambda s: s.init.replace, settings=_first(500), random=random.Random(0))
    fqn = replaced_parameter(spec)
    assert fqn is not None and sum(1 for f, _ in _aliases(spec) if f == fqn) == 1
    with pytest.raises(NoSuchExample):
        find(init_specs(api="fsdp1"), lambda s: s.init.replace, settings=_settings(300), random=random.Random(0))
    tree = ModuleSpec("", "Model", (ParamSpec("a", (2,)),), children=(ModuleSpec("b", "Block", (ParamSpec("w", (2,)),)),))
    base = dataclasses.replace(spec, tree=tree, classes=(ClassSpec("Model"), ClassSpec("Block")), shared=(), ties=(),
                               plan=WrapPlan(api="fsdp2", groups=(ShardGroup(("b",)),)), init=InitPlan(replace=True))
    assert replaced_parameter(base) == "a"
    tied = dataclasses.replace(base, init=None, ties=(TiedParam("b", "w", "a"),))
    assert replaced_parameter(tied) is None
    with pytest.raises(SpecError, match="no parameter to replace"):
        dataclasses.replace(tied, init=InitPlan(replace=True))
    with pytest.raises(SpecError, match="FSDP2 case"):
        dataclasses.replace(base, plan=WrapPlan(api="fsdp1"))

def _aliases(spec):
    from conformance.case.graph import ModelGraph

    g = ModelGraph(spec)
    return [(f, pid) for f, pid in g.named_parameters(remove_duplicate=False)]


def test_microbatch_specs_abort_in_forward_and_backward_at_a_called_module():
    """MicrobatchAbort: both phases drawn, at a module whose forward runs,
    with no microbatch up to the aborted one setting reshard_after_forward; validation refuses
    a torch container (its hooks never fire), an unknown module or phase, and
    a setting reset_iter_state would carry over."""
    import dataclasses

    from conformance.case.spec import CONTAINER_BASES, MicrobatchAbort, MicrobatchPlan, MicrobatchStep, SpecError, module_at, validate
    from conformance.strategies.microbatch import microbatch_specs

    phases: Counter = Counter()

    @_settings(300, derandomize=True, phases=[Phase.generate])
    @given(microbatch_specs())
    def collect(spec):
        a = spec.microbatch.abort
        if a is not None:
            phases[a.phase] += 1
            assert module_at(spec.tree, a.at).cls not in CONTAINER_BASES
            assert all(s.reshard_after_forward is None for s in spec.microbatch.microbatches[: a.before + 1])

    collect()
    assert phases["forward"] and phases["backward"], phases
    spec = find(microbatch_specs(), lambda s: s.microbatch.abort is not None and any(
        m.cls in CONTAINER_BASES for _, m in walk(s.tree)), settings=_first(500), random=random.Random(0))
    container = next(p for p, m in walk(spec.tree) if m.cls in CONTAINER_BASES)
    for bad, message in ((MicrobatchAbort(0, container, "forward"), "torch container"),
                         (MicrobatchAbort(0, "nowhere", "forward"), "not a module"),
                         (MicrobatchAbort(0, "", "optimizer"), "phase one of"),
                         (MicrobatchAbort(len(spec.microbatch.microbatches), "", "forward"), "before indexes")):
        with pytest.raises(SpecError, match=message):
            validate(dataclasses.replace(spec, microbatch=dataclasses.replace(spec.microbatch, abort=bad)))
    steps = (MicrobatchStep(), MicrobatchStep(reshard_after_forward=False), MicrobatchStep())
    with pytest.raises(SpecError, match="up to the aborted one sets reshard_after_forward"):
        validate(dataclasses.replace(spec, microbatch=MicrobatchPlan(steps, abort=MicrobatchAbort(1, "", "forward"))))


def test_microbatch_specs_keep_backward_unshards_only_for_groups_backward_does_not_read():
    """no_unshard_in_backward: drawn, only for groups holding no Linear or
    LayerNorm parameter (set_unshard_in_backward's condition, its parameters
    unread by backward); validation refuses a group that holds one, and a
    module not given to fully_shard."""
    import dataclasses

    from conformance.case.spec import SpecError, backward_free_group, validate
    from conformance.strategies.microbatch import microbatch_specs

    seen: Counter = Counter()

    @_settings(300, derandomize=True, phases=[Phase.generate])
    @given(microbatch_specs())
    def collect(spec):
        for path in spec.microbatch.no_unshard_in_backward:
            assert backward_free_group(spec, path)
            seen[module_at(spec.tree, path).cls] += 1

    collect()
    assert seen["Embedding"] and sum(seen.values()) > seen["Embedding"], seen
    spec = find(microbatch_specs(), lambda s: any(not backward_free_group(s, g.modules[0]) for g in s.plan.groups),
                settings=_first(500), random=random.Random(0))
    reads = next(g.modules[0] for g in spec.plan.groups if not backward_free_group(spec, g.modules[0]))
    groups = {m for g in spec.plan.groups for m in g.modules}
    outside = next(p for p, _ in walk(spec.tree) if p not in groups)
    for bad, message in ((reads, "holds a parameter backward reads"), (outside, "not a module given to fully_shard")):
        with pytest.raises(SpecError, match=message):
            validate(dataclasses.replace(spec, microbatch=dataclasses.replace(spec.microbatch, no_unshard_in_backward=(bad,))))


def test_microbatch_specs_draw_all_reduce_hooks_and_custom_comms_on_groups_with_parameters():
    """all_reduce_hook and custom_comms: drawn, on groups (their first
    module) that have parameters, the root's included (and a separate
    reduce-scatter group from the first microbatch, sometimes dropped and
    taken again later); each hooked group
    with a scale of its own and every microbatch all-reducing; validation
    refuses a repeated scale, a scale that is no power of two, a hook with
    set_requires_all_reduce(False) and a module that names no group."""
    import dataclasses

    from conformance.areas.common.fsdp2_oracle import predict_fsdp2
    from conformance.case.spec import MicrobatchStep, SpecError, validate
    from conformance.strategies._common import ANY_TORCH
    from conformance.strategies.microbatch import microbatch_specs

    seen: Counter = Counter()

    @_settings(300, derandomize=True, phases=[Phase.generate])
    @given(microbatch_specs())
    def collect(spec):
        mb = spec.microbatch
        with_params = {g.modules[0] for g in predict_fsdp2(spec, ANY_TORCH).groups if g.managed}
        scales = [s for _, s in mb.all_reduce_hook]
        assert len(set(scales)) == len(scales)
        assert {p for p, _ in mb.all_reduce_hook} <= with_params and set(mb.custom_comms) <= with_params
        if mb.all_reduce_hook:
            assert all(s.all_reduce for s in mb.microbatches)
            seen["hook"] += 1
            seen["hook on the root"] += any(p == "" for p, _ in mb.all_reduce_hook)
            seen["several hooks"] += len(scales) > 1
        seen["custom"] += bool(mb.custom_comms)
        seen["both"] += bool(mb.all_reduce_hook and mb.custom_comms)
        separate = [s.separate_reduce_scatter for s in mb.microbatches]
        if any(x is not None for x in separate):
            assert separate[0] is True  # from the first microbatch on
            seen["separate"] += 1
            seen["separate, then the shard group"] += False in separate

    collect()
    assert all(seen[k] for k in ("hook", "hook on the root", "several hooks", "custom", "both", "separate",
                                 "separate, then the shard group")), seen
    def ungrouped(s):
        return [p for p, _ in walk(s.tree) if p and p not in {m for g in s.plan.groups for m in g.modules}]

    spec = find(microbatch_specs(), lambda s: len(s.microbatch.all_reduce_hook) >= 2 and ungrouped(s), settings=_first(500),
                random=random.Random(0))
    (a, _), (b, _) = spec.microbatch.all_reduce_hook[:2]
    outside = ungrouped(spec)[0]
    no_all_reduce = (MicrobatchStep(all_reduce=False, sync=True),) + spec.microbatch.microbatches
    for changes, message in (({"all_reduce_hook": ((a, 2.0), (b, 2.0))}, "a scale of its own"),
                             ({"all_reduce_hook": ((a, 3.0),)}, "not a power of two"),
                             ({"all_reduce_hook": ((a, 1.0),)}, "not a power of two"),
                             ({"all_reduce_hook": ((outside, 2.0),)}, "not the first module"),
                             ({"microbatches": no_all_reduce}, "set_requires_all_reduce"),
                             ({"custom_comms": (outside,)}, "custom_comms names")):
        with pytest.raises(SpecError, match=message):
            validate(dataclasses.replace(spec, microbatch=dataclasses.replace(spec.microbatch, **changes)))


def test_microbatch_specs_draw_modules_unused_on_rank0_only_where_every_ranks_hooks_run_alike():
    """unused_on_rank0: drawn (inside groups below the root too), always
    with set_reduce_scatter_unused_params, only modules that neither are nor
    hold a module given to fully_shard, and only where rank 0's hooks run
    as the others' (the oracle's unused_differs); validation refuses them
    without the setting, on a group's module or the root, or with an abort."""
    import dataclasses

    from conformance.areas.microbatch.oracle import unused_differs
    from conformance.case.spec import MicrobatchAbort, SpecError, validate
    from conformance.strategies.microbatch import microbatch_specs

    seen: Counter = Counter()

    @_settings(300, derandomize=True, phases=[Phase.generate])
    @given(microbatch_specs())
    def collect(spec):
        mb = spec.microbatch
        unused = [p for s in mb.microbatches for p in s.unused_on_rank0]
        if not unused:
            return
        assert mb.reduce_scatter_unused_params and mb.abort is None and unused_differs(spec) is None
        groups = [m for g in spec.plan.groups for m in g.modules]
        assert not any(m == p or m.startswith(p + ".") for p in unused for m in groups)
        seen["unused"] += 1
        seen["in a group below the root"] += any(p.startswith(m + ".") for p in unused for m in groups)

    collect()
    assert seen["unused"] >= 10 and seen["in a group below the root"], seen
    def grouped_below_root(s):
        return [m for g in s.plan.groups for m in g.modules if m]

    spec = find(microbatch_specs(), lambda s: any(st.unused_on_rank0 for st in s.microbatch.microbatches) and grouped_below_root(s),
                settings=_first(500), random=random.Random(0))
    mb = spec.microbatch
    k = next(i for i, st in enumerate(mb.microbatches) if st.unused_on_rank0)

    def unused(path):
        return dataclasses.replace(mb, microbatches=tuple(dataclasses.replace(st, unused_on_rank0=(path,)) if i == k else st
                                                         for i, st in enumerate(mb.microbatches)))

    for bad, message in ((dataclasses.replace(mb, reduce_scatter_unused_params=False), "need reduce_scatter_unused_params"),
                         (unused(grouped_below_root(spec)[0]), "is or holds a module given to fully_shard"),
                         (unused(""), "not a module of the tree below the root"),
                         (dataclasses.replace(mb, abort=MicrobatchAbort(0, "", "forward")), "with an aborted iteration")):
        with pytest.raises(SpecError, match=message):
            validate(dataclasses.replace(spec, microbatch=bad))


def test_microbatch_specs_on_hsdp_meshes():
    """meshes: every case on one of them, each drawn, the last microbatch
    all-reducing, some earlier ones not (set_requires_all_reduce's
    accumulation), no int reshard_after_forward the shard dim does not
    divide; validation refuses an unknown mesh and a last microbatch
    without the all-reduce; a bad meshes argument is an InvalidArgument."""
    import dataclasses

    from hypothesis.errors import InvalidArgument

    from conformance.case.spec import HSDP_MESHES, MicrobatchStep, SpecError, validate
    from conformance.strategies.microbatch import microbatch_specs

    seen: Counter = Counter()

    @_settings(200, derandomize=True, phases=[Phase.generate])
    @given(microbatch_specs(meshes=HSDP_MESHES))
    def collect(spec):
        mb = spec.microbatch
        assert mb.mesh in HSDP_MESHES and mb.microbatches[-1].all_reduce
        seen[mb.mesh] += 1
        seen["accumulates without all-reduce"] += any(s.sync and not s.all_reduce for s in mb.microbatches)
        for g in spec.plan.groups:
            r = g.reshard_after_forward
            assert not (isinstance(r, int) and not isinstance(r, bool) and mb.mesh[1] % r)

    collect()
    assert all(seen[m] for m in HSDP_MESHES) and seen["accumulates without all-reduce"], seen
    spec = find(microbatch_specs(meshes=((2, 2),)), lambda s: True, settings=_first(50), random=random.Random(0))
    last = dataclasses.replace(spec.microbatch.microbatches[-1], all_reduce=False)
    for bad, message in ((dataclasses.replace(spec.microbatch, mesh=(3, 1)), "is not one of"),
                         (dataclasses.replace(spec.microbatch, microbatches=spec.microbatch.microbatches[:-1] + (last,)), "last microbatch all-reduces")):
        with pytest.raises(SpecError, match=message):
            validate(dataclasses.replace(spec, microbatch=bad))
    with pytest.raises(InvalidArgument):
        microbatch_specs(meshes=((3, 3),)).example()
    assert MicrobatchStep().all_reduce
