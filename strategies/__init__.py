"""Hypothesis strategies that draw CaseSpecs: trees, freeze masks, ties, policies."""

from conformance.strategies.cases import case_specs
from conformance.strategies.freeze import FREEZE_KINDS, apply_freeze_mask, freeze_masks
from conformance.strategies.policies import POLICY_KINDS, policies, subtree_numels, wrap_plans
from conformance.strategies.ties import SHARED_KINDS, TIE_KINDS, shared_modules, ties
from conformance.strategies.trees import module_trees

__all__ = [
    "FREEZE_KINDS",
    "POLICY_KINDS",
    "SHARED_KINDS",
    "TIE_KINDS",
    "apply_freeze_mask",
    "case_specs",
    "freeze_masks",
    "module_trees",
    "policies",
    "shared_modules",
    "subtree_numels",
    "ties",
    "wrap_plans",
]
