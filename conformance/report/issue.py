"""A finding as a GitHub issue body (`fsdp-conformance finding ID`): its
title, what happens and what was promised (the quoted evidence), the root
cause in torch's source, the repro with the output of its runs against the
installed torch, the affected releases, the environment, and the upstream
issues and PRs already known. Pure: the command gathers the runs and the
environment; this module only shapes them (Markdown or JSON)."""

from __future__ import annotations

import json


def data(known, *, script: str, runs: list[dict], torch_version: str, in_range: bool, collect_env: str) -> dict:
    """The issue's fields. ``runs``: one dict per repro mode (command,
    shown, why, verdict, line, returncode, output)."""
    rc = known.root_cause
    return {
        "id": known.id,
        "title": known.title,
        "class": known.cls,
        "what_happens": known.summary,
        "promise": {"evidence": known.evidence, "source": known.evidence_source},
        "root_cause": {"id": rc.id, "explanation": rc.explanation, "source": rc.source} if rc else None,
        "repro": {"path": known.repro, "script": script, "runs": runs},
        "affected": {"range": str(known.torch), "installed": torch_version, "installed_in_range": in_range},
        "environment": collect_env,
        "upstream": [u.to_dict() for u in known.upstream],
        "upstream_searched": known.upstream_searched,
        "upstream_note": known.upstream_note,
    }


def to_json(d: dict) -> str:
    return json.dumps(d, indent=2) + "\n"


def _quote(text: str) -> str:
    return "\n".join(f"> {ln}" if ln else ">" for ln in text.strip().splitlines())


def _fence(text: str, lang: str = "") -> str:
    ticks = "```"
    while ticks in text:
        ticks += "`"
    return f"{ticks}{lang}\n{text.rstrip()}\n{ticks}"


def to_markdown(d: dict) -> str:
    out = [f"# {d['title']}", ""]
    out += ["### What happens", "", " ".join(d["what_happens"].split()), ""]
    kind = {"bug": "the documented promise it breaks", "implicit": "what a user may expect (no doc states it; why)",
            "diagnostic": "why the error is not the one a user needs", "limitation": "the documented limitation",
            "enhancement": "why it is a wish, not a promise"}[d["class"]]
    out += [f"### What was expected ({d['class']}: {kind})", "", _quote(d["promise"]["evidence"]), ""]
    if d["promise"]["source"]:
        out += [f"Source: {d['promise']['source']}", ""]
    if d["root_cause"]:
        rc = d["root_cause"]
        out += [f"### Where it comes from (`{rc['id']}`)", "", " ".join(rc["explanation"].split()), "", f"Source: {rc['source']}", ""]
    rep = d["repro"]
    out += ["### Reproduction", "", f"`{rep['path']}`, standalone (torch only):", "", _fence(rep["script"], "python"), ""]
    for r in rep["runs"]:
        if r.get("skipped"):
            out += [f"`{r['command']}`: not run ({r['skipped']})", ""]
            continue
        shown = "" if r["shown"] else f" (the script says this mode cannot show it: {r['why']})"
        verdict = r["line"] or f"no verdict line (exit status {r['returncode']})"
        out += [f"`{r['command']}`{shown} on torch {d['affected']['installed']}: **{verdict}**", "", "<details><summary>output</summary>",
                "", _fence(r["output"]), "", "</details>", ""]
    a = d["affected"]
    where = "inside" if a["installed_in_range"] else "outside"
    out += ["### Affected releases", "", f"`{a['range']}` (the releases fsdp-conformance records as affected; the installed {a['installed']} is {where} them)", ""]
    out += ["### Upstream", ""]
    if d["upstream"]:
        for u in d["upstream"]:
            fixed = f", fixed in {u['fixed_in']}" if u["fixed_in"] else ""
            out.append(f"- {u['url']} ({u['kind']}, {u['state']}{fixed}): {u['title']}")
    else:
        out.append(f"- none found (searched {d['upstream_searched']})")
    if d["upstream_note"]:
        out += ["", " ".join(d["upstream_note"].split())]
    out += ["", "### Versions", "", _fence(d["environment"] or "(python -m torch.utils.collect_env was not run)"), ""]
    out += [f"Found by fsdp-conformance (finding `{d['id']}`)."]
    return "\n".join(out) + "\n"
