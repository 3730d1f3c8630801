"""The commands that run the conformance suite under pytest (run, hunt, change):
the suite's pytest arguments, the child process, its report."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
from pathlib import Path

from conformance import paths
from conformance.cli.common import need_distributed, resolve_tiers, tier_names
from conformance.cli.errors import UsageError
from conformance.report import data
from conformance.run import profiles
from conformance.selfcheck import fsdp_source


def pytest_main(args: list[str], cwd=None) -> int:
    return subprocess.call([sys.executable, "-m", "pytest", *args], cwd=cwd)


def _child_setup() -> None:  # pragma: no cover - runs in the child
    # the CLI forwards SIGINT: let it reach pytest even when the CLI was
    # started with SIGINT ignored (a background job of a shell)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    # die with the CLI: a pytest run left alone would hold rank processes
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _fork_keeps_fsdp() -> bool:
    """Whether a fork of this process imports the FSDP a fresh pytest
    process would: the overlay this process put in effect (if any) is the one
    the environment names. Not so after ``--fsdp-source`` (set after this
    process imported FSDP): then pytest starts afresh."""
    wanted = os.environ.get(fsdp_source.ENV_VAR)
    active = fsdp_source.active_root()
    if not wanted:
        return active is None
    return active is not None and active == Path(wanted).expanduser().resolve()


_REWRITE_WARNING = "Module already imported so cannot be rewritten; "
_ALREADY_IMPORTED = ("hypothesis", "_hypothesis_globals", "conformance", "strategies")


class _ForkedPytest:
    """pytest in a fork of the CLI, as ``python -m pytest ARGS`` in a session
    of its own would run: the CLI has imported torch and the areas to check
    the options, and a fork spares the child importing them again (about 3
    CPU-s of the 9 s a one-example run took). The fork runs only pytest and
    leaves by os._exit: nothing of the CLI's stack, and none of the exit
    handlers the CLI registered, runs in it. ``poll``/``wait``/``pid`` as
    subprocess.Popen's."""

    def __init__(self, args: list[str], log) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self.returncode: int | None = None
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - runs in the child
            os._exit(self._child(args, log))

    @staticmethod
    def _child(args: list[str], log) -> int:  # pragma: no cover - runs in the child
        rc = 3
        try:
            os.setsid()
            _child_setup()
            # a fresh interpreter's SIGINT: KeyboardInterrupt, which pytest
            # turns into an interrupted (and reported) session
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if log is not None:
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                # streams over the new fds 1 and 2 (the CLI's may not write to them)
                sys.stdout = open(1, "w", buffering=1, closefd=False)
                sys.stderr = open(2, "w", buffering=1, closefd=False)
            atexit._clear()  # the CLI's, not pytest's
            # pytest marks its plugins' distributions for assertion rewriting
            # and warns for those this process imported already: Hypothesis
            # (profiles, the corpus) and, installed from a wheel, this
            # package (its checks raise; they do not rely on rewritten asserts)
            args = [a for m in _ALREADY_IMPORTED for a in ("-W", f"ignore:{_REWRITE_WARNING}{m}:pytest.PytestAssertRewriteWarning")] + args
            sys.argv = [sys.executable, "-m", "pytest", *args]
            sys.path.insert(0, os.getcwd())  # what `python -m pytest` puts first
            import pytest

            rc = int(pytest.main(args))
            atexit._run_exitfuncs()  # pytest's and its plugins' (rank pools close at exit)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            except Exception:
                pass
        return rc

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def conformance_args(ns, profile: str, default_report_dir: Path) -> tuple[list[str], Path]:
    """Validate the options `run` and `hunt` share; the pytest arguments of
    the conformance tests and the report directory."""
    # Options first, torch-free (a typo costs a fraction of a second, not
    # torch's import); then what needs torch: the invariant registry (the
    # areas) and torch.distributed.
    if ns.world_size < 1:
        raise UsageError(f"--world-size must be >= 1, got {ns.world_size}")
    if ns.fake_world_size < 1:
        raise UsageError(f"--fake-world-size must be >= 1, got {ns.fake_world_size}")
    if ns.examples is not None and ns.examples < 1:
        raise UsageError(f"--examples must be >= 1, got {ns.examples}")
    if ns.workers < 0:
        raise UsageError(f"--workers must be >= 0, got {ns.workers}")
    tier_names(ns)
    for b in ns.baseline or []:
        if b not in ("auto", "none"):
            try:
                data.load(b, "baseline")
            except data.ReportError as e:
                raise UsageError(str(e)) from None
    if ns.database:
        try:
            profiles.database_from(ns.database)
        except profiles.DatabaseError as e:
            raise UsageError(str(e)) from None
        os.environ[profiles.DATABASE_VAR] = ns.database  # the pytest child and its xdist workers inherit it
    if getattr(ns, "replay", False):
        if not ns.database:
            raise UsageError("--replay needs --database (the examples to replay)")
        os.environ[profiles.REPLAY_VAR] = "1"
    need_distributed()
    from conformance import areas as invariants

    try:
        invariants.select(ns.invariant)
    except invariants.UnknownInvariant as e:
        raise UsageError(str(e)) from None
    tiers = resolve_tiers(ns)
    tests = paths.SUITE
    if not tests.is_dir():
        raise UsageError(f"{tests} not found: this installation of fsdp-conformance lacks its conformance suite")
    report_dir = Path(ns.report_dir or default_report_dir).resolve()
    try:
        report_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create report directory {report_dir}: {e.strerror}") from None

    args = [
        # the installed suite alone, from any directory: no project's config
        # or conftest applies (a venv inside a project would find its pyproject)
        str(tests), f"--rootdir={tests}", "-c", os.devnull, f"--confcutdir={tests}", "-p", "no:cacheprovider",
        f"--conformance-profile={profile}", f"--tiers={','.join(tiers)}", f"--world-size={ns.world_size}",
        f"--fake-world-size={ns.fake_world_size}", f"--report-dir={report_dir}", "--report=always", "-q", "-rfE",
        "--disable-warnings",
        f"--example-deadline={ns.deadline}",
    ]
    args += [f"--invariant={i}" for i in ns.invariant or []]
    args += [f"--baseline={b}" for b in ns.baseline or []]
    if ns.examples is not None:
        args.append(f"--max-examples={ns.examples}")
    if ns.workers:
        # worksteal: an idle worker takes tests from a busy one (the areas'
        # tests differ in length by 10x; plain load leaves a worker idle);
        # slowest first: no long test left to the end (conformance.plugin.order)
        args += ["-n", str(ns.workers), "--dist", "worksteal", "--slowest-first"]
    else:
        args += ["-p", "no:xdist"]
    args += ns.pytest_args or []
    return args, report_dir


def target_args(targets: list[str] | None) -> list[str]:
    """pytest arguments for ``run --target``: each target checked up front
    (bad input: one line, exit 2, before pytest starts), importable from
    the current directory as `fsdp-conformance model` finds it."""
    # torch and the areas: imported by the commands that need them (the CLI parses, and rejects bad input, without)
    from conformance.case.target import TargetError, check_target
    if not targets:
        return []

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)  # the pytest child's
    for t in targets:
        try:
            check_target(t)
        except TargetError as e:
            raise UsageError(str(e)) from None
    return [f"--target={t}" for t in targets]


def use_fsdp_source(path: str | None) -> dict | None:
    """Check an FSDP source tree (layout, parse, import against this torch)
    and put it in the environment the run's processes inherit; "installed"
    or None: the installed torch's FSDP (an inherited overlay stays)."""

    if path is None:
        return None
    if path == "installed":
        os.environ.pop(fsdp_source.ENV_VAR, None)
        return None
    try:
        info = fsdp_source.validate(path)
    except fsdp_source.SourceError as e:
        raise UsageError(str(e)) from None
    os.environ[fsdp_source.ENV_VAR] = info["path"]
    return info


def run_pytest(args: list[str], report_dir: Path, live: bool, quiet: bool = False) -> int:

    cmd = [sys.executable, "-m", "pytest", *args]
    log = None
    if live or quiet:  # quiet: pytest's output to the log only (hunt rounds)
        log = open(report_dir / "pytest.log", "a" if quiet else "w")
    got: list[int] = []

    def forward(signum, frame):
        got.append(signum)
        try:
            os.killpg(proc.pid, signum)  # pytest and its xdist workers
        except OSError:
            pass

    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    if _fork_keeps_fsdp():
        proc = _ForkedPytest(args, log)
    else:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT if log else None,
                                start_new_session=True, preexec_fn=_child_setup)
    for s in old:
        signal.signal(s, forward)
    try:
        if live:
            from rich.console import Console

            from conformance.report import progress

            console = Console()
            try:
                progress.follow(report_dir, proc, console)
            except KeyboardInterrupt:
                forward(signal.SIGINT, None)
            rc = proc.wait()
        else:
            rc = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if log:
            log.close()
    report = None
    try:
        report = data.load(report_dir / "report.json")
    except data.ReportError:
        pass
    if live and report is not None:
        from rich.console import Console

        from conformance.report import progress

        progress.final_table(report, Console())
        print(f"report: {report_dir / 'report.json'} (+ summary.md, junit.xml, report.html); pytest output: {report_dir / 'pytest.log'}")
    if got:
        print(f"fsdp-conformance: interrupted ({signal.Signals(got[0]).name}); report marked incomplete", file=sys.stderr)
        return 128 + got[0]
    if rc in (0, 1):
        if report is None:
            print(f"fsdp-conformance: error: the run wrote no report in {report_dir}", file=sys.stderr)
            return 2
        hint = report.get("snapshots", {}).get("hint")
        if hint and live:
            print(hint, file=sys.stderr)
        return 1 if report["summary"]["failed"] or rc == 1 else 0
    if rc < 0:
        print(f"fsdp-conformance: error: pytest was killed by signal {-rc}", file=sys.stderr)
        return 2
    what = {2: "interrupted", 3: "internal error", 4: "usage error", 5: "no tests collected"}.get(rc, f"exit status {rc}")
    print(f"fsdp-conformance: error: pytest ended with {what}" + (f" (see {report_dir / 'pytest.log'})" if live else ""), file=sys.stderr)
    return 2
