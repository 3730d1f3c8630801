"""The self-contained HTML page of a report: a matrix of invariants by API
and tier, then every finding with its case and repro script (jinja2)."""

from __future__ import annotations

import re
from pathlib import Path

import jinja2

from conformance.report import markdown
from conformance.report.data import VERDICTS

_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(Path(__file__).with_name("templates"))),
    autoescape=jinja2.select_autoescape(["html", "j2"]),
    undefined=jinja2.ChainableUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
MAX_REPRO = 20000


def _anchor(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-")


def render(report: dict, report_dir: Path | None = None) -> str:
    """``report_dir``: where relative repro paths point (their text is embedded)."""
    columns = []
    for r in report["results"]:
        col = (r["api"], r["tier"], r.get("model") or "")  # a real model's rows: columns beside the synthetic ones
        if col not in columns:
            columns.append(col)
    # a model run (`fsdp-conformance model`): its synthetic columns, where nothing ran, left out
    if (report.get("run") or {}).get("target"):
        ran = {(r["api"], r["tier"], r.get("model") or "") for r in report["results"] if r.get("examples")}
        columns = [c for c in columns if c[2] or c in ran] or columns
    cells, areas = {}, []
    by_area: dict[str, list] = {}
    seen = set()
    for r in report["results"]:
        cells[(r["invariant"], r["api"], r["tier"], r.get("model") or "")] = {**r, "anchor": _anchor(r["findings"][0]) if r["findings"] else ""}
        if r["invariant"] not in seen:
            seen.add(r["invariant"])
            by_area.setdefault(r.get("area") or "other", []).append({"id": r["invariant"], "statement": r.get("statement", "")})
    areas = list(by_area.items())
    known = {k["id"]: k for k in report.get("known_failures", [])}
    findings = []
    for f in sorted(report.get("findings", []), key=lambda f: (f["kind"] == "KNOWN", f["id"])):
        text = None
        if f.get("repro") and report_dir is not None:
            p = Path(f["repro"])
            p = p if p.is_absolute() else Path(report_dir) / p
            try:
                text = p.read_text()[:MAX_REPRO]
            except OSError:
                text = None
        findings.append({**f, "anchor": _anchor(f["id"]), "repro_text": text, "known": known.get(f.get("known_failure"))})
    # the known failures this run exercised (matched, fixed, masked, unmatched, unchecked); the
    # others (not selected, another torch's) by name only
    ran = [k for k in report.get("known_failures", []) if k.get("status") not in ("not-run", "other-torch")]
    not_ran = [k for k in report.get("known_failures", []) if k not in ran]
    target = (report.get("run") or {}).get("target")
    return _ENV.get_template("report.html.j2").render(
        report=report,
        heading=f"fsdp-conformance model report: {target}" if target else "fsdp-conformance report",
        title=(f"{target}: " if target else "") + markdown.headline(report),
        known_ran=ran,
        known_not_ran=not_ran,
        headline=markdown.headline(report),
        verdicts=VERDICTS,
        columns=columns,
        cells=cells,
        areas=areas,
        findings=findings,
        known_line=markdown.known_line(report),
    )
