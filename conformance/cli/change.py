"""`fsdp-conformance change BASE NEW`: one FSDP change, judged. Runs the same
profile and seed on two FSDP sources (a source tree, or "installed") and
prints the comparison: regressions (exit 1) with their repro scripts, fixes,
changed verdicts and messages."""

from __future__ import annotations

import os
import random
import shlex
import sys
from pathlib import Path

from conformance.cli.errors import UsageError
from conformance.cli.run import run_argv
from conformance.report import compare, data
from conformance.report.data import row_label
from conformance.report.markdown import fsdp_source_label
from conformance.selfcheck import fsdp_source

INSTALLED = "installed"


def _source_label(info: dict | None) -> str:
    return fsdp_source_label(info)


def _changed_messages(base: dict, new: dict) -> list[str]:
    """Findings of the same row and kind whose message differs: the same
    deviation, reported in other words (or on another smallest case)."""
    def by_key(report):
        return {(row_label(f), f["api"], f["tier"], f["key"]): f for f in report.get("findings", [])}

    b, n = by_key(base), by_key(new)
    out = []
    for k in sorted(b.keys() & n.keys()):
        if b[k]["message"] != n[k]["message"]:
            out.append(f"{k[0]} ({k[1]}, {k[2]}) {k[3]}:\n    BASE: {_first(b[k]['message'])}\n    NEW:  {_first(n[k]['message'])}")
    return out


def _first(text: str, width: int = 300) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= width else line[: width - 3] + "..."


def regression_repros(comparison, new: dict, new_dir: Path, new_source: str | None) -> list[dict]:
    """For each regressed row: its failing findings in NEW, each with its
    repro script and the command that runs it against NEW's FSDP."""
    out = []
    for ch in comparison.regressions:
        for f in new.get("findings", []):
            if (row_label(f), f["api"], f["tier"]) != (ch.invariant, ch.api, ch.tier) or f["kind"] == "KNOWN":
                continue
            repro = str((new_dir / f["repro"]).resolve()) if f.get("repro") else None
            if repro is None:
                cmd = None
            elif new_source:
                cmd = f"python -m conformance.selfcheck.fsdp_source run {shlex.quote(new_source)} {shlex.quote(repro)}"
            else:
                cmd = f"python {shlex.quote(repro)}"
            out.append({"id": f["id"], "kind": f["kind"], "message": _first(f["message"]), "repro": repro, "command": cmd,
                        "case": f.get("spec_python")})
    return out


def render(comparison, repros: list[dict], messages: list[str], base_label: str, new_label: str) -> str:

    lines = [f"BASE FSDP: {base_label}", f"NEW FSDP:  {new_label}", ""]
    text = compare.render(comparison, "text")
    lines += text.rstrip().splitlines()
    if messages:
        lines += ["", f"Changed messages ({len(messages)}):"] + [f"  {m}" for m in messages]
    if repros:
        lines += ["", f"Repro scripts for the regressions ({len(repros)}):"]
        for r in repros:
            lines.append(f"  {r['id']} [{r['kind']}]: {r['message']}")
            lines.append(f"    {r['command'] or 'no repro script (' + str(r.get('repro')) + ')'}")
    return "\n".join(lines) + "\n"


def run_change(ns) -> int:
    """Run ``fsdp-conformance run`` on each side and compare the two reports."""

    sources = {}
    for side, path in (("base", ns.base), ("new", ns.new)):
        if path == INSTALLED:
            sources[side] = None
            continue
        try:
            sources[side] = fsdp_source.validate(path)
        except fsdp_source.SourceError as e:
            raise UsageError(f"{side.upper()}: {e}") from None
    seed = ns.seed if ns.seed is not None else random.randrange(2**31)
    out_dir = Path(ns.report_dir or Path.cwd() / "reports" / "change").resolve()
    common = ["--profile", ns.profile, "--seed", str(seed), "--baseline", "none", "--deadline", str(ns.deadline),
              "--world-size", str(ns.world_size), "--fake-world-size", str(ns.fake_world_size), "-n", str(ns.workers),
              "--progress", ns.progress]
    if ns.backend:
        common += ["--backend", ns.backend]
    if ns.tiers:
        common += ["--tiers", ns.tiers]
    if ns.examples is not None:
        common += ["--examples", str(ns.examples)]
    for inv in ns.invariant or []:
        common += ["--invariant", inv]
    print(f"fsdp-conformance change: profile {ns.profile}, seed {seed}; reports in {out_dir}/{{base,new}}", file=sys.stderr)
    saved = os.environ.get(fsdp_source.ENV_VAR)
    # both sides draw the same examples: no database replaying BASE's failures in NEW
    os.environ["FSDP_CONFORMANCE_DATABASE"] = "none"
    reports = {}
    try:
        for side in ("base", "new"):
            info = sources[side]
            if info is None:
                os.environ.pop(fsdp_source.ENV_VAR, None)
            else:
                os.environ[fsdp_source.ENV_VAR] = info["path"]
            print(f"== {side.upper()}: FSDP from {_source_label(info)}", file=sys.stderr)
            rc = run_argv([*common, "--report-dir", str(out_dir / side)])
            if rc not in (0, 1):
                print(f"fsdp-conformance: error: the {side.upper()} run ended with exit status {rc}", file=sys.stderr)
                return rc
            try:
                reports[side] = data.load(out_dir / side / "report.json")
            except data.ReportError as e:
                raise UsageError(str(e)) from None
    finally:
        if saved is None:
            os.environ.pop(fsdp_source.ENV_VAR, None)
        else:
            os.environ[fsdp_source.ENV_VAR] = saved
    c = compare.compare(reports["base"], reports["new"])
    repros = regression_repros(c, reports["new"], out_dir / "new", sources["new"] and sources["new"]["path"])
    messages = _changed_messages(reports["base"], reports["new"])
    text = render(c, repros, messages, _source_label(sources["base"]), _source_label(sources["new"]))
    data.write_text(out_dir / "change.txt", text)
    data.write_json(out_dir / "change.json", {**c.to_dict(), "seed": seed, "profile": ns.profile,
                                              "base_source": sources["base"], "new_source": sources["new"],
                                              "regression_repros": repros, "changed_messages": messages})
    sys.stdout.write(text)
    print(f"(also in {out_dir / 'change.txt'} and change.json)", file=sys.stderr)
    return c.exit_status


def add_parser(sub) -> None:
    ch = sub.add_parser("change", help="run the same profile and seed on two FSDP sources and compare: regressions (exit 1), fixes, changed messages")
    ch.add_argument("base", metavar="BASE", help="FSDP source tree (holding torch/distributed/fsdp/) or 'installed'")
    ch.add_argument("new", metavar="NEW", help="FSDP source tree or 'installed'")
    ch.add_argument("--profile", default="ci", help="dev | ci | thorough (default ci: derandomized)")
    ch.add_argument("--seed", type=int, default=None, help="Hypothesis seed for both runs (default: one drawn now, printed)")
    ch.add_argument("--examples", type=int, default=None)
    ch.add_argument("--backend", default=None)
    ch.add_argument("--tiers", default=None)
    ch.add_argument("--world-size", type=int, default=2)
    ch.add_argument("--fake-world-size", type=int, default=4)
    ch.add_argument("--invariant", action="append")
    ch.add_argument("-n", "--workers", type=int, default=0)
    ch.add_argument("--deadline", type=float, default=60.0)
    ch.add_argument("--progress", choices=("auto", "live", "quiet"), default="auto")
    ch.add_argument("--report-dir", default=None, help="BASE and NEW reports go to DIR/base and DIR/new (default reports/change under the current directory)")
    ch.set_defaults(fn=run_change)
