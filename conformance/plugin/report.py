"""pytest plugin: the conformance session of each process, the report of the
run (merged across pytest-xdist workers), written as the run goes and at its
end, also when it is interrupted.

Each process that runs conformance tests (the only one, or each xdist worker)
keeps a Session and writes it, throttled, to ``<report-dir>/.partial/<id>.json``.
The controlling process merges those files into ``report.json`` (marked
incomplete) after test items finish, and at the end writes every format.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from conformance import paths
from conformance.report import data, write
from conformance.report.data import row_label
from conformance.report.write import PARTIAL
from conformance.selfcheck import fsdp_source

PLUGIN_NAME = "fsdp-conformance-report"
FLUSH_SECONDS = 1.0
REPORT_SECONDS = 2.0
# The progress files (a worker's partial tallies, the running report) are
# written at most this share of the time: each write serializes every
# finding so far, so a long run's writes grow, and their interval with them.
PROGRESS_SHARE = 0.02
NEEDS_RANKS_REASON = "needs several real ranks: not run on the fake tier"


def item_invariants(item) -> tuple[list[str], str | None]:
    """(invariant IDs, tier) a conformance test item checks: its
    ``invariant_id`` parameter, else (a test that checks several per example)
    every invariant of its module's area (conformance/suite/test_<area>.py)."""
    cs = getattr(item, "callspec", None)
    params = cs.params if cs is not None else {}
    tier = params.get("engine")
    tier = tier if isinstance(tier, str) else None
    inv = params.get("invariant_id")
    if isinstance(inv, str):
        return [inv], tier
    if "conformance" not in getattr(item, "fixturenames", ()):
        return [], tier
    from conformance.areas import AREAS  # torch and FSDP: only where conformance tests run

    module = getattr(item, "module", None)
    name = module.__name__.rpartition(".")[2] if module is not None else ""
    area = next((a for a in AREAS if a.suite_module == name), None)
    return ([i.id for i in area.invariants] if area else []), tier


def tier_info(config) -> list[dict]:
    tiers = [t for t in config.getoption("--tiers").split(",") if t]
    out = []
    for t in tiers:
        if t == "fake":
            out.append({"tier": t, "backend": "fake", "world_size": config.getoption("--fake-world-size")})
        else:
            out.append({"tier": t, "backend": t, "world_size": config.getoption("--world-size")})
    return out


class ReportPlugin:
    def __init__(self, config) -> None:
        self.config = config
        self.worker = getattr(config, "workerinput", {}).get("workerid")
        self.is_worker = self.worker is not None
        self.uses_xdist = not self.is_worker and getattr(config.option, "dist", "no") not in (None, "no")
        self.report_dir = Path(config.getoption("--report-dir") or paths.default_report_dir(config.rootpath))
        self.partial_dir = self.report_dir / PARTIAL
        self.mode = config.getoption("--report")
        self.session = None
        self.tests: dict[str, dict] = {}
        self.collected = {"items": 0, "conformance": 0, "done": 0}
        self.started_at = data.now()
        self._t0 = time.monotonic()
        self.interrupted_by: str | None = None
        self._last_flush = 0.0
        self._last_report = 0.0
        self._flush_every = FLUSH_SECONDS
        self._report_every = REPORT_SECONDS
        self._final: dict | None = None
        self._baselines: list[dict] = []
        self._baseline_paths: list[str] = []
        self.selection = [s for s in (config.getoption("--invariant") or []) if s]

    # ---- set-up -------------------------------------------------------------

    def pytest_configure(self, config) -> None:
        self.selected = []
        if self.selection:  # the catalog imports torch and FSDP: only a run that names invariants pays for it here
            from conformance import areas as invariants

            try:
                self.selected = [i.id for i in invariants.select(self.selection)]
            except invariants.UnknownInvariant as e:
                raise pytest.UsageError(str(e)) from None
        n = config.getoption("--max-examples")
        if n is not None:
            from hypothesis import settings

            if n < 1:
                raise pytest.UsageError(f"--max-examples must be >= 1, got {n}")
            name = settings._current_profile
            settings.register_profile(f"{name}-max{n}", parent=settings.get_profile(name), max_examples=n)
            settings.load_profile(f"{name}-max{n}")
        if not self.is_worker and self.mode != "never":
            self._load_baselines()
        # a run that does not ask for conformance (a project that merely has
        # the package installed) keeps its own files and signal handling
        if not getattr(config, "_fsdp_conformance_requested", True):
            return
        if not self.is_worker and self.mode != "never":
            shutil.rmtree(self.partial_dir, ignore_errors=True)
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def pytest_sessionstart(self, session) -> None:
        self._pytest_session = session

    def _on_sigterm(self, signum, frame) -> None:
        self.interrupted_by = "SIGTERM"
        # pytest stops after this test even if the KeyboardInterrupt below is
        # swallowed on its way up (e.g. turned into an error by code it passes)
        sess = getattr(self, "_pytest_session", None)
        if sess is not None:
            sess.shouldstop = "interrupted by SIGTERM"
        if self.session is not None:
            # the next example raises it again: a KeyboardInterrupt raised
            # where Python swallows it (a gc callback, a __del__) would
            # otherwise leave the test's remaining examples running
            # (ci/test.sh, test_sigterm_...: the run went on for minutes)
            self.session.interrupted = "SIGTERM"
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends it at once
        raise KeyboardInterrupt("SIGTERM")

    def _load_baselines(self) -> None:
        """The baselines named on the command line, now (a bad one is a usage
        error); 'auto' ones when the report is built (they need torch)."""
        opts = self.config.getoption("--baseline") or ["auto"]
        if "none" in opts:
            return
        for o in opts:
            if o != "auto":
                self._add_baseline(Path(o))

    def _add_baseline(self, p: Path) -> None:
        try:
            self._baselines.append(data.load(p, "baseline"))
        except data.ReportError as e:
            raise pytest.UsageError(str(e)) from None
        self._baseline_paths.append(paths.shown(p))

    def _load_auto_baselines(self) -> None:
        opts = self.config.getoption("--baseline") or ["auto"]
        if "auto" not in opts or "none" in opts or getattr(self, "_auto_loaded", False):
            return
        self._auto_loaded = True
        for p in auto_baselines(tier_info(self.config)):
            if p.exists():
                try:
                    self._add_baseline(p)
                except pytest.UsageError as e:  # a shipped baseline that does not load: say so, go on
                    print(f"fsdp-conformance: {e}", file=sys.stderr)

    # ---- the session (the `conformance` fixture) ------------------------------

    def get_session(self):
        if self.session is None:
            from conformance.run.session import Session

            self.session = Session(repro_dir=self.report_dir / "repros")
            self.session.on_change = self._changed
            self.session.selected = set(self.selected) if self.selection else None
        return self.session

    def _changed(self) -> None:
        if time.monotonic() - self._last_flush >= self._flush_every:
            self.flush_partial()
            if not self.uses_xdist and not self.is_worker:
                self.maybe_write_running()

    def flush_partial(self) -> None:
        if self.mode == "never":
            return
        t0 = time.monotonic()
        part = {"worker": self.worker or "main", "pid": os.getpid(), "collected": self.collected, "tallies": []}
        if self.session is not None:
            part.update(self.session.to_dict())
        try:
            data.write_json(self.partial_dir / f"{self.worker or 'main'}.json", part, indent=None)  # read by the run only
        except OSError:
            pass
        self._last_flush = time.monotonic()
        self._flush_every = max(FLUSH_SECONDS, (self._last_flush - t0) / PROGRESS_SHARE)

    # ---- collection and items -----------------------------------------------

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, session, config, items) -> None:
        if self.selected:
            keep, drop = [], []
            for it in items:
                invs, _ = item_invariants(it)
                (keep if set(invs) & set(self.selected) else drop).append(it)
            if drop:
                config.hook.pytest_deselected(items=drop)
                items[:] = keep
        self.collected["items"] = len(items)
        self.collected["conformance"] = sum("conformance" in getattr(it, "fixturenames", ()) for it in items)
        if self.collected["conformance"]:
            self.flush_partial()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        rep = yield
        invs, tier = item_invariants(item)
        if invs:
            rep.user_properties.append(("fsdp_invariants", invs))
            if tier:
                rep.user_properties.append(("fsdp_tier", tier))
            if rep.skipped and item.get_closest_marker("needs_ranks") and "empty parameter set" in str(rep.longrepr):
                rep.user_properties.append(("fsdp_skip_reason", NEEDS_RANKS_REASON))
        if rep.failed and "EXPECTTEST_ACCEPT" in (rep.longreprtext or ""):
            # a selector that works from where pytest was started
            path = os.path.relpath(str(item.path), str(item.config.invocation_params.dir))
            rep.user_properties.append(("fsdp_snapshot", "::".join([path, *item.nodeid.split("::")[1:]])))
        if rep.when == "teardown" and self.session is not None:
            self.flush_partial()
        return rep

    def pytest_runtest_logreport(self, report) -> None:
        if self.is_worker:
            return
        props = dict(report.user_properties)
        rec = self.tests.get(report.nodeid)
        if rec is None:
            rec = self.tests[report.nodeid] = {
                "nodeid": report.nodeid,
                "outcome": "passed",
                "invariants": list(props.get("fsdp_invariants") or []),
                "tier": props.get("fsdp_tier"),
                "message": None,
                "snapshot": False,
                "seconds": 0.0,
            }
        rec["seconds"] = round(rec["seconds"] + getattr(report, "duration", 0.0), 3)
        if report.failed:
            rec["outcome"] = "failed"
            rec["message"] = _failure_line(report)
            rec["snapshot"] = rec["snapshot"] or props.get("fsdp_snapshot") or False
        elif report.skipped and rec["outcome"] != "failed":
            rec["outcome"] = "skipped"
            rec["message"] = props.get("fsdp_skip_reason") or _skip_reason(report)
        if report.when == "teardown":
            self.collected["done"] += 1
            self.maybe_write_running()

    # ---- the report ---------------------------------------------------------------

    def pytest_runtest_setup(self, item) -> None:
        # hunting: once the time is up, the remaining tests of this round do
        # not start (each process runs one, however slow its start)
        stop = self.config.getoption("--stop-at", None)
        if stop and time.time() >= stop and self._ran_one and item_invariants(item)[0]:
            pytest.skip("hunt: time is up")

    _ran_one = False

    def pytest_runtest_teardown(self, item) -> None:
        if item_invariants(item)[0]:
            self._ran_one = True

    def prior_partials(self) -> list[dict]:
        """Earlier rounds' partials (hunting: one report over every round)."""
        out = []
        for path in self.config.getoption("--prior-partials", None) or []:
            try:
                out += json.loads(Path(path).read_text())
            except (OSError, ValueError):
                continue
        return out

    def partials(self) -> list[dict]:
        return self.own_partials() + (self.prior_partials() if not self.is_worker else [])

    def own_partials(self) -> list[dict]:
        out = []
        if self.session is not None:
            out.append({"worker": "main", "collected": self.collected, **self.session.to_dict()})
        if self.partial_dir.is_dir():
            for p in sorted(self.partial_dir.glob("*.json")):
                if p.stem == "main" and self.session is not None:
                    continue  # this process: fresher in memory
                try:
                    out.append(json.loads(p.read_text()))
                except (OSError, ValueError):
                    continue
        return out

    def wants_report(self, partials: list[dict]) -> bool:
        if self.mode == "never":
            return False
        if self.mode == "always":
            return True
        return bool(
            self.collected["conformance"]
            or any(p.get("collected", {}).get("conformance") for p in partials)
            or any(p.get("tallies") for p in partials)
        )

    def build(self, status: str) -> dict | None:
        parts = self.partials()
        if not self.wants_report(parts):
            return None
        self._load_auto_baselines()
        from hypothesis import settings

        prof = settings.default
        run = {
            "tiers": tier_info(self.config),
            "profile": getattr(settings, "_current_profile", None),  # "<name>-max<N>" with --max-examples
            "seed": self.config.getoption("hypothesis_seed", None),
            "derandomize": bool(prof.derandomize),
            "max_examples": prof.max_examples,
            "selection": self.selection,
            "selected": self.selected,
            "workers": getattr(self.config.option, "numprocesses", None) or 0,
            "args": list(self.config.invocation_params.args),
            "items": {"collected": max([self.collected["items"]] + [p.get("collected", {}).get("items", 0) for p in parts]),
                      "done": self.collected["done"]},
        }
        return data.build(
            fsdp_source=fsdp_source.report_info(),
            partials=parts,
            run=run,
            tests=list(self.tests.values()),
            status=status,
            interrupted_by=self.interrupted_by,
            started_at=self.started_at,
            finished_at=data.now() if status != "running" else None,
            baselines=self._baselines,
            baseline_paths=self._baseline_paths,
            wall_seconds=time.monotonic() - self._t0,
        )

    def maybe_write_running(self) -> None:
        if self.is_worker or self.mode == "never" or time.monotonic() - self._last_report < self._report_every:
            return
        t0 = time.monotonic()
        try:
            report = self.build("running")
            if report is not None:
                # compact while running (the finished report is indented): every 2 s of a full run
                data.write_json(self.report_dir / write.FILES["json"], report, indent=None)
        except Exception as e:  # noqa: BLE001 - progress reports must not break the run
            print(f"fsdp-conformance: could not write the running report: {e}", file=sys.stderr)
        self._last_report = time.monotonic()
        self._report_every = max(REPORT_SECONDS, (self._last_report - t0) / PROGRESS_SHARE)

    # first: the report needs no engine, and an engine that fails to close
    # (after SIGTERM killed its ranks) must not cost the report
    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session, exitstatus) -> None:
        if self.is_worker:
            self.flush_partial()
            return
        if self.mode == "never" or self.config.option.collectonly:  # nothing ran: a report would overwrite the last run's
            return
        interrupted = int(exitstatus) == int(pytest.ExitCode.INTERRUPTED)
        if interrupted and self.interrupted_by is None:
            self.interrupted_by = "SIGINT"
        status = "interrupted" if interrupted or self.interrupted_by else "complete"
        if int(exitstatus) in (int(pytest.ExitCode.INTERNAL_ERROR), int(pytest.ExitCode.USAGE_ERROR)):
            status = "error"
        report = self.build(status)
        if report is None:
            return
        report["run"]["pytest_exit_status"] = int(exitstatus)
        save = self.config.getoption("--save-partials", None)
        if save:
            data.write_json(Path(save), self.own_partials())
        write.write_all(report, self.report_dir)
        shutil.rmtree(self.partial_dir, ignore_errors=True)
        self._final = report

    def pytest_terminal_summary(self, terminalreporter) -> None:
        report = self._final
        if report is None or self.is_worker:
            return
        tr = terminalreporter
        tr.section("fsdp-conformance")
        from conformance.report import markdown

        for r in report["results"]:
            if r["verdict"] == "SKIP" and r.get("reason") == "not selected":
                continue
            counts = ", ".join(f"{k} {v}" for k, v in sorted(r["outcomes"].items()))
            tr.write_line(
                f"{row_label(r):<20} {r['api']:<5} {r['tier']:<5} {r['verdict']:<6} {r.get('checked', r['examples']):>5}/{r['examples']:<5} checked"
                f"  {r['seconds']:6.1f}s  ({counts or r.get('reason') or ''})"
            )
        for f in report["findings"]:
            label = f"KNOWN {f['known_failure']} ({f.get('known_class')})" if f.get("known_failure") else f["kind"]
            tr.write_line(f"    {row_label(f)}/{f['tier']} {label}: {f['message'][:200]}")
            if f["kind"] != "KNOWN" and f.get("repro"):
                tr.write_line(f"        repro: {self.report_dir / f['repro']}")
        for w in report["warnings"]:
            tr.write_line(f"warning: {w}", yellow=True)
        if report["snapshots"]["hint"]:
            tr.write_line(report["snapshots"]["hint"], yellow=True)
        tr.write_line(markdown.headline(report), bold=True, red=report["summary"]["failed"])
        tr.write_line(markdown.known_line(report))
        tr.write_line(f"report: {self.report_dir / write.FILES['json']} (+ summary.md, junit.xml, report.html)")


def auto_baselines(tiers: list[dict], torch_version: str | None = None) -> list[Path]:
    """The committed baselines for this torch release and each tier's backend
    and world size: <package>/baselines/torch-<release>-<backend>-w<W>.json
    (reports/baselines in a checkout)."""
    if torch_version is None:
        import torch

        torch_version = torch.__version__
    release = torch_version.split("+")[0]
    return [paths.BASELINES / f"torch-{release}-{t['backend']}-w{t['world_size']}.json" for t in tiers]


def _failure_line(report) -> str:
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    if crash is not None:
        return str(crash.message).splitlines()[0][:500] if crash.message else ""
    text = str(report.longrepr or "").strip().splitlines()
    return text[-1][:500] if text else ""


def _skip_reason(report) -> str:
    lr = report.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:
        reason = str(lr[2])
    else:
        reason = str(lr or "skipped")
    return reason.removeprefix("Skipped: ")[:300]
