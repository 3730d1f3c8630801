"""Write a report's files into the report directory, each atomically:
report.json, summary.md, junit.xml, report.html; repro scripts for findings."""

from __future__ import annotations

import json
from pathlib import Path

from conformance.report import data, html, junit, markdown

# where each process of a run keeps its part while the run goes (merged into the report)
PARTIAL = ".partial"

FILES = {"json": "report.json", "md": "summary.md", "junit": "junit.xml", "html": "report.html"}


def write_repros(report: dict, report_dir: Path) -> None:
    """Give every finding a repro script (its smallest case), path relative
    to the report directory. A script that cannot be generated is noted, not
    fatal: the report must still be written."""
    # the repro generators import torch and the areas; a report without findings to script needs neither
    from conformance.case.model_case import case_from_json
    from conformance.run.session import write_repro_file

    for f in report.get("findings", []):
        if f.get("repro") and (Path(report_dir) / f["repro"]).exists():
            continue
        try:
            spec = case_from_json(json.dumps(f["spec"]))
            lines = [f"{'KNOWN ' + f['known_failure'] + ': ' if f.get('known_failure') else ''}{v['message'] if isinstance(v, dict) else v}" for v in f.get("violations") or [f["message"]]]
            path = write_repro_file(Path(report_dir) / "repros", spec, f["invariant"], lines)
            f["repro"] = str(path.relative_to(report_dir))
        except Exception as e:  # noqa: BLE001 - a report beats a perfect report
            f["repro"] = None
            f["repro_error"] = f"{type(e).__name__}: {e}"


def write_all(report: dict, report_dir: Path, formats=("json", "md", "junit", "html"), repros: bool = True) -> dict[str, Path]:
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    if repros:
        write_repros(report, report_dir)
    out = {}
    for fmt in formats:
        path = report_dir / FILES[fmt]
        if fmt == "json":
            data.write_json(path, report)
        elif fmt == "md":
            data.write_text(path, markdown.render(report))
        elif fmt == "junit":
            data.write_text(path, junit.render(report))
        elif fmt == "html":
            data.write_text(path, html.render(report, report_dir))
        out[fmt] = path
    return out
