"""Hunting mode: rounds of freshly seeded examples until the time is up, the
finds kept in a Hypothesis example database (so that they replay first on
the next run), one report over every round with unexplained failures first.

Why not HypoFuzz: its licence forbids use in commercial organisations and in
CI for commercial products, which is where FSDP is developed and upgraded;
its coverage guidance sees the driver process, while FSDP's work runs in the
rank processes; and it runs until killed with a dashboard on a port. What the
hunt needs from it, a persistent and shareable store of found examples, is
Hypothesis's own example database.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

FAILING = ("FAIL", "HANG", "CRASH", "ERROR")
MIN_ROUND_SECONDS = 10  # no new round with less time than this left


def hunt(run_round, *, minutes: float, report_dir: Path, out=print) -> int:
    """Run rounds until ``minutes`` are up. ``run_round(stop_at, save,
    priors)`` runs one pytest round and returns its exit status (0, 1, or
    >= 2: stop). Each round draws from a fresh random seed: Hypothesis keeps
    nothing in the database for a run with an explicit seed. Returns the
    hunt's exit status: 1 when an unexplained failure was found, 0 when none,
    the round's status when a round could not run."""
    start = time.time()
    stop_at = start + minutes * 60
    rounds_dir = Path(report_dir) / "hunt-rounds"
    rounds_dir.mkdir(parents=True, exist_ok=True)
    for old in rounds_dir.glob("round-*.json"):
        old.unlink()
    priors: list[Path] = []
    rounds: list[dict] = []
    while not rounds or stop_at - time.time() >= MIN_ROUND_SECONDS:
        save = rounds_dir / f"round-{len(rounds)}.json"
        t0 = time.time()
        out(f"hunt: round {len(rounds) + 1}, {max(0.0, stop_at - t0):.0f}s left")
        rc = run_round(stop_at, save, list(priors))
        rounds.append({"round": len(rounds) + 1, "exit_status": rc, "seconds": round(time.time() - t0, 1)})
        if save.exists():
            priors.append(save)
        if rc not in (0, 1):
            _write_summary(report_dir, rounds, None)
            return rc
    report = _load_report(report_dir)
    _write_summary(report_dir, rounds, report)
    return _print_finds(report, rounds, time.time() - start, out)


def _load_report(report_dir: Path) -> dict | None:
    try:
        return json.loads((Path(report_dir) / "report.json").read_text())
    except (OSError, ValueError):
        return None


def unexplained(report: dict) -> list[dict]:
    return [f for f in report.get("findings", []) if f["kind"] in FAILING]


def _write_summary(report_dir: Path, rounds: list[dict], report: dict | None) -> None:
    from conformance.report import data

    body = {"rounds": rounds, "unexplained": [f["id"] for f in unexplained(report)] if report else None}
    data.write_json(Path(report_dir) / "hunt.json", body)


def _print_finds(report: dict | None, rounds: list[dict], seconds: float, out) -> int:
    if report is None:
        out("hunt: error: the rounds wrote no report")
        return 2
    from conformance.report import markdown

    new = unexplained(report)
    known = [f for f in report.get("findings", []) if f["kind"] == "KNOWN"]
    out(f"hunt: {len(rounds)} round(s) in {seconds:.0f}s, {report['summary']['examples']} examples; "
        f"{len(new)} unexplained failure(s), {len({f['known_failure'] for f in known})} known finding(s) seen")
    for f in new:  # the new, unexplained failures first, each with its repro
        out(f"  NEW {f['kind']} {f['id']}: {f['message'][:300]}")
        if f.get("repro"):
            out(f"      repro: {f['repro']}")
    for fid in sorted({f["known_failure"] for f in known}):
        out(f"  known {fid}")
    out(markdown.headline(report))
    return 1 if new or report["summary"]["failed"] else 0
