"""The oracle for the FSDP1 forward-method workaround (spec source 004:
summon_full_params(recurse=False) around the root's method) and for training
parity under either API."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from conformance.areas.common.fsdp1_oracle import FSDP1Prediction, predict_fsdp1
from conformance.areas.common.fsdp2_oracle import _resolve_from
from conformance.case.spec import CaseSpec, effective_calls
from conformance.case.target import graph_of


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


