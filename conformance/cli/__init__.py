"""fsdp-conformance: run | hunt | model | compare | check | repro | bench | selfcheck.

Exit status: 0 when every invariant holds (KNOWN and FIXED included), 1 on a
violation (or a regression, for compare), 2 on bad input or an environment
that cannot run what was asked; 130 / 143 when a run is interrupted by
SIGINT / SIGTERM (its report is written, marked incomplete)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

BACKENDS = ("fake", "gloo", "nccl", "auto")


class UsageError(Exception):
    """Bad input: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def _pytest(args: list[str], cwd=None) -> int:
    return subprocess.call([sys.executable, "-m", "pytest", *args], cwd=cwd)


def _need_distributed() -> None:
    try:
        import torch
    except ImportError:
        raise UsageError("torch is not installed in this Python") from None
    try:
        import torch.distributed as dist

        ok = dist.is_available()
    except ImportError:
        ok = False
    if not ok:
        raise UsageError(f"this torch build ({torch.__version__}) has no torch.distributed; FSDP needs it")


def _tiers(ns) -> list[str]:
    """--backend picks one tier (auto: nccl with a GPU per rank, else gloo);
    --tiers lists them; neither: fake,gloo."""
    from conformance.engine.errors import EngineError
    from conformance.engine.pool import resolve_backend

    if ns.backend and ns.tiers:
        raise UsageError("give --backend or --tiers, not both")
    tiers = [t for t in (ns.tiers or ns.backend or "fake,gloo").split(",") if t]
    bad = [t for t in tiers if t not in BACKENDS]
    if bad:
        raise UsageError(f"unknown backend {bad[0]!r}; choose from {', '.join(BACKENDS)}")
    out = []
    for t in tiers:
        try:
            t = resolve_backend(t, ns.world_size) if t != "fake" else t
        except EngineError as e:
            raise UsageError(str(e)) from None
        if t not in out:
            out.append(t)
    return out


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


def cmd_run(ns) -> int:
    from conformance import paths
    from conformance.run import profiles

    # first: a source that cannot be used is bad input, whatever else is asked
    _use_fsdp_source(getattr(ns, "fsdp_source", None))

    try:
        profile = profiles.selected(ns.profile)
    except ValueError as e:
        raise UsageError(str(e)) from None
    args, report_dir = _conformance_args(ns, profile, paths.default_report_dir())
    args += _target_args(ns.target)
    if ns.seed is not None:
        args.append(f"--hypothesis-seed={ns.seed}")
    live = ns.progress == "live" or (ns.progress == "auto" and sys.stdout.isatty() and not os.environ.get("CI"))
    return _run_pytest(args, report_dir, live)


def _conformance_args(ns, profile: str, default_report_dir: Path) -> tuple[list[str], Path]:
    """Validate the options `run` and `hunt` share; the pytest arguments of
    the conformance tests and the report directory."""
    from conformance import areas as invariants, paths
    from conformance.run import profiles
    from conformance.report import data

    if ns.world_size < 1:
        raise UsageError(f"--world-size must be >= 1, got {ns.world_size}")
    if ns.fake_world_size < 1:
        raise UsageError(f"--fake-world-size must be >= 1, got {ns.fake_world_size}")
    if ns.examples is not None and ns.examples < 1:
        raise UsageError(f"--examples must be >= 1, got {ns.examples}")
    if ns.workers < 0:
        raise UsageError(f"--workers must be >= 0, got {ns.workers}")
    try:
        invariants.select(ns.invariant)
    except invariants.UnknownInvariant as e:
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
    _need_distributed()
    tiers = _tiers(ns)
    for b in ns.baseline or []:
        if b not in ("auto", "none"):
            try:
                data.load(b, "baseline")
            except data.ReportError as e:
                raise UsageError(str(e)) from None
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
        args += ["-n", str(ns.workers)]
    else:
        args += ["-p", "no:xdist"]
    args += ns.pytest_args or []
    return args, report_dir


# --- run --target (issue 8): real models beside the synthetic cases ---
def _target_args(targets: list[str] | None) -> list[str]:
    """pytest arguments for ``run --target``: each target checked up front
    (bad input: one line, exit 2, before pytest starts), importable from
    the current directory as `fsdp-conformance model` finds it."""
    if not targets:
        return []
    from conformance.case.target import TargetError, check_target

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)  # the pytest child's
    for t in targets:
        try:
            check_target(t)
        except TargetError as e:
            raise UsageError(str(e)) from None
    return [f"--target={t}" for t in targets]
# --- end run --target ---


def _use_fsdp_source(path: str | None) -> dict | None:
    """Check an FSDP source tree (layout, parse, import against this torch)
    and put it in the environment the run's processes inherit; "installed"
    or None: the installed torch's FSDP (an inherited overlay stays)."""
    from conformance.selfcheck import fsdp_source

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


def cmd_hunt(ns) -> int:
    """Rounds of fresh random examples until --minutes are up; finds kept in
    the example database and replayed first by the next hunt (or run)."""
    from conformance.run.hunt import hunt

    if not ns.minutes > 0:
        raise UsageError(f"--minutes must be > 0, got {ns.minutes}")
    args, report_dir = _conformance_args(ns, "hunt", Path("reports") / "hunt")

    def run_round(stop_at: float, save: Path, priors: list[Path]) -> int:
        round_args = args + [f"--stop-at={stop_at}", f"--save-partials={save}"]
        round_args += [f"--prior-partials={p}" for p in priors]
        return _run_pytest(round_args, report_dir, live=False, quiet=True)

    print(f"hunt: {ns.minutes:g} min, example database {ns.database}, report {report_dir}")
    return hunt(run_round, minutes=ns.minutes, report_dir=report_dir)


def _run_pytest(args: list[str], report_dir: Path, live: bool, quiet: bool = False) -> int:
    from conformance.report import data

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


def _load_spec(path: str):
    from conformance.case.model_case import case_from_json
    from conformance.case.spec import SpecError

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None
    try:
        return _valid_case(case_from_json(text))
    except SpecError as e:
        raise UsageError(f"{path}: {e}") from None


def _valid_case(case):
    """A ModelCase names its target: that target must import and have every
    name the case uses (TargetError: one line, exit 2)."""
    from conformance.case.model_case import ModelCase

    if isinstance(case, ModelCase):
        from conformance.case.target import TargetError, check_case

        try:
            check_case(case)
        except TargetError as e:
            raise UsageError(str(e)) from None
    return case


def _load_case(path: str, finding_id: str | None):
    """(spec, invariant or None, finding or None) from a CaseSpec JSON, a
    report JSON (with --finding, or its only failing finding), or one finding
    object copied out of a report."""
    from conformance.case.model_case import case_from_json
    from conformance.report import data
    from conformance.case.spec import SpecError

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    finding = None
    if isinstance(obj, dict) and "schema" in obj:
        try:
            report = data.validate(obj, f"report {path}")
            if finding_id:
                finding = data.finding_by_id(report, finding_id)
            else:
                failing = [f for f in report.get("findings", []) if f.get("kind") != "KNOWN"]
                if len(failing) != 1:
                    ids = ", ".join(f["id"] for f in report.get("findings", [])) or "none"
                    raise UsageError(f"{path} has {len(failing)} failing findings: pick one with --finding ID (findings: {ids})")
                finding = failing[0]
        except data.ReportError as e:
            raise UsageError(str(e)) from None
    elif isinstance(obj, dict) and "spec" in obj and "invariant" in obj:
        finding = obj
    if finding is not None:
        try:
            spec = _valid_case(case_from_json(json.dumps(finding["spec"])))
        except (SpecError, KeyError, TypeError) as e:
            raise UsageError(f"{path}: the finding's case is not a valid CaseSpec ({e})") from None
        return spec, finding.get("invariant"), finding
    if finding_id:
        raise UsageError(f"{path} is not a report: --finding needs a report JSON")
    return _load_spec(path), None, None


def cmd_check(ns) -> int:
    """Check one CaseSpec JSON against invariants on the fake tier or the pool."""
    from conformance import areas as invariants

    spec = _load_spec(ns.spec)
    try:
        selected = invariants.select(ns.invariant)
    except invariants.UnknownInvariant as e:
        raise UsageError(str(e)) from None
    _need_distributed()
    from conformance.run.models import NOT_FOR_MODELS

    selected = [i for i in selected if not (hasattr(spec, "target") and i.id in NOT_FOR_MODELS)]
    return _check(spec, [i for i in selected if spec.plan.api in i.api.split("|") and _applicable(i, spec)], ns.backend, ns.world_size)


def _applicable(inv, spec) -> bool:
    """The lifecycle invariants need their part of the case (a checkpoint
    plan, a training schedule); a case without it has nothing for them."""
    if inv.scenario.startswith("ckpt"):
        return getattr(spec, "ckpt", None) is not None
    if inv.scenario == "schedule":
        return getattr(spec, "schedule", None) is not None
    return True


def _check(spec, selected, backend: str, world_size: int) -> int:
    from conformance.run.runner import FAIL, check_case
    from conformance.engine.errors import ExampleFailed

    if getattr(spec, "ckpt", None) is not None or getattr(spec, "schedule", None) is not None:
        if backend == "fake":  # values and world sizes: the suite runs these on real ranks only
            raise UsageError("a checkpoint or training-schedule case needs real ranks: use --backend gloo (or nccl)")
    base = engine = _engine(backend, world_size)
    if getattr(spec, "ckpt", None) is not None:  # a save world and a load world, phase by phase
        from conformance.engine.worlds import Worlds

        engine = Worlds(base)
    try:
        worst = 0
        for inv in selected:
            try:
                res = check_case(inv.id, spec, engine)
            except ExampleFailed as e:
                print(f"{inv.id}: {e.verdict}\n  {e}")
                worst = 1
                continue
            print(res.describe())
            worst = max(worst, 1 if res.verdict == FAIL else 0)
        return worst
    finally:
        engine.close()
        if base is not engine:
            base.close()


def _engine(backend: str, world_size: int):
    from conformance.engine.errors import EngineError

    try:
        if backend == "fake":
            from conformance.engine.fake import FakeEngine

            return FakeEngine(world_size=world_size)
        from conformance.engine.pool import RankPool, resolve_backend

        return RankPool(world_size=world_size, backend=resolve_backend(backend, world_size))
    except EngineError as e:
        raise UsageError(str(e)) from None


def cmd_repro(ns) -> int:
    """Re-run one finding (or every invariant of a case) on the pool and
    write its standalone torch-only repro script."""
    from conformance import areas as invariants
    from conformance.run.repro import repro_script

    spec, inv_id, finding = _load_case(ns.spec, ns.finding)
    if ns.invariant:
        try:
            selected = invariants.select(ns.invariant)
        except invariants.UnknownInvariant as e:
            raise UsageError(str(e)) from None
    elif inv_id:
        try:
            selected = [invariants.get(inv_id)]
        except invariants.UnknownInvariant as e:
            raise UsageError(str(e)) from None
    else:
        selected = [i for i in invariants.select(None) if spec.plan.api in i.api.split("|") and _applicable(i, spec)
                    and not (hasattr(spec, "target") and i.id == "FWD-SUMMON")]
    lines = [v["message"] if isinstance(v, dict) else str(v) for v in (finding or {}).get("violations", [])]
    title = inv_id or Path(ns.spec).stem
    text = repro_script(spec, lines, title=title)
    if ns.output == "-":
        sys.stdout.write(text)
        out = sys.stderr
    else:
        Path(ns.output).write_text(text)
        out = sys.stdout
        print(f"torch-only repro script: {ns.output}", file=out)
    if ns.no_run:
        return 0
    _need_distributed()
    if finding is not None:
        print(f"re-running {finding.get('id', inv_id)} (was {finding.get('kind')}) on {ns.backend}, world size {ns.world_size}", file=out)
    stdout = sys.stdout
    sys.stdout = out
    try:
        return _check(spec, selected, ns.backend, ns.world_size)
    finally:
        sys.stdout = stdout


def cmd_compare(ns) -> int:
    from conformance import paths
    from conformance.report import compare, data

    *bases, new_path = ns.reports
    auto = False
    try:
        new = data.load(new_path, "report")
        if not bases:
            bases = compare.default_baselines(new, paths.BASELINES)
            if not bases:
                tiers = ", ".join(f"{t.get('backend')} W={t.get('world_size')}" for t in new.get("run", {}).get("tiers", []))
                raise UsageError(f"no shipped baseline ({paths.shown(paths.BASELINES)}) for torch <= {new.get('torch', {}).get('version')} and {tiers or 'its tiers'}; name BASE.json")
            auto = True
        base = compare.merged([data.load(b, "baseline") for b in bases])
    except data.ReportError as e:
        raise UsageError(str(e)) from None
    if auto:
        print("baseline: " + ", ".join(paths.shown(b) for b in bases), file=sys.stderr)
    c = compare.compare(base, new)
    text = json.dumps(c.to_dict(), indent=1) + "\n" if ns.format == "json" else compare.render(c, ns.format)
    if ns.output and ns.output != "-":
        data.write_text(Path(ns.output), text)
        print(compare.render(c, "text").rstrip().splitlines()[-1])
    else:
        sys.stdout.write(text)
    return c.exit_status


def cmd_bench(ns) -> int:
    from conformance.run import bench

    apis = [a for a in ns.api.split(",") if a] if ns.api != "all" else list(bench.APIS)
    bad = [a for a in apis if a not in bench.APIS]
    if bad:
        raise UsageError(f"unknown API {bad[0]!r}; choose from {', '.join(bench.APIS)} or all")
    for name in ("examples", "world_size", "fake_world_size"):
        v = getattr(ns, name)
        if v is not None and v < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    _need_distributed()
    from conformance.engine.errors import EngineError
    from conformance.case.target import TargetError

    if ns.target and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a user's target, as `fsdp-conformance model` finds it
    try:
        bench.run(apis, engines=ns.engines, examples=ns.examples, world_size=ns.world_size,
                  fake_world_size=ns.fake_world_size, seed=ns.seed, json_path=ns.json, targets=ns.target or ())
    except TargetError as e:
        raise UsageError(str(e)) from None
    except (EngineError, bench.BenchError) as e:  # e.g. a spawned rank past its deadline on a loaded machine
        print(f"fsdp-conformance: bench could not measure: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_selfcheck(ns) -> int:
    if getattr(ns, "mutants", False):  # issue 10: the suite's mutation score
        from conformance.selfcheck import mutants

        return mutants.run(ns)
    from conformance import paths

    checkout = paths.PACKAGE.parent
    if not (checkout / "tests" / "self").is_dir():
        raise UsageError("the suite's own tests (tests/self) are in a checkout of fsdp-conformance, not in the installed package")
    return _pytest(["tests/self", "-q"], cwd=checkout)


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="fsdp-conformance", formatter_class=argparse.RawDescriptionHelpFormatter, description=__doc__.splitlines()[0], epilog=__doc__.split("\n", 1)[1].strip())
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    r = sub.add_parser("run", help="run the conformance tests (Hypothesis) and write the report")
    r.add_argument("--profile", default=None, help="dev | ci | thorough (default: $FSDP_CONFORMANCE_PROFILE or dev)")
    r.add_argument("--backend", default=None, help="fake | gloo | nccl | auto (auto: nccl with one GPU per rank, else gloo); default: fake and gloo")
    r.add_argument("--tiers", default=None, help="several backends, comma-separated (e.g. fake,gloo)")
    r.add_argument("--world-size", type=int, default=2, help="ranks of the gloo / NCCL pool (default 2)")
    r.add_argument("--fake-world-size", type=int, default=4, help="world size of the fake process group (default 4)")
    r.add_argument("--invariant", action="append", help="invariant ID or area (repeatable); default all")
    r.add_argument("--examples", type=int, default=None, help="Hypothesis examples per test (default: the profile's)")
    r.add_argument("--seed", type=int, default=None, help="Hypothesis seed (the ci profile is derandomized)")
    r.add_argument("-n", "--workers", type=int, default=0, help="pytest-xdist workers (default 0: one process)")
    r.add_argument("--report-dir", default=None, help="where the report goes (default: reports/latest under the current directory)")
    r.add_argument("--baseline", action="append", help="baseline report for FIXED verdicts (repeatable; default auto: the shipped baselines for this torch; 'none')")
    r.add_argument("--deadline", type=float, default=60.0, help="seconds before a pool example is a HANG")
    r.add_argument("--progress", choices=("auto", "live", "quiet"), default="auto", help="live progress (a terminal) or pytest's quiet log (CI, pipes)")
    r.add_argument("--fsdp-source", default=None, metavar="PATH",
                   help="import FSDP (torch/distributed/fsdp/, FSDP1 and FSDP2) from this source tree over the installed torch")
    r.add_argument("--database", default=None, help="keep and replay examples in this Hypothesis example database (a directory, github:OWNER/REPO, redis://HOST:PORT)")
    r.add_argument("--replay", action="store_true", help="draw nothing: only the regression corpus and the database's examples")
    r.add_argument("--target", action="append", default=None, metavar="TARGET",
                   help="also check a real model ('package.module:attr', repeatable): its rows stand beside the synthetic ones")
    r.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    r.set_defaults(fn=cmd_run)
    h = sub.add_parser("hunt", help="keep drawing fresh examples until the time is up; keep the finds in an example database")
    h.add_argument("--minutes", type=float, required=True, help="how long to hunt")
    h.add_argument("--database", default=".fsdp-conformance-db", help="example database: a directory (default .fsdp-conformance-db), github:OWNER/REPO (read the CI artifact), redis://HOST:PORT (a fleet)")
    h.add_argument("--examples", type=int, default=None, help="examples per test and round (default 50; the pool-backed tests a fifth of it)")
    h.add_argument("--backend", default=None, help="fake | gloo | nccl | auto; default: fake and gloo")
    h.add_argument("--tiers", default=None, help="several backends, comma-separated (e.g. fake,gloo)")
    h.add_argument("--world-size", type=int, default=2, help="ranks of the gloo / NCCL pool (default 2)")
    h.add_argument("--fake-world-size", type=int, default=4, help="world size of the fake process group (default 4)")
    h.add_argument("--invariant", action="append", help="invariant ID or area (repeatable); default all")
    h.add_argument("-n", "--workers", type=int, default=0, help="pytest-xdist workers (default 0: one process)")
    h.add_argument("--report-dir", default=None, help="where the report goes (default: reports/hunt under the current directory)")
    h.add_argument("--baseline", action="append", help="baseline report (default auto; 'none')")
    h.add_argument("--deadline", type=float, default=60.0, help="seconds before a pool example is a HANG")
    h.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    h.set_defaults(fn=cmd_hunt)
    cp = sub.add_parser("compare", help="compare a report with a baseline: regressions, fixes, new / removed invariants")
    cp.add_argument("reports", nargs="+", metavar="BASE.json ... NEW.json",
                    help="baseline(s), then the new report; NEW alone: the committed baselines for its torch and tiers")
    cp.add_argument("--format", choices=("text", "md", "json"), default="text")
    cp.add_argument("-o", "--output", default="-")
    cp.set_defaults(fn=cmd_compare)
    c = sub.add_parser("check", help="check one CaseSpec JSON file against invariants")
    c.add_argument("spec")
    c.add_argument("--invariant", action="append")
    c.add_argument("--backend", default="fake", choices=BACKENDS)
    c.add_argument("--world-size", type=int, default=4)
    c.set_defaults(fn=cmd_check)
    rp = sub.add_parser("repro", help="re-run a finding (report JSON, finding JSON or CaseSpec JSON) on the pool and write its torch-only repro")
    rp.add_argument("spec", metavar="PATH")
    rp.add_argument("--finding", default=None, help="finding ID, when PATH is a report with several")
    rp.add_argument("--invariant", action="append", help="check these invariants instead of the finding's")
    rp.add_argument("--backend", default="auto", choices=BACKENDS, help="default auto: nccl with a GPU per rank, else gloo")
    rp.add_argument("--world-size", type=int, default=2)
    rp.add_argument("-o", "--output", default="-", help="where the script goes (default: stdout)")
    rp.add_argument("--no-run", action="store_true", help="only write the script")
    rp.set_defaults(fn=cmd_repro)
    b = sub.add_parser("bench", help="examples/s of the checks per FSDP API next to the time inside FSDP; --engines compares the engines")
    b.add_argument("--api", default="all", help="fsdp1 (fake tier) | fsdp2 (gloo pool) | checkpoint (save/reshard/load on worlds 1-3) | all (default), comma-separated")
    b.add_argument("--examples", type=int, default=None, help="drawn examples per benchmark (default: fsdp1 500, fsdp2 100, checkpoint 30, engines 200)")
    b.add_argument("--world-size", type=int, default=2, help="ranks of the gloo pool (default 2)")
    b.add_argument("--fake-world-size", type=int, default=4, help="world size of the fake process group (default 4)")
    b.add_argument("--seed", type=int, default=0, help="Hypothesis seed of the drawn cases (default 0)")
    b.add_argument("--engines", action="store_true", help="also spawn-per-example vs pool vs fake on the same cases")
    b.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    b.add_argument("--target", action="append", default=None, metavar="TARGET",
                   help="a real model ('package.module:attr', repeatable): per API (--api fsdp1 and/or fsdp2), fsdp1 on the fake tier and fsdp2 on the gloo pool (default 20 examples)")
    b.set_defaults(fn=cmd_bench)
    s = sub.add_parser("selfcheck", help="run the suite's own tests; --mutants: the suite's mutation score")
    s.set_defaults(fn=cmd_selfcheck)
    # ---- model: a real nn.Module (issue 8) ----
    from conformance.cli import model as cli_model

    cli_model.add_parser(sub, UsageError, BACKENDS)
    # ---- end model ----
    from conformance.selfcheck import mutants

    mutants.add_arguments(s)
    # ---- issue 10: testing an FSDP change (conformance.cli.change) ----
    from conformance.cli import change

    change.add_parser(sub, main)
    # ---- end issue 10 ----
    ns = p.parse_args(argv)
    try:
        return ns.fn(ns)
    except UsageError as e:
        print(f"fsdp-conformance: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fsdp-conformance: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # run as a script this file is a second copy of the module: use the
    # package's, so that conformance.cli.change / conformance.selfcheck.mutants raise the
    # UsageError that main catches
    from conformance.cli import main as _main

    sys.exit(_main())
