"""`fsdp-conformance hunt`: Hunting mode: rounds of freshly seeded examples until the time is up, the
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

from conformance.report import data, markdown

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

    body = {"rounds": rounds, "unexplained": [f["id"] for f in unexplained(report)] if report else None}
    data.write_json(Path(report_dir) / "hunt.json", body)


def _print_finds(report: dict | None, rounds: list[dict], seconds: float, out) -> int:
    if report is None:
        out("hunt: error: the rounds wrote no report")
        return 2

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
from conformance.cli.errors import UsageError
from conformance.cli.pytest_run import conformance_args, run_pytest


def cmd_hunt(ns) -> int:
    """Rounds of fresh random examples until --minutes are up; finds kept in
    the example database and replayed first by the next hunt (or run)."""
    if not ns.minutes > 0:
        raise UsageError(f"--minutes must be > 0, got {ns.minutes}")
    args, report_dir = conformance_args(ns, "hunt", Path("reports") / "hunt")

    def run_round(stop_at: float, save: Path, priors: list[Path]) -> int:
        round_args = args + [f"--stop-at={stop_at}", f"--save-partials={save}"]
        round_args += [f"--prior-partials={p}" for p in priors]
        return run_pytest(round_args, report_dir, live=False, quiet=True)

    print(f"hunt: {ns.minutes:g} min, example database {ns.database}, report {report_dir}")
    return hunt(run_round, minutes=ns.minutes, report_dir=report_dir)


def add_parser(sub) -> None:
    p = sub.add_parser("hunt", help="keep drawing fresh examples until the time is up; keep the finds in an example database")
    p.add_argument("--minutes", type=float, required=True, help="how long to hunt")
    p.add_argument("--database", default=".fsdp-conformance-db", help="example database: a directory (default .fsdp-conformance-db), github:OWNER/REPO (read the CI artifact), redis://HOST:PORT (a fleet)")
    p.add_argument("--examples", type=int, default=None, help="examples per test and round (default 50; the pool-backed tests a fifth of it)")
    p.add_argument("--backend", default=None, help="fake | gloo | nccl | auto; default: fake and gloo")
    p.add_argument("--tiers", default=None, help="several backends, comma-separated (e.g. fake,gloo)")
    p.add_argument("--world-size", type=int, default=2, help="ranks of the gloo / NCCL pool (default 2)")
    p.add_argument("--fake-world-size", type=int, default=4, help="world size of the fake process group (default 4)")
    p.add_argument("--invariant", action="append", help="invariant ID or area (repeatable); default all")
    p.add_argument("-n", "--workers", type=int, default=0, help="pytest-xdist workers (default 0: one process)")
    p.add_argument("--report-dir", default=None, help="where the report goes (default: reports/hunt under the current directory)")
    p.add_argument("--baseline", action="append", help="baseline report (default auto; 'none')")
    p.add_argument("--deadline", type=float, default=60.0, help="seconds before a pool example is a HANG")
    p.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    p.set_defaults(fn=cmd_hunt)
