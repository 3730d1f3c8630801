"""The Markdown summary of a report: short enough for a GitHub job summary."""

from __future__ import annotations

from pathlib import Path

from conformance.report.data import row_label
from conformance.run.features import FEATURES

MARK = {"PASS": "PASS", "FAIL": "**FAIL**", "KNOWN": "KNOWN", "FIXED": "_FIXED_", "SKIP": "SKIP"}
MAX_FINDINGS = 30
CLASS_ORDER = {"bug": 0, "implicit": 1, "diagnostic": 2, "limitation": 3, "enhancement": 4}
MAX_CODE = 4000


def table_cell(text) -> str:
    """``text`` as one Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def headline(report: dict) -> str:
    s = report["summary"]
    v = s["verdicts"]
    state = "FAIL" if s["failed"] else "PASS"
    if not report.get("complete", True):
        state += f" (incomplete: {report.get('status')}{', ' + report['interrupted_by'] if report.get('interrupted_by') else ''})"
    parts = [f"{v.get(k, 0)} {k}" for k in ("PASS", "KNOWN", "FIXED", "FAIL", "SKIP") if v.get(k)]
    secs = s.get("wall_seconds") if s.get("wall_seconds") is not None else s["seconds"]
    return f"fsdp-conformance {state}: {', '.join(parts) or 'nothing ran'}; {s['examples']} examples in {secs:.0f}s"


def known_line(report: dict) -> str:
    """The known failures this run matched, by class (bugs apart from the
    rest), and the root causes they are forms of."""
    by = report["summary"].get("known_by_class") or {}
    n = sum(by.values())
    if not n:
        return "Known failures matched: none"
    parts = ", ".join(f"{v} {k}" for k, v in by.items() if v)
    return f"Known failures matched: {n} ({parts}), forms of {report['summary'].get('root_causes_matched', 0)} root cause(s)"


def render(report: dict, *, details: bool = True) -> str:
    t = report.get("torch", {})
    run = report.get("run", {})
    tiers = ", ".join(f"{x['tier']} ({x.get('backend')}, W={x.get('world_size')})" for x in run.get("tiers", []))
    suite = report.get("suite", {})
    rev = (suite.get("git_revision") or "?")[:12] + ("+dirty" if suite.get("git_dirty") else "")
    lines = [
        f"## {headline(report)}",
        "",
        f"torch `{t.get('version')}` (git `{(t.get('git_version') or '?')[:12]}`, CUDA {t.get('cuda') or '-'}, NCCL {t.get('nccl') or '-'})"
        f" | suite {suite.get('version')} `{rev}` | tiers {tiers or '-'}"
        f" | profile `{run.get('profile')}`" + (f", seed {run['seed']}" if run.get("seed") is not None else ""),
        *([f"FSDP from source: `{fsdp_source_label(report.get('fsdp_source'))}`", ""] if report.get("fsdp_source") else []),
        "",
        "| invariant | API | tier | verdict | checked / examples | time | findings |",
        "| --- | --- | --- | --- | ---: | ---: | --- |",
    ]
    for r in report["results"]:
        fnd = ", ".join(f.rsplit("/", 1)[-1] for f in r["findings"]) or (r.get("reason") or "")
        lines.append(
            f"| {row_label(r)} | {r['api']} | {r['tier']} | {MARK.get(r['verdict'], r['verdict'])} | {r.get('checked', r['examples'])} / {r['examples']} "
            f"| {r['seconds']:.1f}s | {table_cell(fnd)} |"
        )
    failed_tests = report.get("tests", {}).get("failed", [])
    if failed_tests:
        lines += ["", "### Failed tests", ""]
        lines += [f"- `{t['nodeid']}`: {table_cell(t.get('message') or '')}" for t in failed_tests]
    hint = report.get("snapshots", {}).get("hint")
    if hint:
        lines += ["", f"> {hint}"]
    corpus = report.get("corpus") or []
    if corpus:
        cases = sorted({c["case"] for c in corpus})
        fixed = sorted({c["finding"] for c in corpus if c.get("finding_status") == "fixed"})
        failed = sorted({c["case"] for c in corpus if c.get("outcome") == "FAIL"})
        lines += ["", f"Regression corpus: {len(cases)} case(s) checked first"
                  + (f"; **FAIL**: {', '.join(failed)}" if failed else "")
                  + (f"; _FIXED_ (the finding no longer reproduces; remove it from known_failures.toml): {', '.join(fixed)}" if fixed else "")]
    matched = [k for k in report.get("known_failures", []) if k.get("status") == "matched"]
    if matched:
        lines += ["", f"### {known_line(report)}", "", "| finding | class | root cause | upstream |", "| --- | --- | --- | --- |"]
        for k in sorted(matched, key=lambda k: (CLASS_ORDER.get(k.get("class"), 9), k["id"])):
            ups = ", ".join(f"[{u['repo'].split('/')[-1]}#{u['number']}]({u['url']}) {u['state']}" + (f" (fixed in {u['fixed_in']})" if u.get("fixed_in") else "")
                            for u in k.get("upstream", [])) or f"none found ({k.get('upstream_searched')})"
            lines.append(f"| `{k['id']}` | {k.get('class')} | `{k.get('root_cause')}` | {ups} |")
    if report.get("warnings"):
        lines += ["", "### Warnings", ""]
        lines += [f"- {w}" for w in report["warnings"]]
    findings = [f for f in report.get("findings", []) if f["kind"] != "KNOWN"] + [f for f in report.get("findings", []) if f["kind"] == "KNOWN"]
    if details and findings:
        lines += ["", "### Findings", ""]
        for f in findings[:MAX_FINDINGS]:
            label = f"known failure `{f['known_failure']}` ({f.get('known_class')})" if f.get("known_failure") else f["kind"]
            lines += [
                "<details>",
                f"<summary><b>{f['kind']}</b> {row_label(f)} ({f['api']}, {f['tier']}): {label}, {f['count']} example(s)</summary>",
                "",
                f"{table_cell(f['message'])}",
                "",
            ]
            if f.get("repro"):
                lines += [f"Repro: `{f['repro']}`", ""]
            code = f.get("spec_python") or ""
            if len(code) > MAX_CODE:
                code = code[:MAX_CODE] + "\n# ... (truncated; the full case is in the JSON report)"
            lines += ["```python", code.rstrip(), "```", "</details>"]
        if len(findings) > MAX_FINDINGS:
            lines.append(f"\n... and {len(findings) - MAX_FINDINGS} more findings in the JSON report.")
    return "\n".join(lines) + "\n"


def features_table(report: dict) -> str:
    """How often each case feature was drawn, per test area and tier: the
    share of examples (conformance.run.features)."""

    rows: dict[tuple[str, str], dict] = {}
    for r in report["results"]:
        if not r["examples"]:
            continue
        key = (r.get("area") or r["invariant"], r["tier"])
        acc = rows.setdefault(key, {"examples": 0, "features": {}})
        acc["examples"] += r["examples"]
        for f, n in r.get("features", {}).items():
            acc["features"][f] = acc["features"].get(f, 0) + n
    lines = ["| area | tier | examples | " + " | ".join(FEATURES) + " |", "| --- | --- | ---: |" + " ---: |" * len(FEATURES)]
    for (area, tier), acc in sorted(rows.items()):
        cells = [f"{100 * acc['features'].get(f, 0) / acc['examples']:.0f}%" for f in FEATURES]
        lines.append(f"| {area} | {tier} | {acc['examples']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def fsdp_source_label(info: dict | None) -> str:
    """One line: "installed" or PATH@commit(+dirty sha)."""
    if not info:
        return "installed"
    s = info.get("path", "?")
    if info.get("git_commit"):
        s += f"@{info['git_commit'][:12]}"
        if info.get("git_dirty"):
            s += f"+dirty:{(info.get('git_diff_sha256') or '')[:12]}"
    else:
        s += f" (files sha256 {(info.get('files_sha256') or '?')[:12]})"
    diff = info.get("differs_from_installed")
    if diff is not None:
        s += f"; differs from installed in {len(diff)} file{'s' if len(diff) != 1 else ''}"
        if 0 < len(diff) <= 3:
            s += " (" + ", ".join(Path(d).name for d in diff) + ")"
    return s
