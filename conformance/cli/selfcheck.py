"""`fsdp-conformance selfcheck`: the suite's own tests, or (--mutants) its
mutation score."""

from __future__ import annotations

import datetime
import json
import signal
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from conformance import paths
from conformance.cli.errors import UsageError
from conformance.cli.pytest_run import pytest_main
from conformance.report import data
from conformance.report.data import suite_info
from conformance.run import profiles

if TYPE_CHECKING:
    from conformance.selfcheck.mutants import Mutant


def cmd_selfcheck(ns) -> int:
    checkout = paths.PACKAGE.parent
    if not (checkout / "tests" / "self").is_dir():
        raise UsageError("the suite's own tests (tests/self) are in a checkout of fsdp-conformance, not in the installed package")
    return pytest_main(["tests/self", "-q"], cwd=checkout)


def _render_saved(ns, mutants: list[Mutant]) -> int:
    """The table of outcomes saved by earlier runs (several runs: each
    mutant's latest outcome); mutants no run measured are listed as such."""
    # torch and the areas: imported by the commands that need them (the CLI parses, and rejects bad input, without)
    from conformance.selfcheck.mutants import Outcome, render_md, render_text

    by_id = {m.id: m for m in mutants}
    got: dict[str, Outcome] = {}
    runs = []
    for path in ns.render:
        try:
            runs.append((path, json.loads(Path(path).read_text())))
        except (OSError, ValueError) as e:
            raise UsageError(f"cannot read saved outcomes {path}: {e}") from None
    # latest by each run's own date, not by the order of the arguments (a
    # shell glob puts run28 before run3)
    runs.sort(key=lambda r: str(r[1].get("date") or ""))
    metas = []
    for path, saved in runs:
        metas.append({k: v for k, v in saved.items() if k != "outcomes"})
        for o in saved.get("outcomes", []):
            m = by_id.get(o["id"])
            if m is not None and not (o["status"] in ("timeout", "invalid") and m.id in got and got[m.id].status not in ("timeout", "invalid")):
                # latest wins, but a run that timed out (or whose failure was a
                # baseline failure) does not undo one that finished
                got[m.id] = Outcome(m, o["status"], list(o.get("killed_by") or []), o.get("detail") or "",
                                    float(o.get("seconds") or 0), int(o.get("examples") or 0), Path(path).stem)
    outcomes = [got.get(m.id) or Outcome(m, "not run", detail="no saved outcome") for m in mutants]
    meta = dict(metas[-1]) if metas else {"command": "?", "torch": "?", "profile": "?", "examples": None, "tiers": "?", "date": "?"}
    meta["runs"] = [
        f"`{Path(p).stem}`: {x.get('date')}, suite {x.get('suite')}, profile `{x.get('profile')}`, "
        f"{x.get('examples') if x.get('examples') is not None else 'the profile' + chr(39) + 's'} examples per test, tiers `{x.get('tiers')}`"
        + (f", without {', '.join(x['skipped_invariants'])}" if x.get("skipped_invariants") else "")
        + ("" if x.get("complete") else " (partial: stopped, or only some mutants)")
        + ("" if x.get("baseline_checked") else "; its kills not checked against the unmodified torch (before that check)")
        for (p, _), x in zip(runs, metas)
    ]
    sys.stdout.write(render_text(outcomes))
    if ns.output:
        data.write_text(Path(ns.output), render_md(outcomes, meta))
    return 0


def add_mutant_arguments(p) -> None:
    # torch and the areas: imported by the commands that need them (the CLI parses, and rejects bad input, without)
    from conformance.selfcheck.mutants import DEFAULT_EXAMPLES, DEFAULT_TIMEOUT
    p.add_argument("--mutants", action="store_true", help="measure the suite's mutation score (conformance/mutants.toml) instead of running tests/self")
    p.add_argument("--profile", default="ci", help="Hypothesis profile of the mutant runs (default ci)")
    p.add_argument("--mutant", action="append", metavar="ID", help="only these mutants (repeatable)")
    p.add_argument("--examples", type=int, default=DEFAULT_EXAMPLES,
                   help=f"examples per test in a mutant run (default {DEFAULT_EXAMPLES}; 0: the profile's own budget, as a run of it draws)")
    p.add_argument("--tiers", default="fake,gloo", help="tiers of the mutant runs (default fake,gloo)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds before a mutant run is stopped")
    p.add_argument("--all-kills", action="store_true", help="do not stop a mutant at its first failing test: list every invariant that catches it")
    p.add_argument("-j", "--jobs", type=int, default=1, help="mutants run at once (default 1)")
    p.add_argument("--list", action="store_true", help="list the catalog (checking that every mutant applies) and exit")
    p.add_argument("--render", nargs="+", metavar="JSON", default=None,
                   help="run nothing: the kill table of saved outcomes (--json files of earlier runs; a mutant's outcome in the latest run by date counts)")
    p.add_argument("-o", "--output", default=None, help="also write the kill table as Markdown (e.g. reports/mutants.md)")
    p.add_argument("--json", default=None, help="also write the outcomes as JSON")
    p.add_argument("--skip-invariant", action="append", default=[], metavar="ID",
                   help="leave this invariant out of every mutant run (one that fails on the unmodified torch with the same draws; recorded in the JSON and the table)")


def cmd_mutants(ns) -> int:
    """Exit 0: every non-equivalent mutant killed and no equivalent one
    killed; 1 otherwise; 2: a mutant that does not apply, bad options."""
    # torch and the areas: imported by the commands that need them (the CLI parses, and rejects bad input, without)
    from conformance.areas import CATALOG
    from conformance.selfcheck.mutants import (
        DEFAULT_EXAMPLES,
        STOPPING,
        Baseline,
        MutantError,
        Outcome,
        check_all,
        confirm_kill,
        load,
        render_md,
        render_text,
        run_one,
        select,
        stop_all,
    )


    try:
        profiles.selected(ns.profile)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if ns.examples is not None and ns.examples < 0:
        raise UsageError(f"--examples must be >= 0 (0: the profile's budget), got {ns.examples}")
    if ns.examples == 0:
        ns.examples = None

    bad = [i for i in ns.skip_invariant if i not in CATALOG]
    if bad:
        raise UsageError(f"--skip-invariant: unknown invariant {bad[0]!r}")
    try:
        mutants = select(load(), ns.mutant)
        check_all(mutants)
    except MutantError as e:
        raise UsageError(str(e)) from None
    if ns.render:
        return _render_saved(ns, mutants)
    if ns.list:
        for m in mutants:
            print(f"{m.id:<44} {m.api:<15} {m.path}{'  (equivalent)' if m.equivalent else ''}\n    {m.description}")
        print(f"{len(mutants)} mutants, all apply to the installed torch")
        return 0
    if ns.jobs < 1:
        raise UsageError(f"--jobs must be >= 1, got {ns.jobs}")
    import torch

    meta = {"command": "fsdp-conformance selfcheck --mutants" + (f" --profile {ns.profile}" if ns.profile != "ci" else "")
            + (f" --examples {ns.examples or 0}" if ns.examples != DEFAULT_EXAMPLES else ""),
            "torch": torch.__version__, "profile": ns.profile, "examples": ns.examples, "tiers": ns.tiers,
            "suite": _suite_revision(), "skipped_invariants": list(ns.skip_invariant), "baseline_checked": True,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


    done = [0]

    lock = threading.Lock()
    finished: list[Outcome] = []

    def one(m: Mutant, tmp: str, baseline: Baseline) -> Outcome:
        if STOPPING.is_set():
            raise KeyboardInterrupt
        o = run_one(m, profile=ns.profile, examples=ns.examples, tiers=ns.tiers, work=Path(tmp),
                    timeout=ns.timeout, stop_first=not ns.all_kills, skip=tuple(ns.skip_invariant))
        o = confirm_kill(o, baseline)
        if STOPPING.is_set():  # a run the interruption stopped says nothing about its mutant (not a crash kill)
            raise KeyboardInterrupt
        with lock:
            finished.append(o)
            if ns.json:  # as the run goes: a long run stopped half-way keeps what it measured
                data.write_json(Path(ns.json), {**meta, "complete": False, "outcomes": [x.to_dict() for x in finished]})
        done[0] += 1
        print(f"[{done[0]}/{len(mutants)}] {m.id}: {o.status}{': ' + ', '.join(o.killed_by) if o.killed_by else ''}"
              f"{' (' + o.detail + ')' if o.status in ('error', 'timeout', 'invalid') else ''} [{o.seconds:.0f}s]", file=sys.stderr, flush=True)
        return o

    with tempfile.TemporaryDirectory(prefix="fsdp-conformance-mutants-") as tmp:
        # a kill counts only where the unmodified torch passes the same test
        baseline = Baseline(Path(tmp), profile=ns.profile, examples=ns.examples, tiers=ns.tiers, timeout=ns.timeout,
                            python=sys.executable, skip=tuple(ns.skip_invariant))
        # each mutant runs in its own process group; threads only wait on
        # them. SIGINT / SIGTERM: those runs and their ranks are stopped
        # first (their own sessions do not hear the signal), then the
        # interruption ends the command (the JSON keeps what finished).
        def interrupted(signum, frame):
            stop_all()
            print(f"fsdp-conformance: selfcheck interrupted ({signal.Signals(signum).name}); its mutant runs were stopped",
                  file=sys.stderr, flush=True)
            raise SystemExit(128 + signum)

        before = {s: signal.signal(s, interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            with ThreadPoolExecutor(max_workers=ns.jobs) as pool:
                outcomes = list(pool.map(lambda m: one(m, tmp, baseline), mutants))
        finally:
            for s, h in before.items():
                signal.signal(s, h)
    sys.stdout.write(render_text(outcomes))
    if ns.output:
        data.write_text(Path(ns.output), render_md(outcomes, meta))
    if ns.json:
        data.write_json(Path(ns.json), {**meta, "complete": True, "outcomes": [o.to_dict() for o in outcomes]})
    if any(o.status == "error" for o in outcomes):
        return 2
    bad = [o for o in outcomes if (o.status != "killed") != bool(o.mutant.equivalent)]
    return 1 if bad else 0


def add_parser(sub) -> None:
    p = sub.add_parser("selfcheck", help="run the suite's own tests; --mutants: the suite's mutation score")
    add_mutant_arguments(p)
    p.set_defaults(fn=lambda ns: cmd_mutants(ns) if ns.mutants else cmd_selfcheck(ns))


def _suite_revision() -> str | None:

    info = suite_info()
    rev = info.get("git_revision")
    return (rev[:12] + ("+dirty" if info.get("git_dirty") else "")) if rev else None
