"""The release matrix page (reports/matrix/README.md and index.html): the
conformance baselines of several torch releases side by side, invariants by
release, and for every finding the first and last release it was seen in.

Built only from the files in the matrix directory (the per-release baselines
ci/matrix.py writes, and its ``*.notrun.json`` records) and the current
known_failures.toml, so it can be regenerated at any time:
``python -m conformance.report.matrix [reports/matrix]``.

The matrix runs with every known failure matching at every release
(known.ANY_RELEASE_ENV), so a baseline names each finding it shows; the page
then applies the real torch ranges: a finding seen at a release outside its
entry's range counts as FAIL there."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import InvalidVersion, Version

from conformance.case.violation import Violation
from conformance.report.data import VERDICTS
from conformance.report.html import _ENV
from conformance.report.markdown import MARK, table_cell
from conformance.run import known as known_mod
from conformance.run.repros import REPROS_SCHEMA

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "reports" / "matrix"
NOTRUN_SUFFIX = ".notrun.json"
FAILING = ("FAIL", "HANG", "CRASH", "ERROR")


def release_of(version: str) -> str:
    """'2.13.0+cpu' -> '2.13.0'."""
    return version.split("+")[0]


def _order(release: str):
    try:
        return (0, Version(release))
    except InvalidVersion:
        return (1, release)


def tier_key(report: dict) -> str:
    t = report["run"]["tiers"][0]
    return f"{t['backend']}-w{t['world_size']}"


@dataclass
class Seen:
    """One finding across the matrix."""

    id: str
    known: known_mod.KnownFailure | None
    invariants: set[str] = field(default_factory=set)
    releases: set[str] = field(default_factory=set)
    tiers: set[str] = field(default_factory=set)
    message: str = ""

    @property
    def range(self) -> str:
        return str(self.known.torch) if self.known else ""


@dataclass
class Matrix:
    releases: list[str]  # every release with a baseline or a not-run record, oldest first
    tiers: list[str]
    reports: dict[tuple[str, str], dict]  # (release, tier) -> report
    notrun: dict[str, dict[str, str]]  # release -> {what: one-line reason}
    known: list[known_mod.KnownFailure]
    repros: dict[str, dict] = field(default_factory=dict)  # release -> {finding id: {"verdict", "runs"}} (ci/matrix.py's repros tier)

    def run(self, release: str) -> bool:
        return any(r == release for r, _ in self.reports)


class MatrixError(ValueError):
    pass


def load(directory: Path, known: list[known_mod.KnownFailure] | None = None) -> Matrix:
    directory = Path(directory)
    if not directory.is_dir():
        raise MatrixError(f"{directory}: no such directory")
    reports, notrun, repro_runs = {}, {}, {}
    for p in sorted(directory.glob("*.json")):
        try:
            data = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise MatrixError(f"{p}: unreadable ({e})") from None
        if p.name.endswith(NOTRUN_SUFFIX):
            notrun.setdefault(data["release"], {})[data.get("what", "release")] = data["reason"]
        elif data.get("schema") == "fsdp-conformance-report":
            reports[(release_of(data["torch"]["version"]), tier_key(data))] = data
        elif data.get("schema") == REPROS_SCHEMA:
            repro_runs[data["release"]] = data["findings"]
    releases = sorted({r for r, _ in reports} | set(notrun) | set(repro_runs), key=_order)
    tiers = sorted({t for _, t in reports})
    return Matrix(releases, tiers, reports, notrun, known_mod.load() if known is None else known, repro_runs)


# a release's repro verdict -> its mark on the page
REPRO_MARK = {"DEVIATION": "D", "AS SPECIFIED": "s", "no verdict": "?"}


def measured_ranges(m: Matrix) -> list[dict]:
    """Per finding, what its repro showed on each release where it ran, and
    how far that measures known_failures.toml's range: ``first`` / ``last``
    the oldest and newest release that showed the deviation; a bound is
    measured when the release beside it ran and did not show it (or there
    is no release beside it: the oldest or newest release of the matrix); ``disagrees``: the releases whose verdict the
    range contradicts (DEVIATION outside it, AS SPECIFIED inside it)."""
    ladder = m.releases  # oldest first
    out = []
    for k in m.known:
        cells = {r: m.repros[r][k.id]["verdict"] for r in ladder if r in m.repros and k.id in m.repros[r]}
        shown = [r for r in ladder if cells.get(r) == "DEVIATION"]
        row = {"id": k.id, "known": k, "range": str(k.torch), "cells": cells, "first": shown[0] if shown else None,
               "last": shown[-1] if shown else None, "lower_measured": False, "upper_measured": False,
               "disagrees": [r for r, v in cells.items() if v != "no verdict" and (v == "DEVIATION") != known_mod.in_range(r, k.torch)]}
        if shown:
            lo, hi = ladder.index(shown[0]), ladder.index(shown[-1])
            row["lower_measured"] = lo == 0 or cells.get(ladder[lo - 1]) == "AS SPECIFIED"
            row["upper_measured"] = hi == len(ladder) - 1 or cells.get(ladder[hi + 1]) == "AS SPECIFIED"
        out.append(row)
    return out


def identify(finding: dict, known: list[known_mod.KnownFailure], release: str | None = None) -> known_mod.KnownFailure | None:
    """The known failure a finding is, whatever its torch range says; a
    baseline's unmatched finding by its violations' tags against the current
    file, a finding whose range holds ``release`` first (as known.match)."""
    by_id = {k.id: k for k in known}
    if finding.get("known_failure") in by_id:
        return by_id[finding["known_failure"]]
    vs = finding.get("violations") or []
    stored = [Violation(v["invariant"], v.get("message", ""), frozenset(v.get("tags", ()))) for v in vs]
    fits = [k for k in known if stored and all(k.matches_tags(v) for v in stored)]
    here = [k for k in fits if release is not None and known_mod.in_range(release, k.torch)]
    return (here or fits or [None])[0]


def _short(reason: str | None) -> str | None:
    # a skip inside a test with explicit examples: Hypothesis appends the example
    return reason.split("Failing explicit example")[0].strip() if reason else reason


def _verdict_in_range(k: known_mod.KnownFailure | None, release: str) -> str:
    return "KNOWN" if k is not None and known_mod.in_range(release, k.torch) else "FAIL"


def analyse(m: Matrix) -> dict:
    """Rows of invariants by release, the per-release verdict counts and the
    findings with their first and last release."""
    seen: dict[str, Seen] = {}
    rows: dict[tuple[str, str], dict] = {}  # (invariant, api) -> {"statement", "cells": {release: {tier: cell}}}
    counts: dict[tuple[str, str], dict[str, int]] = {}
    for (release, tier), rep in m.reports.items():
        findings = {f["id"]: f for f in rep.get("findings", [])}
        tally = dict.fromkeys(VERDICTS, 0)
        for r in rep["results"]:
            ids = []
            verdicts = set()
            for fid in r.get("findings", []):
                f = findings.get(fid)
                if f is None:
                    continue
                k = identify(f, m.known, release)
                name = k.id if k else f"{f['invariant']}/{f['api']} {f['kind']}: {f['message'][:120]}"
                s = seen.setdefault(name, Seen(name, k, message=f["message"]))
                s.invariants.add(f["invariant"])
                s.releases.add(release)
                s.tiers.add(tier)
                ids.append(name)
                verdicts.add(_verdict_in_range(k, release) if f["kind"] in FAILING + ("KNOWN",) else f["kind"])
            verdict = "FAIL" if "FAIL" in verdicts else "KNOWN" if verdicts else r["verdict"]
            if verdict == "KNOWN" and r["verdict"] == "FAIL" and not ids:
                verdict = "FAIL"  # a failing row without a finding (a failed test): keep it red
            tally[verdict] = tally.get(verdict, 0) + 1
            row = rows.setdefault((r["invariant"], r["api"]), {"statement": r.get("statement", ""), "area": r.get("area") or "other", "cells": {}})
            row["cells"].setdefault(release, {})[tier] = {
                "verdict": verdict, "reason": _short(r.get("reason")), "examples": r.get("examples"), "findings": ids,
            }
        counts[(release, tier)] = tally
    findings = []
    for s in sorted(seen.values(), key=lambda s: (s.known is not None, s.id)):
        ordered = sorted(s.releases, key=_order)
        run = [r for r in m.releases if m.run(r)]
        lo, hi = run.index(ordered[0]), run.index(ordered[-1])
        gaps = [r for r in run[lo : hi + 1] if r not in s.releases]
        covered = s.known is not None and all(known_mod.in_range(r, s.known.torch) for r in ordered)
        findings.append({
            "id": s.id, "known": s.known, "invariants": sorted(s.invariants), "tiers": sorted(s.tiers),
            "first": ordered[0], "last": ordered[-1], "releases": ordered, "gaps": gaps,
            "range": s.range, "covered": covered, "message": s.message,
        })
    unseen = [k for k in m.known if k.id not in seen]
    areas: dict[str, list] = {}
    for (inv, api), row in rows.items():
        areas.setdefault(row["area"], []).append({"id": inv, "api": api, **row})
    return {"rows": rows, "areas": list(areas.items()), "counts": counts, "findings": findings, "unseen": unseen,
            "measured": measured_ranges(m)}


def run_label(rep: dict) -> str:
    """Which suite and profile made a baseline: `ci` profile, suite revision."""
    run, suite = rep.get("run", {}), rep.get("suite", {})
    label = f"`{run.get('profile') or '?'}`"
    if any(str(a).startswith("--max-examples") for a in run.get("args", ())):
        label += f" max {run.get('max_examples')} examples"  # fewer than the profile's own
    rev = (suite.get("git_revision") or "")[:10]
    return label + (f" suite `{rev}`" if rev else "")


def _combined(cells: dict[str, dict]) -> str:
    """One verdict for a release over its tiers, the worst."""
    order = ("FAIL", "KNOWN", "FIXED", "PASS", "SKIP")
    vs = {c["verdict"] for c in cells.values()}
    return next((v for v in order if v in vs), "SKIP")


def render_markdown(m: Matrix, a: dict) -> str:
    lines = [
        "# fsdp-conformance release matrix",
        "",
        "The `ci` profile per torch release, fake tier (W=4) and gloo pool (W=2), written by `ci/matrix.py`;"
        " regenerate this page with `python -m conformance.report.matrix reports/matrix`."
        " Verdicts apply the torch ranges of `conformance/known_failures.toml`: a finding seen outside its range is FAIL."
        " Its tags matched there, not necessarily its mechanism: run its repro on that release before widening the range"
        " (the repros tier, or torchrun on the repro script).",
        "",
        "## Verdicts by release",
        "",
        "| release | tier | PASS | KNOWN | FAIL | SKIP | examples | time | run |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for rel in m.releases:
        for tier in m.tiers:
            rep = m.reports.get((rel, tier))
            if rep is None:
                continue
            c = a["counts"][(rel, tier)]
            s = rep["summary"]
            secs = s.get("wall_seconds") or s.get("seconds") or 0
            lines.append(f"| {rel} | {tier} | {c['PASS']} | {c['KNOWN']} | {c['FAIL']} | {c['SKIP']} | {s.get('examples', 0)} | {secs:.0f}s | {run_label(rep)} |")
        for what, reason in sorted(m.notrun.get(rel, {}).items()):
            lines.append(f"| {rel} | {what} | not run: {table_cell(reason)} | | | | | | |")
    lines += ["", "## Invariants by release", "", "| invariant | API | " + " | ".join(m.releases) + " |",
              "| --- | --- | " + " | ".join("---" for _ in m.releases) + " |"]
    for _, invs in a["areas"]:
        for inv in invs:
            cells = []
            for rel in m.releases:
                c = inv["cells"].get(rel)
                if not c:
                    cells.append("-")
                elif len({x["verdict"] for x in c.values()}) == 1:
                    cells.append(MARK[next(iter(c.values()))["verdict"]])
                else:
                    cells.append(" ".join(f"{t.split('-')[0]} {MARK[x['verdict']]}" for t, x in sorted(c.items())))
            lines.append(f"| {inv['id']} | {inv['api']} | " + " | ".join(cells) + " |")
    lines += ["", "## Findings: first and last release seen", "",
              "| finding | invariants | first | last | not seen in between | known_failures.toml range |",
              "| --- | --- | --- | --- | --- | --- |"]
    for f in a["findings"]:
        rng = f"`{f['range']}`" + ("" if f["covered"] else " (**does not cover every release seen**)") if f["known"] else "**not in known_failures.toml**"
        lines.append(f"| {table_cell(f['id'])} | {', '.join(f['invariants'])} | {f['first']} | {f['last']} | {', '.join(f['gaps']) or '-'} | {rng} |")
    if a["unseen"]:
        lines += ["", "Known failures seen in no release run: " + ", ".join(f"`{k.id}` (`{k.torch}`)" for k in a["unseen"])]
    lines += _repro_section(m, a)
    skips = {}
    for _, invs in a["areas"]:
        for inv in invs:
            for rel, c in inv["cells"].items():
                for x in c.values():
                    if x["verdict"] == "SKIP":
                        skips.setdefault((inv["id"], inv["api"], x["reason"] or "-"), []).append(rel)
    if skips:
        lines += ["", "## Skips", "", "| invariant | API | releases | reason |", "| --- | --- | --- | --- |"]
        for (inv, api, reason), rels in sorted(skips.items()):
            lines.append(f"| {inv} | {api} | {', '.join(sorted(set(rels), key=_order))} | {table_cell(reason)} |")
    return "\n".join(lines) + "\n"


def _repro_section(m: Matrix, a: dict) -> list[str]:
    rel = [r for r in m.releases if r in m.repros]
    roots = {k.root_cause.id if k.root_cause else k.id for k in m.known}
    lines = ["", "## Findings: measured ranges (each repro, every mode, per release)", "",
             f"{len(m.known)} findings, forms of {len(roots)} root causes (`conformance/known_failures.toml`).", ""]
    if not rel:
        return lines + ["No release has run the findings' repros yet (`ci/matrix.py --tiers repros`): every range in"
                        " `known_failures.toml` is unmeasured here."]
    lines += ["D: the repro showed its deviation; s: as specified; ?: no verdict (it could not run there); blank: not run."
              " A bound marked *unmeasured* has no run on the release beside it that came out as specified.", "",
              "| finding | known_failures.toml range | " + " | ".join(rel) + " | measured first | measured last | disagrees |",
              "| --- | --- | " + " | ".join("---" for _ in rel) + " | --- | --- | --- |"]
    for f in a["measured"]:
        cells = [REPRO_MARK.get(f["cells"].get(r, ""), "") for r in rel]
        first = f"{f['first']}{'' if f['lower_measured'] else ' *unmeasured*'}" if f["first"] else "-"
        last = f"{f['last']}{'' if f['upper_measured'] else ' *unmeasured*'}" if f["last"] else "-"
        lines.append(f"| {table_cell(f['id'])} | `{f['range']}` | " + " | ".join(cells) + f" | {first} | {last} | "
                     + (f"**{', '.join(f['disagrees'])}**" if f["disagrees"] else "-") + " |")
    return lines


def render_html(m: Matrix, a: dict) -> str:
    return _ENV.get_template("matrix.html.j2").render(
        m=m, a=a, verdicts=VERDICTS, combined=_combined, run_label=run_label, title="fsdp-conformance release matrix",
    )


def write(directory: Path = DEFAULT_DIR, known: list | None = None) -> tuple[Path, Path]:
    m = load(directory, known)
    a = analyse(m)
    directory = Path(directory)
    md, html = directory / "README.md", directory / "index.html"
    for path, text in ((md, render_markdown(m, a)), (html, render_html(m, a))):
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)  # never a half-written page
    return md, html


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) > 1:
        print("usage: python -m conformance.report.matrix [MATRIX_DIR]", file=sys.stderr)
        return 2
    try:
        md, html = write(Path(argv[0]) if argv else DEFAULT_DIR)
    except (MatrixError, known_mod.KnownFailuresError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {md} and {html}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
