#!/usr/bin/env python3
"""The release matrix: the conformance suite's `ci` profile on each torch
release, fake tier (W=4) and gloo pool (W=2) as ci/baseline.sh runs them, each
release in a virtual environment of its own, and the page that compares them
(reports/matrix/README.md and index.html, conformance/report/matrix.py).

    .venv/bin/python ci/matrix.py                  # every release in RELEASES
    .venv/bin/python ci/matrix.py 2.4.1 2.13.0     # these releases
    .venv/bin/python ci/matrix.py --newest 2       # the newest rows (the nightly workflow)
    .venv/bin/python ci/matrix.py --page-only      # regenerate the page from what is there

Per release: a venv under --venv-root, `pip install torch==X` (releases before
2.13 are CUDA wheels from PyPI: a few GB; they run on CPU), the suite installed
into it with torch pinned (pip must not replace it; checked), the two tiers,
then every finding's repro in every mode its header offers (the `repros` tier:
torch-X-repros.json, the measured ranges), then the venv is deleted. Each tier
writes reports/matrix/torch-X-<backend>-w<W>.json;
a release that cannot be installed, or a tier that cannot run, writes
torch-X-<what>.notrun.json with one line why, and the matrix goes on. A
release's earlier files are replaced when it is run again.

The runs set FSDP_CONFORMANCE_KNOWN_ANY_RELEASE=1 (conformance/known.py): every
known failure matches at every release, so each baseline names all the findings
it shows; the page applies known_failures.toml's real torch ranges."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# the latest patch release of each minor release, oldest first
RELEASES = ["2.4.1", "2.5.1", "2.6.0", "2.7.1", "2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1"]
TIERS = (("fake", 4), ("gloo", 2))
REPROS = "repros"  # the tier that runs every committed repro (reports/findings/*.py) in every mode its header offers
ANY_RELEASE_ENV = "FSDP_CONFORMANCE_KNOWN_ANY_RELEASE"  # = conformance.run.known.ANY_RELEASE_ENV


class NotRun(Exception):
    """A step of a release that could not be done: its message is the one line why."""


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("WARNING: Location")]
    return (lines[-1] if lines else "no output")[:300]


def _run(cmd: list[str], log: Path, timeout: float, env: dict | None = None) -> int:
    """Run in its own process group (killed whole on timeout or interrupt), output to ``log``."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise NotRun(f"timed out after {timeout:.0f}s") from None
        except BaseException:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            raise


def install_suite(release: str, venv: Path, log: Path, timeout: float) -> None:
    """The suite, editable, into the venv (its entry points: the pytest plugin),
    with torch pinned: pip must not replace the release under test."""
    pin = venv / "torch-pin.txt"
    pin.write_text(f"torch=={release}\n")
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-cache-dir", "--no-compile"]
    if _run(pip + ["-c", str(pin), "-e", str(ROOT)], log, timeout) != 0:
        raise NotRun(f"pip install the suite: {_last_line(log.read_text())}")


def install(release: str, venv: Path, log: Path, python: str, timeout: float) -> str:
    """A venv with torch==release and the suite; returns torch.__version__."""
    if _run([python, "-m", "venv", str(venv)], log, 300) != 0:
        raise NotRun(f"venv: {_last_line(log.read_text())}")
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "install", "-q", "--no-cache-dir", "--no-compile"]  # no .pyc for all of torch: minutes on 2 cores
    if _run(pip + [f"torch=={release}"], log, timeout) != 0:
        raise NotRun(f"pip install torch=={release}: {_last_line(log.read_text())}")
    install_suite(release, venv, log, timeout)
    proc = subprocess.run([py, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise NotRun(f"import torch: {_last_line(proc.stderr)}")
    version = proc.stdout.strip()
    if version.split("+")[0] != release:
        raise NotRun(f"torch {version} installed, not {release}")
    return version


def kept_venv(release: str, venv: Path) -> str | None:
    """torch.__version__ of a venv kept by an earlier --keep-venvs run, if it has this release."""
    py = venv / "bin" / "python"
    if not py.exists():
        return None
    proc = subprocess.run([str(py), "-c", "import torch, conformance; print(torch.__version__)"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    version = proc.stdout.strip()
    return version if proc.returncode == 0 and version.split("+")[0] == release else None


def run_tier(py: str, backend: str, world: int, workers: int, log: Path, timeout: float, examples: int | None = None,
             deadline: float | None = None) -> dict:
    size = ["--fake-world-size" if backend == "fake" else "--world-size", str(world)]
    if deadline:
        size += ["--deadline", str(deadline)]  # a loaded machine: a slow example is not a HANG
    if examples:
        size += ["--examples", str(examples)]  # fewer than the profile's: the page says so
    with tempfile.TemporaryDirectory(prefix="fsdp-matrix-") as d:
        env = dict(os.environ, **{ANY_RELEASE_ENV: "1"})
        rc = _run([py, "-m", "conformance.cli", "run", "--profile", "ci", "--backend", backend, *size, "-n", str(workers),
                   "--report-dir", d, "--baseline", "none", "--progress", "quiet"], log, timeout, env)
        report = Path(d) / "report.json"
        if rc > 1 or not report.is_file():
            raise NotRun(f"exit {rc}: {_last_line(log.read_text())}")
        data = json.loads(report.read_text())
    if not data.get("complete", False):
        raise NotRun(f"incomplete run: {data.get('status')}")
    return data


def run_repros(py: str, version: str, workers: int, timeout: float) -> dict:
    """Every finding's repro on this release (its venv's python): the
    measured ranges of known_failures.toml come from these files."""
    from conformance.run import repros

    scripts = sorted((ROOT / "reports" / "findings").glob("*.py"))
    return {"schema": repros.REPROS_SCHEMA, "release": version.split("+")[0], "torch": version,
            "findings": repros.measure(scripts, python=py, timeout=timeout, workers=workers)}


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def record_notrun(out: Path, release: str, what: str, reason: str) -> None:
    _write_json(out / f"torch-{release}-{what}.notrun.json", {"release": release, "what": what, "reason": reason})
    print(f"  {release} {what}: not run: {reason}", flush=True)


def prepare(release: str, args) -> None:
    """--install-only: make (or keep) the venv for a later --keep-venvs run.
    A marker file tells a run going on at the same time to wait for it."""
    venv = args.venv_root / f"torch-{release}"
    args.venv_root.mkdir(parents=True, exist_ok=True)
    marker = venv.with_name(venv.name + ".installing")
    log = args.venv_root / f"torch-{release}.install.log"
    log.write_text("")
    marker.write_text(str(os.getpid()))
    try:
        if kept_venv(release, venv) is None:
            shutil.rmtree(venv, ignore_errors=True)
            print(f"{release}: installing (log {log})", flush=True)
            try:
                print(f"{release}: torch {install(release, venv, log, args.python, args.install_timeout)} installed", flush=True)
            except (NotRun, subprocess.SubprocessError) as e:
                shutil.rmtree(venv, ignore_errors=True)  # the run records it when it tries
                print(f"{release}: not installed: {e}", flush=True)
    finally:
        marker.unlink(missing_ok=True)


def _wait_for_installer(venv: Path) -> None:
    marker = venv.with_name(venv.name + ".installing")
    while marker.exists():
        try:
            os.kill(int(marker.read_text() or 0), 0)
        except (ValueError, ProcessLookupError, PermissionError, OSError):
            marker.unlink(missing_ok=True)  # its installer is gone
            return
        time.sleep(10)


def run_release(release: str, args) -> None:
    out = args.out
    tiers = [(b, w) for b, w in TIERS if b in args.tiers]
    for old in out.glob(f"torch-{release}-*.json"):
        if old.name.split("-")[2].split(".")[0] in {"install", *args.tiers}:  # the tiers run again, and a failed install
            old.unlink()
    venv = args.venv_root / f"torch-{release}"
    args.venv_root.mkdir(parents=True, exist_ok=True)
    log = args.venv_root / f"torch-{release}.log"
    log.write_text("")
    try:
        try:
            if args.keep_venvs:
                _wait_for_installer(venv)
            version = kept_venv(release, venv) if args.keep_venvs else None
            if version is not None:
                install_suite(release, venv, log, args.install_timeout)  # the suite may have changed since
            else:
                shutil.rmtree(venv, ignore_errors=True)
                print(f"{release}: installing (log {log})", flush=True)
                version = install(release, venv, log, args.python, args.install_timeout)
        except (NotRun, subprocess.SubprocessError) as e:
            record_notrun(out, release, "install", str(e))
            return
        print(f"{release}: torch {version} installed", flush=True)
        if REPROS in args.tiers:
            data = run_repros(str(venv / "bin" / "python"), version, args.workers, args.repro_timeout)
            _write_json(out / f"torch-{release}-{REPROS}.json", data)
            shown = [f["verdict"] for f in data["findings"].values()]
            print(f"  {release} repros: {shown.count('DEVIATION')} show their deviation, {shown.count('AS SPECIFIED')} as specified,"
                  f" {shown.count('no verdict')} no verdict", flush=True)
        for backend, world in tiers:
            what = f"{backend}-w{world}"
            try:
                data = run_tier(str(venv / "bin" / "python"), backend, world, args.workers, log, args.run_timeout, args.examples,
                                args.deadline)
            except (NotRun, json.JSONDecodeError, OSError) as e:
                record_notrun(out, release, what, str(e))
                continue
            _write_json(out / f"torch-{release}-{what}.json", data)
            v = data["summary"]["verdicts"]
            print(f"  {release} {what}: " + ", ".join(f"{n} {k}" for k, n in v.items() if n), flush=True)
    finally:
        if not args.keep_venvs:
            shutil.rmtree(venv, ignore_errors=True)


def write_page(out: Path) -> None:
    from conformance.report import matrix

    md, html = matrix.write(out)
    print(f"wrote {md} and {html}", flush=True)


def _release(text: str) -> str:
    from packaging.version import InvalidVersion, Version

    try:
        v = Version(text)
    except InvalidVersion:
        raise argparse.ArgumentTypeError(f"not a torch release: {text!r}") from None
    if len(v.release) != 3 or v.local or v.pre or v.dev:
        raise argparse.ArgumentTypeError(f"give a full release such as 2.4.1, not {text!r}")
    return text


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        print(f"matrix: {message}", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    p = _Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("releases", nargs="*", type=_release, help=f"torch releases (default: {' '.join(RELEASES)})")
    p.add_argument("--newest", type=int, metavar="N", help="only the newest N of the default releases")
    p.add_argument("--out", type=Path, default=ROOT / "reports" / "matrix")
    p.add_argument("--venv-root", type=Path, default=Path(tempfile.gettempdir()) / "fsdp-matrix-venvs")
    p.add_argument("--python", default=sys.executable, help="the interpreter the venvs are made from")
    p.add_argument("--workers", type=int, default=int(os.environ.get("WORKERS", "2")))
    p.add_argument("--examples", type=int, help="Hypothesis examples per test instead of the ci profile's (a quicker, smaller matrix)")
    p.add_argument("--tiers", default="fake,gloo,repros",
                   help="the tiers to run (default fake,gloo,repros: the findings' repros); the other tiers' files stay")
    p.add_argument("--repro-timeout", type=float, default=240, help="seconds per repro mode")
    p.add_argument("--deadline", type=float, help="seconds before a pool example is a HANG (default: the suite's)")
    p.add_argument("--install-timeout", type=float, default=1800)
    p.add_argument("--run-timeout", type=float, default=2400, help="seconds per tier")
    p.add_argument("--keep-venvs", action="store_true", help="keep each venv, and reuse one kept before")
    p.add_argument("--page-only", action="store_true", help="only regenerate the page")
    p.add_argument("--install-only", action="store_true",
                   help="only make the venvs (kept), for a --keep-venvs run going on at the same time or later")
    args = p.parse_args(argv)
    args.tiers = [t for t in args.tiers.split(",") if t]
    if not args.tiers or set(args.tiers) - {b for b, _ in TIERS} - {REPROS}:
        p.error(f"--tiers takes {','.join(b for b, _ in TIERS)},{REPROS}, got {','.join(args.tiers) or 'nothing'}")
    if args.releases and args.newest:
        p.error("give releases or --newest, not both")
    if args.newest is not None and args.newest < 1:
        p.error("--newest wants a positive count")
    releases = args.releases or (RELEASES[-args.newest:] if args.newest else RELEASES)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        if args.install_only:
            for release in releases:
                prepare(release, args)
        elif not args.page_only:
            for release in releases:
                run_release(release, args)
                write_page(args.out)  # a page for what is done so far
        else:
            write_page(args.out)
    except KeyboardInterrupt:
        print("matrix: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # the page: a broken baseline or known_failures.toml
        print(f"matrix: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
