"""The oracle for the FSDP1 forward-method workaround (spec source 004:
summon_full_params(recurse=False) around the root's method) and for training
parity under either API."""

from __future__ import annotations

import functools

from dataclasses import dataclass

import torch

from conformance.oracle.fsdp1 import FSDP1Prediction, predict_fsdp1
from conformance.oracle.fsdp2 import TORCH_CONTAINERS, FSDP2Prediction, _resolve_from, predict_fsdp2
from conformance.case.target import graph_of
from conformance.case.spec import CaseSpec, effective_calls


@dataclass(frozen=True)
class SummonCall:
    index: int
    method: int
    in_promise: bool  # its output must equal the unsharded reference's
    why: str  # when not: the reason


@dataclass(frozen=True)
class SummonPrediction:
    fsdp1: FSDP1Prediction
    calls: tuple[SummonCall, ...]


@functools.lru_cache(maxsize=256)
def predict_summon(spec: CaseSpec) -> SummonPrediction:
    """Spec source 004 (composer's note): the workaround works for a method of
    the root whose directly read parameters (the tied LM head) the root unit
    manages. summon_full_params' docstring: no forward may start inside the
    context, so the method must not run a nested unit's forward."""
    fsdp1 = predict_fsdp1(spec)
    g = graph_of(spec)
    root = set(fsdp1.unit("").managed) if fsdp1.error is None else set()
    units = {g.resolve_module(u.path) for u in fsdp1.units if u.path} if fsdp1.error is None else set()

    def runs_unit(nid: str) -> bool:
        return any(n in units for n in g.subtree(nid))
    out = []
    index = 0
    for call in effective_calls(spec):
        for _ in range(call.times):
            why = ""
            if fsdp1.error is not None:
                why = "FSDP1 rejects the case"
            elif call.method == -1:
                why = "a plain forward: not the workaround"
            elif call.method >= 0:
                m = spec.methods[call.method]
                if m.module != "":
                    why = "recurse=False summons the root unit only; the method is not the root's"
                for st in m.steps:
                    if why:
                        break
                    if st.op in ("forward", "call") and runs_unit(""):
                        why = "the method runs a nested FSDP unit's forward inside summon_full_params"
                    if st.op == "child" and runs_unit(_resolve_from(g, "", st.target + ".x")[0]):
                        why = "the method runs a nested FSDP unit's forward inside summon_full_params"
                    if st.op == "param":
                        nid, name = _resolve_from(g, m.module, st.target)
                        fqn = g.param_fqn[dict(g.nodes[nid].params)[name]]
                        if fqn not in root:
                            why = f"the method reads {fqn}, which the root unit does not manage"
            out.append(SummonCall(index, call.method, not why, why))
            index += 1
    return SummonPrediction(fsdp1, tuple(out))


@dataclass(frozen=True)
class ParityPrediction:
    api: str
    applicable: str  # "" or why training is outside what the API promises for this case
    frozen: tuple[str, ...]
    trainable: tuple[str, ...]
    fsdp1: FSDP1Prediction | None
    fsdp2: FSDP2Prediction | None


@functools.lru_cache(maxsize=256)
def predict_parity(spec) -> ParityPrediction:
    """For a CaseSpec or a ModelCase (whose loss is the target's)."""
    g = graph_of(spec)
    frozen = tuple(f for f, pid in g.named_parameters() if not g.requires_grad(pid))
    trainable = tuple(f for f, pid in g.named_parameters() if g.requires_grad(pid))
    if spec.plan.api == "fsdp1":
        p1 = predict_fsdp1(spec)
        why = "FSDP1 rejects mixed requires_grad with use_orig_params=False" if p1.error is not None else ""
        if not why and any(t.below_lca for t in p1.ties):
            # TIES: FSDP1 must reject a tie managed below its users' common
            # ancestor; training is not promised for a case it must reject
            why = "a tied parameter's unit is below its users' common ancestor (rejected, TIES)"
        for u in p1.units:
            nid = g.resolve_module(u.path)
            cls = g.nodes[nid].cls
            if g.is_torch(nid, TORCH_CONTAINERS, exact=True) and not why:
                # FSDP1 warns that it will not all-gather for a container the
                # case iterates rather than calls
                why = f"unit {u.path} is torch's {cls}, whose forward never runs"
            elif nid in g.not_called and not why:
                # a real model reads the unit's parameters without calling it
                # (MultiheadAttention's out_proj): nothing all-gathers them
                why = f"unit {u.path}'s forward never runs in the model's forward"
        return ParityPrediction("fsdp1", why, frozen, trainable, p1, None)
    p2 = predict_fsdp2(spec, torch.__version__)
    why = p2.supported
    if p2.split_ties and p2.tie_check:
        why = why or "a parameter two groups see is rejected (FSDP2-TIES)"
    return ParityPrediction("fsdp2", why, frozen, trainable, None, p2)
