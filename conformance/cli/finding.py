"""`fsdp-conformance finding [ID]`: a finding as a GitHub issue body, ready
to file (its repro run against the installed torch, in every mode its header
offers, and `python -m torch.utils.collect_env` captured); without ID, the
findings one line each."""

from __future__ import annotations

import difflib
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from conformance import paths
from conformance.cli.errors import UsageError
from conformance.report import issue
from conformance.run import known as known_mod
from conformance.run import repros


def _installed_torch() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        raise UsageError("torch is not installed: a finding's repro runs against the installed torch") from None


def _collect_env(timeout: float) -> str:
    try:
        proc = subprocess.run([sys.executable, "-m", "torch.utils.collect_env"], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"(python -m torch.utils.collect_env did not finish in {timeout:g} s)"
    return (proc.stdout or proc.stderr).strip()


def _runs(path: Path, modes: list, timeout: float) -> list[dict]:
    out = []
    for mode in modes:
        res = repros.run(path, mode, timeout=timeout)
        tail = res.output.strip().splitlines()[-60:]  # what a maintainer reads; the script is in the issue
        out.append({"command": mode.command, "shown": mode.shown, "why": mode.why, "verdict": res.verdict, "line": res.line,
                    "returncode": res.returncode, "timed_out": res.timed_out, "output": "\n".join(tail)})
    return out


def cmd_finding(ns) -> int:
    try:
        findings = {k.id: k for k in known_mod.load()}
    except known_mod.KnownFailuresError as e:
        raise UsageError(str(e)) from None
    if ns.id is None:
        for k in findings.values():
            print(f"{k.id}  [{k.cls}] {str(k.torch)}  {k.title}")
        return 0
    k = findings.get(ns.id)
    if k is None:
        near = difflib.get_close_matches(ns.id, findings, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(near)}?" if near else " (fsdp-conformance finding lists them)"
        raise UsageError(f"no finding {ns.id!r}{hint}")
    path = paths.PACKAGE.parent / k.repro  # reports/findings/ of the checkout the package runs from
    try:
        script = path.read_text()
        modes = repros.modes(path)
    except (OSError, repros.ReproHeaderError) as e:
        raise UsageError(f"finding {k.id}: its repro {k.repro} cannot be run: {e}") from None
    version = _installed_torch()
    if ns.no_run:
        runs = [{"command": m.command, "shown": m.shown, "why": m.why, "skipped": "--no-run"} for m in modes]
        env = ""
    else:
        if ns.format == "md":
            print(f"running {k.repro} ({len(modes)} mode(s)) and collect_env against torch {version} ...", file=sys.stderr)
        runs = _runs(path, modes, ns.timeout)
        env = _collect_env(ns.timeout)
    d = issue.data(k, script=script, runs=runs, torch_version=version, in_range=known_mod.in_range(version, k.torch), collect_env=env)
    text = issue.to_json(d) if ns.format == "json" else issue.to_markdown(d)
    if ns.output:
        Path(ns.output).write_text(text)
        print(f"issue body: {ns.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("finding", help="a finding as a GitHub issue body (without ID: the findings, one line each)")
    p.add_argument("id", nargs="?", help="a finding's id (known_failures.toml)")
    p.add_argument("--format", choices=("md", "json"), default="md")
    p.add_argument("--no-run", action="store_true", help="do not run the repro or collect_env (the body says so)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per repro mode (default 240)")
    p.add_argument("-o", "--output", help="write the body to this file")
    p.set_defaults(fn=cmd_finding)
