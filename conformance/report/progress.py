"""Live progress of a run on a terminal (rich), read from the files the
pytest processes write as they go: ``.partial/*.json`` and ``report.json``."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from conformance.report.data import merge_tallies, row_label
from conformance.report.markdown import headline, known_line
from conformance.report.write import PARTIAL

STYLE = {"PASS": "green", "FAIL": "bold red", "KNOWN": "yellow", "FIXED": "cyan", "SKIP": "dim", "running": "blue"}


def snapshot(report_dir: Path) -> dict:
    """What the run has done so far: merged tallies, test items done/collected."""
    report_dir = Path(report_dir)
    parts = []
    for p in sorted((report_dir / PARTIAL).glob("*.json")):
        try:
            parts.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    items = {"collected": max([0] + [p.get("collected", {}).get("items", 0) for p in parts]), "done": 0}
    try:
        rep = json.loads((report_dir / "report.json").read_text())
        items = rep.get("run", {}).get("items", items) if rep.get("status") == "running" else items
    except (OSError, ValueError):
        pass
    for p in parts:
        items["done"] = max(items["done"], p.get("collected", {}).get("done", 0))
    return {"tallies": merge_tallies(parts), "items": items}


def _verdict(t: dict) -> str:
    kinds = {f["kind"] for f in t["findings"]}
    if kinds & {"FAIL", "HANG", "CRASH", "ERROR"}:
        return "FAIL"
    return "KNOWN" if "KNOWN" in kinds else "PASS"


def render(snap: dict, elapsed: float) -> Group:
    items = snap["items"]
    tallies = snap["tallies"]
    examples = sum(t["examples"] for t in tallies.values())
    fails = sum(1 for t in tallies.values() for f in t["findings"] if f["kind"] != "KNOWN")
    known = sum(1 for t in tallies.values() for f in t["findings"] if f["kind"] == "KNOWN")
    head = Text.assemble(
        ("fsdp-conformance ", "bold"),
        f"tests {items.get('done', 0)}/{items.get('collected', 0) or '?'} | invariants {len(tallies)} | ",
        f"examples {examples} | ",
        (f"failures {fails}", "bold red" if fails else "green"),
        f" | known {known} | {elapsed:.0f}s",
    )
    table = Table(box=None, pad_edge=False, show_header=True, header_style="bold")
    for col in ("invariant", "API", "tier", "examples", "so far", "findings"):
        table.add_column(col, justify="right" if col == "examples" else "left")
    for (inv, api, tier), t in sorted(tallies.items()):
        v = _verdict(t)
        names = ", ".join(f.get("known_failure") or f["key"] for f in t["findings"])
        table.add_row(inv, api, tier, str(t["examples"]), Text(v, style=STYLE.get(v, "")), Text(names[:80]))
    return Group(head, table)


def follow(report_dir: Path, proc, console: Console | None = None, interval: float = 0.5) -> None:
    """Redraw the progress until ``proc`` (the pytest process) ends."""
    console = console or Console()
    start = time.monotonic()
    with Live(render(snapshot(report_dir), 0.0), console=console, refresh_per_second=4, transient=True) as live:
        while proc.poll() is None:
            time.sleep(interval)
            live.update(render(snapshot(report_dir), time.monotonic() - start))


def final_table(report: dict, console: Console) -> None:
    """The finished report on a terminal: the matrix, findings, warnings."""

    table = Table(title=None, header_style="bold")
    for col in ("invariant", "API", "tier", "verdict", "examples", "time", "findings / reason"):
        table.add_column(col, justify="right" if col in ("examples", "time") else "left")
    for r in report["results"]:
        if r["verdict"] == "SKIP" and r.get("reason") == "not selected":
            continue
        names = ", ".join(f.rsplit("/", 1)[-1] for f in r["findings"]) or (r.get("reason") or "")
        table.add_row(row_label(r), r["api"], r["tier"], Text(r["verdict"], style=STYLE.get(r["verdict"], "")),
                      str(r["examples"]), f"{r['seconds']:.1f}s", Text(names))
    console.print(table)
    for f in report["findings"]:
        if f["kind"] != "KNOWN":
            console.print(f"[bold red]{f['kind']}[/] {escape(row_label(f))} ({f['api']}, {f['tier']}): {escape(f['message'])}", highlight=False)
            if f.get("repro"):
                console.print(f"    repro: {escape(f['repro'])}", highlight=False)
    for w in report.get("warnings", []):
        console.print(f"[yellow]warning:[/] {escape(w)}", highlight=False)
    for t in report.get("tests", {}).get("failed", []):
        console.print(f"[bold red]failed test[/] {escape(t['nodeid'])}: {escape(t.get('message') or '')}", highlight=False)
    hint = report.get("snapshots", {}).get("hint")
    if hint:
        console.print(f"[yellow]{escape(hint)}[/]", highlight=False)
    console.print(Text(headline(report), style="bold red" if report["summary"]["failed"] else "bold green"))
    console.print(known_line(report), highlight=False)
