"""The main strategy: whole CaseSpecs (tree, shared modules, ties, freeze mask,
wrap plan, seed)."""

from __future__ import annotations

from typing import Any, Iterable

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.strategies import SearchStrategy

from conformance.case.spec import CaseSpec
from conformance.strategies._common import TreeIndex, check_bool, check_int, check_strategy, ints, pick
from conformance.strategies.freeze import FREEZE_KINDS, apply_freeze_mask, draw_freeze_mask
from conformance.strategies.policies import OBJECT_POLICIES, PlanChoices, check_policy_kinds, draw_plan
from conformance.strategies.ties import SHARED_KINDS, TIE_KINDS, draw_shared, draw_ties
from conformance.strategies.trees import module_trees

_SEEDS = ints(2**32 - 1)
_EXTRAS = {
    (True, True): ((), ("ties",), ("shared",), ("shared", "ties")),
    (True, False): ((), ("shared",)),
    (False, True): ((), ("ties",)),
    (False, False): ((),),
}


def _size_bucket(n: int) -> str:
    return "1-4" if n < 5 else "5-9" if n < 10 else "10-19" if n < 20 else "20+"


@st.composite
def _case_specs(
    draw: Any,
    trees: SearchStrategy,
    apis: SearchStrategy[str],
    use_orig_params: SearchStrategy[bool],
    kinds: tuple,
    allow_ties: bool,
    allow_shared: bool,
    allow_ignored: bool,
    freeze: bool,
    require_ties: bool,
) -> CaseSpec:
    # Choices that do not depend on the tree first, at fixed positions (see PlanChoices).
    plan_choices = PlanChoices(draw, apis, use_orig_params, kinds, allow_ignored)
    freeze_kind = pick(draw, FREEZE_KINDS) if freeze else "trainable"
    extras = _EXTRAS[allow_shared, allow_ties]
    if allow_shared and plan_choices.api == "fsdp1" and plan_choices.policy_kind in OBJECT_POLICIES:
        # FSDP1's policy objects traverse the tree once per module
        # (_post_order_apply's visited set): shared modules more often with them
        extras = extras + (("shared",), ("shared",))
    if require_ties:
        extras = tuple(e for e in extras if "ties" in e)
    extras = pick(draw, extras)  # share modules? tie parameters?
    tree, classes = draw(trees)
    index = TreeIndex(tree, classes)
    event(f"modules: {_size_bucket(len(index.paths))}")
    shared = draw_shared(draw, index, min_size=1, max_size=2, kinds=SHARED_KINDS) if "shared" in extras else ()
    ties = draw_ties(draw, index, min_size=1, max_size=2, kinds=TIE_KINDS) if "ties" in extras else ()
    if freeze:
        event(f"freeze mask: {freeze_kind}")
        mask = draw_freeze_mask(draw, index, freeze_kind)
        # The index keeps the unfrozen tree: nothing below reads requires_grad.
        tree = apply_freeze_mask(tree, mask, ties)
    plan = draw_plan(draw, index, shared, ties, plan_choices)
    return CaseSpec(tree=tree, classes=classes, shared=shared, ties=ties, plan=plan, seed=draw(_SEEDS))


def case_specs(
    *,
    max_modules: int = 24,
    max_depth: int = 4,
    apis: SearchStrategy[str] = st.just("fsdp1"),
    use_orig_params: SearchStrategy[bool] = st.booleans(),
    policies: Iterable | None = None,
    allow_ties: bool = True,
    allow_shared: bool = True,
    allow_ignored: bool = True,
    freeze: bool = True,
    require_ties: bool = False,
    trees: SearchStrategy | None = None,
) -> SearchStrategy[CaseSpec]:
    """CaseSpecs that pass spec.validate and build.

    - tree: from ``trees`` ((tree, classes) pairs, e.g. :func:`module_trees`
      filtered for a shape a test needs), by default :func:`module_trees`
      with ``max_modules`` and ``max_depth``;
    - with ``allow_shared``, sometimes 1..2 shared modules (:func:`shared_modules`);
    - with ``allow_ties``, sometimes 1..2 tied parameters (:func:`ties`);
      with ``require_ties`` always (a tree where no tie fits is rejected);
    - with ``freeze``, a freeze mask of any kind in FREEZE_KINDS
      (:func:`freeze_masks`), else every parameter trainable;
    - plan: API from ``apis`` ("fsdp1" / "fsdp2"), use_orig_params from
      ``use_orig_params``, a policy of one of ``policies`` (policy classes and
      None; default all), and with ``allow_ignored`` sometimes ignored modules
      or parameters (:func:`wrap_plans`);
    - a seed.

    Shrinks towards a root with one Linear child, nothing shared, tied, frozen
    or ignored, no policy, seed 0.
    """
    check_int(max_modules, "max_modules", min_value=1)
    check_int(max_depth, "max_depth", min_value=0)
    check_strategy(apis, "apis")
    check_strategy(use_orig_params, "use_orig_params")
    if trees is not None:
        check_strategy(trees, "trees")
    kinds = check_policy_kinds(policies)
    for name, flag in (("allow_ties", allow_ties), ("allow_shared", allow_shared), ("allow_ignored", allow_ignored), ("freeze", freeze),
                       ("require_ties", require_ties)):
        check_bool(flag, name)
    if require_ties and not allow_ties:
        raise InvalidArgument("require_ties=True needs allow_ties=True")
    return _case_specs(
        module_trees(max_modules=max_modules, max_depth=max_depth) if trees is None else trees,
        apis, use_orig_params, kinds, allow_ties, allow_shared, allow_ignored, freeze, require_ties,
    )
