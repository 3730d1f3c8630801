"""FWD-SUMMON: the FSDP1 workaround for user forward methods,
summon_full_params(recurse=False) around the root's method (spec source 004)."""

from __future__ import annotations

from conformance.areas.common.catalog import S004, VALUES_UNCHECKED, Catalog, NotChecked
from conformance.areas.common.violations import violation
from conformance.areas.summon.observation import SummonObservation
from conformance.areas.summon.oracle import SummonPrediction
from conformance.case.spec import CaseSpec
from conformance.case.violation import Violation

catalog = Catalog()


@catalog.invariant(
    "FWD-SUMMON",
    group="forward_methods",
    api="fsdp1",
    scenario="fsdp1-methods",
    statement="FSDP1's workaround: a root method run inside summon_full_params(recurse=False), reading parameters the root unit manages, gives the unsharded reference's output on every rank.",
    source=f"{S004} (composer: summon_full_params(self.model, writeback=False, recurse=False) around generate())",
)
def check_summon(spec: CaseSpec, pred: SummonPrediction, obs: SummonObservation) -> list[Violation] | NotChecked:
    if pred.fsdp1.error is not None:
        return NotChecked("FSDP1 must reject the case (FROZEN-ERROR)")
    tags = {"api:fsdp1", f"uop:{str(spec.plan.use_orig_params).lower()}"}
    if pred.fsdp1.ties:
        tags.add("tie")
    if obs.wrap_error:
        return [violation("FWD-SUMMON", f"FSDP raised {obs.wrap_error}", tags, "kind:raised")]
    got = {c.index: c for c in obs.calls}
    calls = [(c, got[c.index]) for c in pred.calls if c.in_promise and c.index in got]
    if not calls:
        reasons = sorted({c.why for c in pred.calls if not c.in_promise})
        return NotChecked("no call within the workaround's promise" + (f" ({'; '.join(reasons)})" if reasons else ""))
    out = []
    for c, o in calls:
        if o.error:
            out.append(violation("FWD-SUMMON", f"call {c.index} raised {o.error}", tags, "kind:raised"))
        elif obs.values_meaningful and o.close is False:
            out.append(violation("FWD-SUMMON", f"call {c.index} output differs from the reference's by {o.max_diff:.3g}", tags, "kind:output"))
    if not out and not obs.values_meaningful:
        return VALUES_UNCHECKED
    return out


INVARIANTS = tuple(catalog.invariants)
