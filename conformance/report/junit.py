"""JUnit XML of a report: one test case per invariant, API and tier."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from conformance.report.data import row_label


def render(report: dict) -> str:
    rows = report["results"]
    failed_tests = report.get("tests", {}).get("failed", [])
    root = ET.Element("testsuites")
    suite = ET.SubElement(
        root,
        "testsuite",
        name="fsdp-conformance",
        tests=str(len(rows) + len(failed_tests)),
        failures=str(sum(r["verdict"] == "FAIL" for r in rows) + len(failed_tests)),
        errors="0",
        skipped=str(sum(r["verdict"] == "SKIP" for r in rows)),
        time=f"{report['summary']['seconds']:.3f}",
        timestamp=report.get("started_at") or "",
    )
    props = ET.SubElement(suite, "properties")
    for name, value in (
        ("torch", report.get("torch", {}).get("version")),
        ("torch_git", report.get("torch", {}).get("git_version")),
        ("profile", report.get("run", {}).get("profile")),
        ("complete", str(report.get("complete"))),
        ("suite_revision", report.get("suite", {}).get("git_revision")),
    ):
        ET.SubElement(props, "property", name=name, value=str(value))
    findings = {f["id"]: f for f in report.get("findings", [])}
    for r in rows:
        case = ET.SubElement(
            suite, "testcase", classname=f"fsdp-conformance.{r['api']}.{r['tier']}", name=row_label(r), time=f"{r['seconds']:.3f}"
        )
        fs = [findings[i] for i in r["findings"] if i in findings]
        if r["verdict"] == "FAIL":
            bad = [f for f in fs if f["kind"] != "KNOWN"]
            msg = bad[0]["message"] if bad else (r.get("reason") or "failed")
            el = ET.SubElement(case, "failure", message=msg[:500], type=bad[0]["kind"] if bad else "FAIL")
            el.text = "\n\n".join(
                f"{f['kind']}: {f['message']}\nfinding: {f['id']} (its smallest case is in the JSON report)\nrepro: {f.get('repro')}" for f in bad
            ) or msg
        elif r["verdict"] == "SKIP":
            ET.SubElement(case, "skipped", message=r.get("reason") or "skipped")
        out = [f"verdict {r['verdict']}, {r.get('checked', r['examples'])} of {r['examples']} examples checked"]
        if r.get("reason"):
            out.append(r["reason"])
        out += [f"KNOWN {f['known_failure']}: {f['message']}" for f in fs if f["kind"] == "KNOWN"]
        ET.SubElement(case, "system-out").text = "\n".join(out)
    for t in failed_tests:
        case = ET.SubElement(suite, "testcase", classname="fsdp-conformance.tests", name=t["nodeid"], time="0")
        ET.SubElement(case, "failure", message=(t.get("message") or "failed")[:500], type="test")
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
