"""`fsdp-conformance compare`: a report against a baseline."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from conformance import paths
from conformance.cli.errors import UsageError
from conformance.report import compare, data


def cmd_compare(ns) -> int:

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


def add_parser(sub) -> None:
    p = sub.add_parser("compare", help="compare a report with a baseline: regressions, fixes, new / removed invariants")
    p.add_argument("reports", nargs="+", metavar="BASE.json ... NEW.json",
                    help="baseline(s), then the new report; NEW alone: the committed baselines for its torch and tiers")
    p.add_argument("--format", choices=("text", "md", "json"), default="text")
    p.add_argument("-o", "--output", default="-")
    p.set_defaults(fn=cmd_compare)
