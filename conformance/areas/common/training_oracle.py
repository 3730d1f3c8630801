"""What FSDP promises of training a case (every training area reads it):
whether training is promised at all, and which parameters train."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from conformance.areas.common.fsdp1_oracle import FSDP1Prediction, predict_fsdp1
from conformance.areas.common.fsdp2_oracle import ITERATED_CONTAINERS, FSDP2Prediction, predict_fsdp2
from conformance.case.target import graph_of


@dataclass(frozen=True)
class TrainingPrediction:
    api: str
    applicable: str  # "" or why training is outside what the API promises for this case
    frozen: tuple[str, ...]
    trainable: tuple[str, ...]
    fsdp1: FSDP1Prediction | None
    fsdp2: FSDP2Prediction | None
    # the rule the case breaks (with applicable): a slug for the tag outside:<rule>
    rule: str = ""

    @property
    def consequence_recorded(self) -> bool:
        """A case FSDP must reject but (as a finding records) may accept: what
        training then does is the finding's consequence, observed and
        recorded, not skipped (issue: consequences are findings)."""
        return self.rule in CONSEQUENCE_RULES


# the rules whose breach FSDP is to reject at wrap time; where it does not,
# training runs on and its outcome (a crash, wrong values) is recorded. The
# FSDP2 split tie (accepted before 2.12) is not among them yet: no release
# here that accepts it was run to see what its training does.
CONSEQUENCE_RULES = ("tie-below-lca",)


@functools.lru_cache(maxsize=256)
def predict_training(spec) -> TrainingPrediction:
    """For a CaseSpec or a ModelCase (whose loss is the target's)."""
    g = graph_of(spec)
    frozen = tuple(f for f, pid in g.named_parameters() if not g.requires_grad(pid))
    trainable = tuple(f for f, pid in g.named_parameters() if g.requires_grad(pid))
    if spec.plan.api == "fsdp1":
        p1 = predict_fsdp1(spec)
        why = "FSDP1 rejects mixed requires_grad with use_orig_params=False" if p1.error is not None else ""
        rule = "frozen-mixed" if why else ""
        if not why and any(t.below_lca for t in p1.ties):
            # TIES: FSDP1 must reject a tie managed below its users' common
            # ancestor; training is not promised for a case it must reject
            why = "a tied parameter's unit is below its users' common ancestor (rejected, TIES)"
            rule = "tie-below-lca"
        for u in p1.units:
            nid = g.resolve_module(u.path)
            cls = g.nodes[nid].cls
            if g.is_torch(nid, ITERATED_CONTAINERS, exact=True) and not why:
                # FSDP1 warns that it will not all-gather for a container the
                # case iterates rather than calls
                why = f"unit {u.path} is torch's {cls}, whose forward never runs"
                rule = "container-unit"
            elif nid in g.not_called and not why:
                # a real model reads the unit's parameters without calling it
                # (MultiheadAttention's out_proj): nothing all-gathers them
                why = f"unit {u.path}'s forward never runs in the model's forward"
                rule = "unit-not-called"
        return TrainingPrediction("fsdp1", why, frozen, trainable, p1, None, rule)
    p2 = predict_fsdp2(spec, torch.__version__)
    why = p2.supported
    rule = "unsupported" if why else ""
    if p2.split_ties and p2.tie_check and not why:
        why, rule = "a parameter two groups see is rejected (FSDP2-TIES)", "split-tie"
    return TrainingPrediction("fsdp2", why, frozen, trainable, None, p2, rule)
