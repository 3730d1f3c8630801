"""Baseline compare: regressions, fixes, changes, and invariants new or
removed between two reports (rows matched by invariant, API, tier and, for
a real model's rows, the model)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import InvalidVersion, Version

from conformance.report.data import row_label
from conformance.report.markdown import fsdp_source_label

BAD = ("FAIL",)
GOOD = ("PASS", "FIXED")


@dataclass
class Change:
    invariant: str
    api: str
    tier: str
    base: str  # verdict, or "-" when absent
    new: str
    detail: str = ""

    @property
    def key(self) -> str:
        return f"{self.invariant} ({self.api}, {self.tier})"


@dataclass
class Comparison:
    base: dict
    new: dict
    regressions: list[Change] = field(default_factory=list)
    fixes: list[Change] = field(default_factory=list)
    changes: list[Change] = field(default_factory=list)  # other verdict or finding changes
    added: list[Change] = field(default_factory=list)
    removed: list[Change] = field(default_factory=list)
    unchanged: int = 0
    same: list[Change] = field(default_factory=list)  # the unchanged rows
    notes: list[str] = field(default_factory=list)

    @property
    def exit_status(self) -> int:
        return 1 if self.regressions else 0

    def to_dict(self) -> dict:
        def rows(cs):
            return [c.__dict__ for c in cs]

        return {
            "base": _describe(self.base),
            "new": _describe(self.new),
            "regressions": rows(self.regressions),
            "fixes": rows(self.fixes),
            "changes": rows(self.changes),
            "added": rows(self.added),
            "removed": rows(self.removed),
            "unchanged": self.unchanged,
            "notes": self.notes,
            "exit_status": self.exit_status,
        }


def _describe(r: dict) -> str:
    t = r.get("torch", {})
    run = r.get("run", {})
    tiers = ",".join(f"{x.get('tier')}:W{x.get('world_size')}" for x in run.get("tiers", []))
    src = ""
    if r.get("fsdp_source"):
        src = f", FSDP from {fsdp_source_label(r['fsdp_source'])}"
    return f"torch {t.get('version')} ({(t.get('git_version') or '?')[:12]}){src}, {tiers or '?'}, profile {run.get('profile')}"


def _finding_names(report: dict, row: dict) -> set[str]:
    by_id = {f["id"]: f for f in report.get("findings", [])}
    out = set()
    for fid in row.get("findings", []):
        f = by_id.get(fid, {})
        out.add(f"KNOWN {f['known_failure']}" if f.get("known_failure") else fid.rsplit("/", 1)[-1])
    return out


def compare(base: dict, new: dict) -> Comparison:
    c = Comparison(base, new)
    brows = {(row_label(r), r["api"], r["tier"]): r for r in base.get("results", [])}
    nrows = {(row_label(r), r["api"], r["tier"]): r for r in new.get("results", [])}
    btiers = {k[2] for k in brows}
    if not new.get("complete", True):
        c.notes.append(f"NEW is incomplete ({new.get('status')}): missing rows may only not have run yet")
    if base.get("run", {}).get("profile") != new.get("run", {}).get("profile"):
        c.notes.append(f"profiles differ: BASE {base.get('run', {}).get('profile')}, NEW {new.get('run', {}).get('profile')}")
    for key in sorted(brows.keys() | nrows.keys()):
        b, n = brows.get(key), nrows.get(key)
        inv, api, tier = key
        if b is None:
            c.added.append(Change(inv, api, tier, "-", n["verdict"], f"{n['examples']} examples" + ("" if tier in btiers else f"; BASE has no {tier} tier")))
            continue
        if n is None:
            c.removed.append(Change(inv, api, tier, b["verdict"], "-"))
            continue
        bv, nv = b["verdict"], n["verdict"]
        bf, nf = _finding_names(base, b), _finding_names(new, n)
        detail = []
        if nf - bf:
            detail.append("new: " + ", ".join(sorted(nf - bf)))
        if bf - nf:
            detail.append("gone: " + ", ".join(sorted(bf - nf)))
        if n["examples"] < b["examples"]:
            detail.append(f"{n['examples']} examples (BASE {b['examples']})")
        ch = Change(inv, api, tier, bv, nv, "; ".join(detail))
        if nv in BAD and (bv not in BAD or any(not x.startswith("KNOWN") for x in nf - bf)):
            c.regressions.append(ch)
        elif nv in GOOD and bv in ("FAIL", "KNOWN"):
            c.fixes.append(ch)
        elif bv != nv or nf != bf:
            c.changes.append(ch)
        else:
            c.unchanged += 1
            c.same.append(Change(inv, api, tier, bv, nv, f"examples {b['examples']} -> {n['examples']}; findings: {', '.join(sorted(nf)) or 'none'}"))
    return c


def _section(title: str, rows: list[Change], md: bool) -> list[str]:
    if not rows:
        return []
    if md:
        out = [f"### {title} ({len(rows)})", "", "| invariant | API | tier | BASE | NEW | detail |", "| --- | --- | --- | --- | --- | --- |"]
        out += [f"| {c.invariant} | {c.api} | {c.tier} | {c.base} | {c.new} | {c.detail.replace('|', '/')} |" for c in rows]
        return out + [""]
    out = [f"{title} ({len(rows)}):"]
    out += [f"  {c.key:<36} {c.base:>6} -> {c.new:<6} {c.detail}" for c in rows]
    return out


def render(c: Comparison, fmt: str = "text") -> str:
    md = fmt == "md"
    verdict = "REGRESSED" if c.regressions else "no regressions"
    head = [f"## fsdp-conformance compare: {verdict}" if md else f"fsdp-conformance compare: {verdict}", ""]
    head += [f"- BASE: {_describe(c.base)}", f"- NEW: {_describe(c.new)}"] if md else [f"BASE: {_describe(c.base)}", f"NEW:  {_describe(c.new)}"]
    head += [f"- note: {n}" if md else f"note: {n}" for n in c.notes]
    head.append("")
    body = []
    body += _section("Regressions", c.regressions, md)
    body += _section("Fixes", c.fixes, md)
    body += _section("Other changes", c.changes, md)
    body += _section("New invariants (not in BASE)", c.added, md)
    body += _section("Removed invariants (not in NEW)", c.removed, md)
    if md and c.same:
        body += ["<details><summary>Unchanged (%d)</summary>" % len(c.same), ""] + _section("Unchanged", c.same, md) + ["</details>", ""]
    tail = [
        f"{len(c.regressions)} regressions, {len(c.fixes)} fixes, {len(c.changes)} other changes, "
        f"{len(c.added)} new, {len(c.removed)} removed, {c.unchanged} unchanged"
    ]
    return "\n".join(head + body + tail) + "\n"


def merged(bases: list[dict]) -> dict:
    """Several baselines (one per tier, say) as one: rows, findings and tiers
    side by side; the first one's environment."""
    if len(bases) == 1:
        return bases[0]
    out = dict(bases[0])
    out["results"] = [r for b in bases for r in b.get("results", [])]
    out["findings"] = [f for b in bases for f in b.get("findings", [])]
    out["run"] = {**bases[0].get("run", {}), "tiers": [t for b in bases for t in b.get("run", {}).get("tiers", [])]}
    return out


def default_baselines(report: dict, directory) -> list:
    """For each tier of ``report``: the committed baseline with its backend and
    world size and the newest torch release at or below the report's
    (reports/baselines/torch-<release>-<backend>-w<W>.json)."""


    def release(v: str):
        try:
            return Version(Version(v.split("+")[0]).base_version)
        except InvalidVersion:
            return None

    mine = release(report.get("torch", {}).get("version") or "")
    out = []
    for t in report.get("run", {}).get("tiers", []):
        best = None
        for p in Path(directory).glob(f"torch-*-{t.get('backend')}-w{t.get('world_size')}.json"):
            m = re.fullmatch(r"torch-(.+)-[a-z]+-w\d+\.json", p.name)
            v = release(m.group(1)) if m else None
            if v is not None and (mine is None or v <= mine) and (best is None or v > best[0]):
                best = (v, p)
        if best is not None:
            out.append(best[1])
    return out
