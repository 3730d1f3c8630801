"""The suite's own mutation score: `fsdp-conformance selfcheck --mutants`.

Each mutant of conformance/mutants.toml (a realistic regression to FSDP's
Python source) is applied alone to a temporary copy of the installed torch's
FSDP packages, and a conformance run with that copy as its FSDP source
(conformance.selfcheck.fsdp_source) checks the invariants of the mutant's API. A run
that fails kills the mutant; the kill table lists, for each, the invariants
that caught it, and the survivors.

Speed: only the invariants of the mutated API run; a run stops at its first
failing test (pytest -x) and does not shrink (a kill needs one failing
example, not the smallest); the example budget is modest (--examples).

A kill counts only if the unmodified torch passes the failing test with the
same draws (the profiles are derandomized): each killing test is run once on
an unmodified copy (Baseline); where it fails too, the outcome is "invalid",
not a kill.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from conformance import paths
from conformance.report import data
from conformance.report.markdown import table_cell
from conformance.selfcheck import fsdp_source

CATALOG_PATH = Path(__file__).with_name("mutants.toml")
APIS = ("fsdp1", "fsdp2", "forward_method")
DEFAULT_EXAMPLES = 60
DEFAULT_TIMEOUT = 1500.0


class MutantError(Exception):
    """A catalog entry that cannot be applied to this torch (one line)."""


@dataclass(frozen=True)
class Mutant:
    id: str
    api: str
    file: str  # below torch/distributed/
    find: str
    replace: str
    description: str
    count: int = 1
    equivalent: str | None = None
    first: tuple[str, ...] = ()  # areas whose conformance tests run before the rest (where the mutated code is used)

    @property
    def path(self) -> str:
        # below torch/distributed/, or a path from torch/ on (a module
        # fsdp_source.MODULES overlays: torch/nn/utils/clip_grad.py)
        return self.file if self.file.startswith("torch/") else f"torch/distributed/{self.file}"


@dataclass
class Outcome:
    mutant: Mutant
    status: str  # killed | survived | error | timeout | invalid (a kill the unmodified torch fails too)
    killed_by: list[str] = field(default_factory=list)  # "INVARIANT (api, tier)"
    detail: str = ""
    seconds: float = 0.0
    examples: int = 0
    run: str = ""  # the saved run (--render) this outcome comes from
    tests: list[str] = field(default_factory=list)  # a kill's failing tests (paths below the suite), for the baseline check

    def to_dict(self) -> dict:
        return {"id": self.mutant.id, "api": self.mutant.api, "file": self.mutant.path, "status": self.status,
                "killed_by": self.killed_by, "detail": self.detail, "seconds": round(self.seconds, 1),
                "examples": self.examples, "equivalent": self.mutant.equivalent, "description": self.mutant.description,
                "tests": self.tests}


def load(path: Path = CATALOG_PATH) -> list[Mutant]:
    try:
        entries = tomllib.loads(Path(path).read_text()).get("mutant", [])
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise MutantError(f"cannot read the mutant catalog {path}: {e}") from None
    out, seen = [], set()
    for i, e in enumerate(entries):
        missing = [k for k in ("id", "api", "file", "find", "replace", "description") if not isinstance(e.get(k), str)]
        if missing:
            raise MutantError(f"{path}: mutant #{i + 1} ({e.get('id', '?')}) lacks {', '.join(missing)}")
        if e["api"] not in APIS:
            raise MutantError(f"{path}: mutant {e['id']}: api {e['api']!r} is not one of {', '.join(APIS)}")
        if e["id"] in seen:
            raise MutantError(f"{path}: duplicate mutant id {e['id']}")
        if e["find"] == e["replace"]:
            raise MutantError(f"{path}: mutant {e['id']}: find and replace are the same text")
        first = e.get("first", [])
        if not isinstance(first, list) or not all(isinstance(a, str) for a in first):
            raise MutantError(f"{path}: mutant {e['id']}: first must be a list of area names")
        unknown = [a for a in first if not (paths.SUITE / f"test_{a}.py").is_file()]
        if unknown:
            raise MutantError(f"{path}: mutant {e['id']}: first names {unknown[0]!r}, which has no conformance tests (conformance/suite/test_{unknown[0]}.py)")
        seen.add(e["id"])
        out.append(Mutant(e["id"], e["api"], e["file"], e["find"], e["replace"], e["description"],
                          int(e.get("count", 1)), e.get("equivalent"), tuple(first)))
    return out


def select(mutants: list[Mutant], ids: list[str] | None) -> list[Mutant]:
    if not ids:
        return mutants
    by_id = {m.id: m for m in mutants}
    unknown = [i for i in ids if i not in by_id]
    if unknown:
        raise MutantError(f"unknown mutant {unknown[0]!r} (known: {', '.join(by_id)})")
    return [by_id[i] for i in ids]


def mutated_text(m: Mutant, source: str) -> str:
    """``source`` with the mutant applied; MutantError (naming the mutant and
    file) when its find text does not occur exactly ``count`` times."""
    n = source.count(m.find)
    if n != m.count:
        raise MutantError(
            f"mutant {m.id}: its find text occurs {n} times in {m.path} of this torch (expected {m.count}); "
            "the catalog entry does not apply"
        )
    out = source.replace(m.find, m.replace)
    try:
        ast.parse(out, filename=m.path)
    except SyntaxError as e:
        raise MutantError(f"mutant {m.id}: the mutated {m.path} does not parse (line {e.lineno}: {e.msg})") from None
    return out


def installed_root() -> Path:
    root = fsdp_source.installed_root()
    if root is None or not (root / "torch" / "distributed" / "fsdp" / "__init__.py").is_file():
        raise MutantError("no installed torch with torch/distributed/fsdp/ in this Python")
    return root


def check_all(mutants: list[Mutant]) -> None:
    """Every mutant applies to the installed torch (no copy made)."""
    root = installed_root()
    for m in mutants:
        src = root / m.path
        if not src.is_file():
            raise MutantError(f"mutant {m.id}: {m.path} does not exist in the installed torch")
        mutated_text(m, src.read_text())


def make_source(m: Mutant | None, dest: Path) -> Path:
    """A copy of the installed FSDP packages under ``dest`` with ``m`` applied
    (None: unmodified, for the baseline check)."""
    fsdp_source.copy_tree(installed_root(), dest)
    if m is not None:
        target = dest / m.path
        target.write_text(mutated_text(m, target.read_text()))
    return dest


def invariants_for(api: str) -> list[str]:
    """The invariants whose API the mutant changes: every invariant of FSDP1
    or FSDP2; for register_fsdp_forward_method, the forward-method area."""
    # torch and the areas: only where a mutant run needs them (the CLI reads this module's defaults without them)
    from conformance.areas import CATALOG

    if api == "forward_method":
        return [i.id for i in CATALOG.values() if i.group == "forward_methods" and "fsdp2" in i.apis]
    return [i.id for i in CATALOG.values() if api in i.api.split("|")]


def run_one(m: Mutant, *, profile: str, examples: int | None, tiers: str, work: Path, timeout: float,
            python: str = sys.executable, stop_first: bool = True, skip: tuple[str, ...] = ()) -> Outcome:
    """Apply ``m`` to a fresh copy and run the conformance tests of its API
    against it; the report says which invariants failed."""
    t0 = time.monotonic()
    mdir = work / m.id
    shutil.rmtree(mdir, ignore_errors=True)
    try:
        src = make_source(m, mdir / "src")
    except MutantError as e:
        return Outcome(m, "error", detail=str(e), seconds=time.monotonic() - t0)
    try:
        rc = _run_tests(m.api, m.path, src, mdir, [str(paths.SUITE)], profile=profile, examples=examples, tiers=tiers,
                        timeout=timeout, python=python, stop_first=stop_first, skip=skip, first=m.first)
    except subprocess.TimeoutExpired:
        return Outcome(m, "timeout", detail=f"no verdict in {timeout:g}s (log: {mdir / 'run.log'})", seconds=time.monotonic() - t0)
    return _outcome(m, rc, mdir / "report", mdir / "run.log", time.monotonic() - t0)


def _run_tests(api: str, file: str, src: Path, rundir: Path, tests: list[str], *, profile: str, examples: int | None,
               tiers: str, timeout: float, python: str, stop_first: bool, skip: tuple[str, ...], first: tuple[str, ...] = ()) -> int:
    """pytest on ``tests`` with FSDP imported from ``src`` and the invariants
    of ``api``; its report in rundir/report, its log in rundir/run.log. The
    exit status; TimeoutExpired after ``timeout`` seconds (the run stopped)."""
    # pytest as `fsdp-conformance run` calls it, started directly (one torch
    # import less per mutant); the overlay goes in through the environment,
    # not --fsdp-source: the source is the installed one but for a
    # find/replace already parsed, so the import check is skipped too.
    suite = str(paths.SUITE)
    cmd = [python, "-m", "pytest", *tests, f"--rootdir={suite}", "-c", os.devnull, f"--confcutdir={suite}", "-p", "no:cacheprovider",
           f"--conformance-profile={profile}", f"--tiers={tiers}", "--baseline=none", f"--report-dir={rundir / 'report'}",
           "--report=always", "-q", "-rfE", "--disable-warnings", "-p", "no:xdist", "-p", "conformance.selfcheck.mutant_plugin"]
    if examples is not None:
        cmd.append(f"--max-examples={examples}")
    # --skip-invariant: invariants that fail on the unmodified torch with these
    # draws; a failure there would be counted as a kill of any mutant
    cmd += [f"--invariant={inv}" for inv in invariants_for(api) if inv not in skip]
    if stop_first:
        cmd.append("-x")
    env = {**os.environ, "FSDP_CONFORMANCE_SHRINK": "0", "FSDP_CONFORMANCE_DATABASE": "none", fsdp_source.ENV_VAR: str(src),
           "FSDP_CONFORMANCE_MUTANT_API": api, "FSDP_CONFORMANCE_MUTANT_FILE": file, "FSDP_CONFORMANCE_MUTANT_FIRST": ",".join(first)}
    rundir.mkdir(parents=True, exist_ok=True)
    if STOPPING.is_set():  # the selfcheck was interrupted: no run starts after that
        raise KeyboardInterrupt
    with open(rundir / "run.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=rundir, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        with _LIVE_LOCK:
            LIVE.add(proc)
        try:
            return proc.wait(timeout=timeout)
        except BaseException:
            _stop(proc)
            raise
        finally:
            with _LIVE_LOCK:
                LIVE.discard(proc)


# The mutant runs under way (each in its own session, so a signal to the
# selfcheck does not reach them): stop_all() ends them when the selfcheck is
# interrupted, or they would outlive it with their rank processes.
LIVE: set[subprocess.Popen] = set()
_LIVE_LOCK = threading.Lock()
STOPPING = threading.Event()


def stop_all() -> None:
    STOPPING.set()
    with _LIVE_LOCK:
        procs = list(LIVE)
    for proc in procs:
        _stop(proc)


class Baseline:
    """The unmodified torch on a kill's failing tests: the same command, the
    same (derandomized) draws, an unmodified copy of FSDP as the source. A
    test that fails there too says nothing about the mutant (a suite bug or
    an unrecorded finding with these draws): the kill is not counted."""

    def __init__(self, work: Path, **run_args) -> None:
        self.dir = work / "_unmodified"
        self.run_args = run_args
        self.results: dict[tuple[str, str], str | None] = {}  # (api, test) -> why it fails, None: passes
        self._lock = threading.Lock()
        self._src: Path | None = None

    def failure(self, api: str, test: str) -> str | None:
        """Why ``test`` (a path below the suite; "": every test of ``api``, up to
        the first failure) fails on the unmodified torch, None if it passes."""
        with self._lock:  # one baseline run at a time; each test once per API
            if (api, test) not in self.results:
                self.results[api, test] = self._run(api, test)
            return self.results[api, test]

    def _run(self, api: str, test: str) -> str | None:
        if self._src is None:
            self._src = make_source(None, self.dir / "src")
        rundir = self.dir / f"run{len(self.results)}"
        try:
            rc = _run_tests(api, "", self._src, rundir, [str(paths.SUITE / test) if test else str(paths.SUITE)],
                            stop_first=not test, **self.run_args)
        except subprocess.TimeoutExpired:
            return f"no verdict in {self.run_args['timeout']:g}s"
        if rc == 0:
            return None
        if rc < 0:
            return f"crashed ({signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else -rc})"
        return _tail(rundir / "run.log") or f"exit {rc}"


def confirm_kill(o: Outcome, baseline: Baseline) -> Outcome:
    """``o`` as it counts: a kill whose failing test also fails on the
    unmodified torch is "invalid" (not measured), whatever the mutant did."""
    if o.status != "killed":
        return o
    for test in o.tests or [""]:  # no failing test named (a crash without a stack): the whole run
        why = baseline.failure(o.mutant.api, test)
        if why is not None:
            return Outcome(o.mutant, "invalid", o.killed_by,
                           f"not a kill: {test or 'the run'} fails on the unmodified torch {_torch_version()} too ({why}); "
                           "leave its invariant out (--skip-invariant) or fix the suite", o.seconds, o.examples, tests=o.tests)
    return o


def _torch_version() -> str:
    import torch

    return torch.__version__


def _stop(proc: subprocess.Popen) -> None:
    """The run and its rank processes (its own session): SIGTERM lets the CLI
    close its pools; SIGKILL what is left."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()


def _outcome(m: Mutant, rc: int, report_dir: Path, log_path: Path, seconds: float) -> Outcome:

    if rc < 0:
        # The mutant crashed the run (e.g. FSDP1 reading a freed flat
        # parameter in the driver's fake tier): a CI run would be red too.
        sig = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
        crashed = _crashed_test(log_path)
        return Outcome(m, "killed", [f"crash ({sig}) in {crashed}"], _tail(log_path), seconds, tests=[] if crashed == "?" else [crashed])

    try:
        report = data.load(report_dir / "report.json")
    except data.ReportError:
        tail = _tail(log_path)
        return Outcome(m, "error", detail=f"exit {rc}, no report: {tail}", seconds=seconds)
    examples = report["summary"]["examples"]
    src = (report.get("fsdp_source") or {}).get("path")
    if src is None or not Path(src).is_relative_to(log_path.parent):
        return Outcome(m, "error", detail=f"the run did not import FSDP from the mutated copy (report: {src})", seconds=seconds)
    killers = [f"{r['invariant']} ({r['api']}, {r['tier']})" for r in report["results"] if r["verdict"] == "FAIL"]
    failed = report.get("tests", {}).get("failed", [])
    tests = [t["nodeid"] for t in failed]
    if killers:
        msgs = [f"{f['invariant']}: {_first(f['message'])}" for f in report.get("findings", []) if f["kind"] != "KNOWN"]
        return Outcome(m, "killed", killers, msgs[0] if msgs else "", seconds, examples, tests=tests)
    if failed or rc == 1:
        what = failed[0]["nodeid"] if failed else "the run"
        return Outcome(m, "killed", [f"test {what}"], _first((failed[0].get("message") if failed else "") or ""), seconds, examples, tests=tests)
    if rc != 0:
        return Outcome(m, "error", detail=f"exit {rc}: {_tail(log_path)}", seconds=seconds, examples=examples)
    return Outcome(m, "survived", seconds=seconds, examples=examples)


def _crashed_test(log_path: Path) -> str:
    """The conformance test a faulthandler stack in the log was in."""

    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return "?"
    hits = re.findall(r'suite/(test_\w+\.py)", line \d+ in (\w+)', text)
    return f"{hits[0][0]}::{hits[0][1]}" if hits else "?"


def _first(text: str, width: int = 160) -> str:
    line = next((ln.strip() for ln in (text or "").splitlines() if ln.strip()), "")
    return line if len(line) <= width else line[: width - 3] + "..."


def _tail(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:200] if lines else ""


# ---- the kill table ------------------------------------------------------------------


# Outcomes that say nothing about the mutant: no run reached it, or the run
# failed where the unmodified torch fails too (a baseline failure, not a kill).
UNMEASURED = ("not run", "invalid")


def score(outcomes: list[Outcome]) -> tuple[int, int]:
    """(killed, non-equivalent mutants measured)."""
    counted = [o for o in outcomes if not o.mutant.equivalent and o.status not in UNMEASURED]
    return sum(o.status == "killed" for o in counted), len(counted)


def render_text(outcomes: list[Outcome]) -> str:
    lines = [f"{'mutant':<44} {'api':<15} {'status':<9} {'time':>6}  killed by"]
    for o in outcomes:
        why = ", ".join(o.killed_by) if o.killed_by else (f"EQUIVALENT: {o.mutant.equivalent}" if o.mutant.equivalent else o.detail)
        lines.append(f"{o.mutant.id:<44} {o.mutant.api:<15} {o.status:<9} {o.seconds:>5.0f}s  {why}")
    k, n = score(outcomes)
    surv = [o.mutant.id for o in outcomes if o.status not in ("killed", *UNMEASURED) and not o.mutant.equivalent]
    not_run = [o.mutant.id for o in outcomes if o.status in UNMEASURED]
    eq_killed = [o.mutant.id for o in outcomes if o.status == "killed" and o.mutant.equivalent]
    lines.append("")
    lines.append(f"mutation score: {k}/{n} non-equivalent mutants killed ({100.0 * k / n if n else 0:.0f}%); "
                 f"{sum(1 for o in outcomes if o.mutant.equivalent)} equivalent")
    if surv:
        lines.append("survivors: " + ", ".join(surv))
    if not_run:
        lines.append("not run: " + ", ".join(not_run))
    if eq_killed:
        lines.append("killed although marked equivalent (the catalog is wrong about them): " + ", ".join(eq_killed))
    return "\n".join(lines) + "\n"


def render_md(outcomes: list[Outcome], meta: dict) -> str:
    k, n = score(outcomes)
    out = [
        "# Mutation score of the conformance suite",
        "",
        f"`{meta['command']}`: each mutant of `conformance/mutants.toml` applied alone to a copy of the installed",
        f"FSDP (torch {meta['torch']}), the invariants of its API run against it (profile `{meta['profile']}`,",
        f"{meta['examples'] if meta['examples'] is not None else 'the profile' + chr(39) + 's'} examples per test, tiers `{meta['tiers']}`, "
        f"first failing test ends a mutant, no shrinking{'; each run below says its own' if meta.get('runs') else ''}).",
        "",
        f"**{k}/{n} non-equivalent mutants killed ({100.0 * k / n if n else 0:.0f}%)**; "
        f"{sum(1 for o in outcomes if o.mutant.equivalent)} equivalent; {sum(o.seconds for o in outcomes) / 60:.0f} min in all"
        f" ({meta['date'] + ', suite ' + str(meta.get('suite')) if not meta.get('runs') else 'runs below'}).",
    ]
    runs = meta.get("runs") or []
    if runs:
        # merged from saved runs: each row names the run its outcome comes from
        out += ["", "Saved runs merged (a mutant's latest outcome counts; the `run` column names it):", ""]
        out += [f"- {r}" for r in runs]
    out += [
        "",
        "| mutant | API | file | status | killed by | time | " + ("run | " if runs else "") + "regression |",
        "| --- | --- | --- | --- | --- | ---: | " + ("--- | " if runs else "") + "--- |",
    ]
    for o in outcomes:
        by = "<br>".join(o.killed_by) or ("equivalent" if o.mutant.equivalent else o.detail)
        out.append(f"| `{o.mutant.id}` | {o.mutant.api} | `{o.mutant.file}` | {o.status.upper() if o.status != 'killed' else 'killed'} "
                   f"| {table_cell(by)} | {o.seconds:.0f}s | " + (f"{o.run} | " if runs else "") + f"{table_cell(o.mutant.description)} |")
    surv = [o for o in outcomes if o.status not in ("killed", *UNMEASURED)]
    not_run = [o.mutant.id for o in outcomes if o.status == "not run"]
    invalid = [o for o in outcomes if o.status == "invalid"]
    if not_run or invalid:
        out[6] += f" {len(not_run) + len(invalid)} not measured (see the end)."
    if surv:
        out += ["", "## Survivors", ""]
        for o in surv:
            why = f"equivalent: {o.mutant.equivalent}" if o.mutant.equivalent else (SURVIVOR_NOTES.get(o.mutant.id) or o.detail or "not caught: no invariant observes this change yet")
            out.append(f"- `{o.mutant.id}` ({o.status}): {table_cell(why)}")
    if not_run or invalid:
        out += ["", "## Not measured", ""]
    if not_run:
        out += ["No run of this table reached them: " + ", ".join(f"`{i}`" for i in not_run)]
    if invalid:
        out += [""] + [f"- `{o.mutant.id}` (run {o.run}): {table_cell(o.detail)}" for o in invalid]
    return "\n".join(out) + "\n"


# Why a survivor survived, as far as we know (the table's reader needs the
# reason, not only the name); filled from the analysis of each survivor.
SURVIVOR_NOTES: dict[str, str] = {
    "clip-grad-slow-path-scales-first-grad-only": "survived 60 examples per test (run23): only foreach=False with a biting max_norm and several trainable gradients shows it, about one clip draw in five, and the derandomized 60 drew none that bit; CLIP-GRADS fails such drawn cases under it (--fsdp-source, the suite's clip strategy: 3 of 10 such draws FAIL, the rest PASS or read KNOWN) and the hand-written case fsdp2-l1-two-step",
    "fsdp2-accumulated-grad-rounded-to-param-dtype": "survived 60 examples per test (run23) and the ci profile's own budget (run28): MP-PIPELINE gave every FSDP2 gradient of a case with a tie, shared module or forward method the reuse slack (4 roundings of the compute dtype, above this rounding), and only 1 in 400 FSDP2 schedule draws had an unsynced bf16/fp32 step without one; killed (run29, 60 examples) once that slack was kept for the reused parameters' gradients",
    "fsdp2-lazy-init-skips-reset-sharded-param": "survived 60 examples per test (run23; the run24 re-run, test_checkpoint first, passed TIES-KEPT's 39 FSDP2 examples before it was stopped): every documented way to replace a parameter between fully_shard and the first forward re-reads it without lazy init (FSDPParam's load_state_dict post-hook; FSDPModule._apply for to / to_empty), so only a direct assignment of a new Parameter to the module (no API documents it) shows the change; the mutant that drops the post-hook instead (fsdp2-load-post-hook-skips-reset-sharded-param) is killed by TIES-KEPT's load into a model that has run",
    "fsdp1-custom-policy-wraps-ignored": "survived 60 examples per test; killed by WRAP-UNITS (fake) with 100 examples per test (run0-part.json): it needs a CustomWrap target inside an ignored module, which the strategies draw rarely",
    "fsdp1-post-order-apply-revisits-shared": "survived 60 examples per test; killed by WRAP-UNITS (gloo) with 100 examples per test (run0-part.json): it needs a shared module under two wrapped parents with an object policy, which the strategies draw rarely",
    "fsdp1-reduced-grad-rounded-to-param-dtype": "survived 60 examples per test (run21, run22); killed by MP-PIPELINE (gloo) at the ci profile's own budget (--fsdp-source, 223 FSDP1 examples: 27 FAIL) and by the hand-written fault fsdp1-reduced-grads-rounded-to-param-dtype (tests/self/test_faults_training.py): it needs an FSDP1 case with a low param_dtype, reduce_dtype float32, a fully synced step and a trainable parameter no tie reuses, about one draw in 25",
    "fsdp1-limit-all-gathers-never-waits": "unobservable without a GPU: the rate limiter only makes the CPU thread wait on the device's free events (on CPU a free is done when the thread moves on), so every collective, its order and every value stay the same (COMM-FSDP1-PREFETCH and COMM-FSDP1-COUNTS hold on 202 fake examples with it (201 PASS, 1 KNOWN as on the unmodified torch), measured with --fsdp-source); its promise is about GPU memory (at most two units' unsharded parameters at once), a check for the NCCL device tier",
    "fsdp1-sync-module-states-own-buffers-only": "unobservable on CPU: FSDP1's sync_module_states raises for CPU modules before it broadcasts anything (fsdp1-sync-module-states-rejects-cpu), so INIT-SYNC sees that KNOWN raise on every FSDP1 case (measured with --fsdp-source, fake and gloo); it needs ranks on GPUs, like fsdp1-sync-module-states-skips-buffers",
}


# ---- the command ---------------------------------------------------------------------


