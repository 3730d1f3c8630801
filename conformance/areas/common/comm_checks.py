"""The comparisons of what a rank saw FSDP communicate with the oracle's
prediction (conformance.areas.common.comm_oracle), shared by the comm and
microbatch invariants: collectives as multisets per iteration, phase, group
and op (count, then numel, ranks, dtype), events as sequences."""

from __future__ import annotations

from collections import Counter

from conformance.areas.common.comm_oracle import Expected
from conformance.areas.common.violations import violation
from conformance.case.violation import Violation


def collective_key(c) -> tuple:
    return (c.phase, c.op, c.group, c.via, c.pg)


def compare_collectives(inv: str, exp: Expected, obs, tags: set[str]) -> list[Violation]:
    """Each iteration's collectives against the oracle's, per (phase, op,
    group): the count, then numel, ranks and dtype (the iteration that
    raised, if any: only its extra collectives; the rest is left to kind:raised)."""
    out: list[Violation] = []
    for i, (want, got) in enumerate(zip(exp.iterations, obs.iterations)):
        # the iteration that raised stops early (kind:raised says so): only
        # what it issued beyond the promise counts there
        raised_here = bool(obs.error) and i == len(obs.iterations) - 1
        w = Counter(collective_key(c) for c in want.collectives)
        g = Counter(collective_key(c) for c in got.collectives)
        for key in sorted(set(w) | set(g)):
            phase, op, group, via, pg = key
            where = f"iteration {i} {phase}: group {group or '<root>'}"
            op_via = (op + (f" through the custom comms of {via.removeprefix('custom ') or '<root>'}" if via else "")
                      + (f" on {pg} (a process group other than the shard group)" if pg else ""))
            if raised_here and g[key] <= w[key]:
                continue
            # the oracle's reasons for these collectives: mechanisms a finding may name
            why = tags | {f"reason:{c.reason}" for c in want.collectives if collective_key(c) == key and c.reason}
            if w[key] != g[key]:
                kind = "kind:extra" if g[key] > w[key] else "kind:missing"
                out.append(violation(inv, f"{where}: {g[key]} {op_via} where {w[key]} are promised", why, kind, f"op:{op}", f"phase:{phase}",
                                     *(("via:custom",) if via else ()), *(("pg:separate",) if pg else ())))
                continue
            ws = sorted((c.numel, c.ranks, c.dtype) for c in want.collectives if collective_key(c) == key)
            gs = sorted((c.numel, c.ranks, c.dtype) for c in got.collectives if collective_key(c) == key)
            for (wn, wr, wd), (gn, gr, gd) in zip(ws, gs):
                if wd != gd:
                    out.append(violation(inv, f"{where}: {op} in {gd}, promised {wd}", why, "kind:dtype", f"op:{op}", f"phase:{phase}"))
                if wr != gr:
                    out.append(violation(inv, f"{where}: {op} over {gr} ranks, promised {wr}", why, "kind:ranks", f"op:{op}", f"phase:{phase}"))
                numel_ok = gn == wn if exp.exact_numel else (gn >= wn and gn % max(gr, 1) == 0)
                if not numel_ok:
                    out.append(violation(inv, f"{where}: {op} of {gn} elements, promised {wn}{'' if exp.exact_numel else ' (at least, a multiple of the ranks)'}",
                                         why, "kind:numel", f"op:{op}", f"phase:{phase}"))
    if len(obs.iterations) < len(exp.iterations) and not obs.error:
        out.append(violation(inv, f"{len(obs.iterations)} iterations observed of {len(exp.iterations)}", tags, "kind:missing-iteration"))
    return out


def compare_events(inv: str, exp: Expected, obs, tags: set[str]) -> list[Violation]:
    """Each iteration's event sequence against the oracle's (the iteration that
    raised, if any, stops early: kind:raised says so)."""
    out: list[Violation] = []
    for i, (want, got) in enumerate(zip(exp.iterations, obs.iterations)):
        w = [(e.kind, e.group, e.state) for e in want.events]
        g = [(e.kind, e.group, e.state) for e in got.events]
        if w == g:
            continue
        k = next((j for j, (a, b) in enumerate(zip(w, g)) if a != b), min(len(w), len(g)))
        wk, gk = (w[k] if k < len(w) else None), (g[k] if k < len(g) else None)
        kind = "kind:" + (gk[0] if gk else "missing") + (f"-{gk[2].lower()}" if gk else "")
        if obs.error and i == len(obs.iterations) - 1:
            continue  # the iteration that raised: its events stop early (kind:raised says so)
        out.append(violation(inv, f"iteration {i}: event {k} is {fmt_event(gk)}, promised {fmt_event(wk)} "
                                          f"(promised {[fmt_event(e) for e in w]}, seen {[fmt_event(e) for e in g]})", tags, kind))
    return out


def fmt_event(e) -> str:
    return "nothing" if e is None else f"{e[0]} {e[1] or '<root>'} ({e[2]})"
