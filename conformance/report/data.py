"""The JSON report (schema in reports/SCHEMA.md): environment, per-invariant
rows, findings, known failures; merging per-process partials; loading."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from conformance.run import corpus as corpus_mod
from conformance.run import known as known_mod
from conformance.run.known import in_range

SCHEMA = "fsdp-conformance-report"
SCHEMA_VERSION = 1
UNCHECKED = "UNCHECKED"  # an example's outcome when its invariant compared nothing (conformance.run.runner)
VERDICTS = ("PASS", "FAIL", "KNOWN", "FIXED", "SKIP")
FAILING_KINDS = ("FAIL", "HANG", "CRASH", "ERROR")
ROOT = Path(__file__).resolve().parents[2]  # the checkout, when run from one (git revision)


class ReportError(ValueError):
    """A report or baseline that cannot be used (one-line message)."""


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# ---- environment -------------------------------------------------------------


def _git(*args: str) -> str | None:
    if not (ROOT / ".git").exists():  # an installed package: no checkout of its own
        return None
    try:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def suite_info() -> dict:
    try:
        from importlib.metadata import version

        ver = version("fsdp-conformance")
    except Exception:
        ver = None
    rev = _git("rev-parse", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return {"version": ver, "git_revision": rev, "git_dirty": bool(dirty) if dirty is not None else None}


def torch_info() -> dict:
    import torch

    info = {
        "version": torch.__version__,
        "git_version": getattr(torch.version, "git_version", None),
        "cuda": torch.version.cuda,
        "nccl": None,
        "distributed": False,
        "gpus": 0,
    }
    try:
        import torch.distributed as dist

        info["distributed"] = bool(dist.is_available())
    except Exception:
        pass
    try:
        info["gpus"] = torch.cuda.device_count()
    except Exception:
        pass
    if torch.version.cuda:
        try:
            v = torch.cuda.nccl.version()
            info["nccl"] = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
        except Exception:
            pass
    return info


def platform_info() -> dict:
    return {
        "system": platform.system(),
        "release": platform.release(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }


# ---- merging ----------------------------------------------------------------


def _size(spec: dict) -> tuple[int, int]:
    def count(tree: dict) -> int:
        return 1 + sum(count(c) for c in tree.get("children", []) or [])

    case = spec.get("case", spec) if isinstance(spec, dict) else {}
    tree = case.get("tree") if isinstance(case, dict) else None
    return (count(tree) if isinstance(tree, dict) else 0, len(json.dumps(spec, sort_keys=True)))


def merge_tallies(partials: list[dict]) -> dict[tuple[str, str, str, str], dict]:
    """Tallies of several processes (xdist workers) as one, keyed by
    (invariant, api, tier, model; "" for the synthetic cases): counts and
    times add up, each finding keeps the smallest case any process saw."""
    out: dict[tuple[str, str, str, str], dict] = {}
    for part in partials:
        for t in part.get("tallies", []):
            key = (t["invariant"], t["api"], t["tier"], t.get("model") or "")
            cur = out.get(key)
            if cur is None:
                out[key] = cur = {**t, "outcomes": {}, "examples": 0, "seconds": 0.0, "findings": [], "features": {}, "unchecked": {}}
            for k, v in t.get("features", {}).items():
                cur["features"][k] = cur["features"].get(k, 0) + v
            for k, v in t.get("unchecked", {}).items():
                cur["unchecked"][k] = cur["unchecked"].get(k, 0) + v
            cur["examples"] += t["examples"]
            cur["seconds"] += t["seconds"]
            for k, v in t["outcomes"].items():
                cur["outcomes"][k] = cur["outcomes"].get(k, 0) + v
            by_key = {f["key"]: f for f in cur["findings"]}
            for f in t["findings"]:
                old = by_key.get(f["key"])
                if old is None:
                    by_key[f["key"]] = dict(f)
                    continue
                count = old["count"] + f["count"]
                if _size(f["spec"]) < _size(old["spec"]):
                    old.clear()
                    old.update(f)
                old["count"] = count
            cur["findings"] = list(by_key.values())
    return out


# ---- the report ---------------------------------------------------------------


def merge_corpus(partials: list[dict]) -> list[dict]:
    """The corpus cases' outcomes of every process, one record per case,
    invariant and tier (verdict counts added up)."""
    out: dict[tuple, dict] = {}
    for part in partials:
        for c in part.get("corpus", []):
            key = (c["case"], c["invariant"], c["tier"])
            rec = out.setdefault(key, {**c, "verdicts": {}, "known": []})
            for v, n in c["verdicts"].items():
                rec["verdicts"][v] = rec["verdicts"].get(v, 0) + n
            rec["known"] = sorted(set(rec["known"]) | set(c["known"]))
    return [out[k] for k in sorted(out)]


def row_label(r: dict) -> str:
    """A row's (or finding's) invariant, with the real model it ran on
    (rows of a model checked with --target or `model` stand beside the
    synthetic rows of the same invariant, API and tier)."""
    return f"{r['invariant']} on {r['model']}" if r.get("model") else r["invariant"]


def _finding_id(invariant: str, api: str, tier: str, key: str, model: str = "") -> str:
    return f"{invariant}/{api}/{tier}/{model + '/' if model else ''}{key}"


MODEL_TESTS = "test_models.py::"  # the suite's tests of real models (--target)


def _skip_reason(invariant: str, tier: str, run: dict, skips: dict) -> str:
    sel = run.get("selection") or []
    if sel and invariant not in run.get("selected", []):
        return "not selected"
    for k in ((invariant, tier), (invariant, None)):
        if k in skips:
            return skips[k]
    return "no test ran it on this tier"


def build(
    *,
    partials: list[dict],
    run: dict,
    tests: list[dict] | None = None,
    status: str = "complete",
    interrupted_by: str | None = None,
    started_at: str | None = None,
    finished_at: str | None = None,
    baselines: list[dict] | None = None,
    baseline_paths: list[str] | None = None,
    catalog: dict | None = None,
    known: list | None = None,
    fsdp_source: dict | None = None,
    torch_version: str | None = None,
    environment: dict | None = None,
    wall_seconds: float | None = None,
) -> dict:
    """The report dict. ``partials``: Session.to_dict() of every process;
    ``run``: options (tiers, profile, seed, selection); ``tests``: one
    record per pytest test (nodeid, outcome, invariant, tier, message);
    ``fsdp_source``: the FSDP source tree the run imported FSDP from (its
    report_info; None: the installed torch's own)."""
    if catalog is None:
        from conformance.areas import CATALOG as catalog
    if known is None:
        known = known_mod.load()
    env = environment or {"suite": suite_info(), "torch": torch_info(), "platform": platform_info(), "fsdp_source": fsdp_source}
    torch_version = torch_version or env["torch"]["version"]
    tests = tests or []
    tallies = merge_tallies(partials)
    tiers = [t["tier"] for t in run.get("tiers", [])]
    for (_, _, tier, _) in tallies:
        if tier not in tiers:
            tiers.append(tier)
    tier_info = {t["tier"]: t for t in run.get("tiers", [])}

    # skip reasons and failed test items, by (invariant, tier)
    skips: dict = {}
    item_failures: list[dict] = []
    for t in tests:
        invs = t.get("invariants") or ([t["invariant"]] if t.get("invariant") else [])
        if t["outcome"] == "skipped" and MODEL_TESTS not in t.get("nodeid", ""):
            # a real model's test skipped for want of --target says nothing
            # of the synthetic rows (a model's rows exist only with one)
            for inv in invs:
                skips.setdefault((inv, t.get("tier")), t.get("message") or "skipped")
        elif t["outcome"] == "failed" and invs:
            item_failures.append({**t, "invariants": invs})

    def failing(inv: str, tier: str) -> bool:
        return any(
            k[0] == inv and k[2] == tier and any(f["kind"] in FAILING_KINDS for f in t["findings"])
            for k, t in tallies.items()
        )

    # a failed test whose failure no finding of its invariants explains
    # (a health check, an error in the test) fails each of its rows
    unexplained: dict = {}
    for t in item_failures:
        tier = t.get("tier")
        tiers_of = [tier] if tier else tiers
        if not any(failing(inv, tr) for inv in t["invariants"] for tr in tiers_of):
            for inv in t["invariants"]:
                for tr in tiers_of:
                    unexplained.setdefault((inv, tr), t)

    base_rows = {}
    for b in baselines or []:
        for r in b.get("results", []):
            base_rows[(r["invariant"], r["api"], r["tier"], r.get("model") or "")] = r

    results, findings = [], []
    order = list(catalog.values())  # the catalog's own order: areas as their authors registered them
    known_ids = {inv.id for inv in order}
    extra = sorted({k[0] for k in tallies} - known_ids)
    for inv_id in [inv.id for inv in order] + extra:
        inv = catalog.get(inv_id)
        for tier in tiers:
            keys = sorted(k for k in tallies if k[0] == inv_id and k[2] == tier and not k[3])
            models = sorted(k for k in tallies if k[0] == inv_id and k[2] == tier and k[3])
            # an invariant of several APIs ("fsdp1|fsdp2") gets a row for each
            for api in (inv.api.split("|") if inv else ["?"]):
                if not any(k[1] == api for k in keys + models):
                    keys.append((inv_id, api, tier, ""))
            # a real model's rows (--target, `model`) follow the synthetic row of their API
            keys = [x for k in keys for x in [k, *(m for m in models if m[1] == k[1])]] + [
                m for m in models if not any(k[1] == m[1] for k in keys)]
            for key in keys:
                t = tallies.get(key)
                row = {
                    "invariant": inv_id,
                    "area": inv.area if inv else None,
                    "api": key[1],
                    "tier": tier,
                    "model": key[3] or None,
                    "backend": tier_info.get(tier, {}).get("backend", tier),
                    "world_size": tier_info.get(tier, {}).get("world_size"),
                    "statement": inv.statement if inv else "",
                    "source": inv.source if inv else "",
                    "verdict": "SKIP",
                    "reason": None,
                    "examples": 0,
                    "checked": 0,
                    "seconds": 0.0,
                    "outcomes": {},
                    "unchecked": {},
                    "features": {},
                    "findings": [],
                }
                fail_item = unexplained.get((inv_id, tier))
                if t is not None:
                    row["examples"] = t["examples"]
                    row["seconds"] = round(t["seconds"], 3)
                    row["outcomes"] = t["outcomes"]
                    row["checked"] = t["examples"] - t["outcomes"].get(UNCHECKED, 0)
                    row["unchecked"] = dict(sorted(t.get("unchecked", {}).items(), key=lambda kv: -kv[1]))
                    row["features"] = t.get("features", {})
                    for f in sorted(t["findings"], key=lambda f: (f["kind"] == "KNOWN", f["key"])):
                        fid = _finding_id(inv_id, key[1], tier, f["key"], key[3])
                        row["findings"].append(fid)
                        findings.append({"id": fid, "invariant": inv_id, "api": key[1], "tier": tier, "model": key[3] or None, **f})
                kinds = {f["kind"] for f in (t or {}).get("findings", [])}
                if kinds & set(FAILING_KINDS):
                    row["verdict"] = "FAIL"
                elif fail_item is not None:
                    row["verdict"] = "FAIL"
                    row["reason"] = f"test {fail_item['nodeid']} failed: {fail_item.get('message') or ''}".strip()
                elif "KNOWN" in kinds:
                    row["verdict"] = "KNOWN"
                elif row["checked"]:
                    row["verdict"] = "PASS"
                    base = base_rows.get((inv_id, key[1], tier, key[3]))
                    if base is not None and base.get("verdict") == "KNOWN" and row["checked"] >= base.get("checked", base.get("examples", 0)):
                        row["verdict"] = "FIXED"
                        row["reason"] = f"KNOWN in the baseline; no violation in {row['checked']} checked examples"
                elif row["examples"]:
                    reasons = "; ".join(f"{r} ({n})" for r, n in row["unchecked"].items()) or "no reason recorded"
                    row["reason"] = f"compared nothing on its {row['examples']} examples: {reasons}"
                elif t is not None:
                    row["reason"] = "no example got past the test's filters"
                else:
                    row["reason"] = _skip_reason(inv_id, tier, run, skips)
                results.append(row)

    # known failures: matched, unmatched (warned), fixed, not run, other torch

    base_known = {}
    for b in baselines or []:
        for k in b.get("known_failures", []):
            if k.get("status") == "matched":
                base_known[k["id"]] = k
    corpus_runs = merge_corpus(partials)

    corpus_cases = corpus_mod.load()
    corpus_findings = {c.finding for c in corpus_cases if c.finding}
    case_api = {c.name: c.spec.plan.api for c in corpus_cases}
    known_out, warnings = [], []
    for k in known:
        rows = [r for r in results if r["invariant"] in k.invariants]
        hits = [f for f in findings if f.get("known_failure") == k.id]
        examples = sum(r["examples"] for r in rows)
        # its corpus cases, where they ran on the kind of tier they were
        # recorded on: a "ranks" case needs real ranks, and a "fake" case is
        # evidence on the fake tier only (its world, 4 ranks by default: the
        # same case on a 2-rank pool is another case, and its PASS there
        # says nothing of whether the finding is fixed)
        checked = [c for c in corpus_runs if c["finding"] == k.id and c["invariant"] in k.invariants
                   and (c["case_tier"] == "fake") == (tier_info.get(c["tier"], {}).get("backend", c["tier"]) == "fake")]
        if not in_range(torch_version, k.torch):
            st = "other-torch"
        elif hits:
            st = "matched"
        elif checked and all(c["known"] for c in checked):
            # its minimal case ran but stopped at other findings: it no longer
            # shows this one either way (a stale case, or a new deviation in front)
            st = "masked"
            others = sorted({f for c in checked for f in c["known"]})
            warnings.append(f"the corpus case of known failure {k.id} showed only {', '.join(others)}: "
                            "it no longer isolates its finding (neither reproduced nor fixed)")
        elif checked:
            # its minimal case ran and torch no longer deviates: FIXED, whatever the baseline
            st = "fixed"
            for r in results:
                # the corpus cases are synthetic: a model's own row stays as it ran
                # and a case of one API says nothing of the other API's row
                if r["invariant"] in k.invariants and r["verdict"] == "PASS" and not r.get("model") and any(
                        c["tier"] == r["tier"] and case_api.get(c["case"], r.get("api")) == r.get("api") for c in checked):
                    r["verdict"] = "FIXED"
                    r["reason"] = f"the corpus case of known failure {k.id} no longer deviates"
        elif k.no_corpus:
            st = "unchecked"  # no corpus case (its entry says why): nothing to warn about
        elif examples == 0 or k.id in corpus_findings:
            # a finding with a corpus case is judged by that case alone; this
            # run did not select it
            st = "not-run"
        else:
            b = base_known.get(k.id)
            st = "fixed" if b is not None and examples >= b.get("examples", 0) else "unmatched"
            warnings.append(
                f"known failure {k.id} ({', '.join(sorted(k.invariants))}) matched nothing in this run"
                + (" (matched in the baseline: FIXED?)" if st == "fixed" else "")
            )
        known_out.append({
            "id": k.id,
            "torch": str(k.torch),
            "invariants": sorted(k.invariants),
            "summary": k.summary,
            "class": k.cls,
            "evidence": k.evidence,
            "evidence_source": k.evidence_source,
            "root_cause": k.root_cause.id if k.root_cause else None,
            "upstream": [u.to_dict() for u in k.upstream],
            "upstream_searched": k.upstream_searched,
            "upstream_note": k.upstream_note,
            "repro": k.repro,
            "status": st,
            "matches": sum(f["count"] for f in hits),
            "examples": examples,
        })

    known_status = {k["id"]: k["status"] for k in known_out}
    known_class = {k["id"]: k["class"] for k in known_out}
    for f in findings:
        if f.get("known_failure"):
            f["known_class"] = known_class.get(f["known_failure"])
    root_causes = []
    for rc_id, ks in known_mod.forms(known).items():
        rc = ks[0].root_cause
        root_causes.append({
            "id": rc_id, "explanation": rc.explanation if rc else "", "source": rc.source if rc else "",
            "forms": [k.id for k in ks], "matched": [k.id for k in ks if known_status[k.id] == "matched"],
        })
    matched = [k for k in known_out if k["status"] == "matched"]
    for c in corpus_runs:
        # per record: did this invariant show the case's finding? (whether
        # the finding is fixed is the known failure's status, over every record)
        c["outcome"] = (
            "FAIL" if any(v in FAILING_KINDS for v in c["verdicts"])
            else "reproduced" if c["finding"] and c["finding"] in c["known"]
            else "PASS"
        )
        c["finding_status"] = known_status.get(c["finding"]) if c["finding"] else None
    counts = {v: 0 for v in VERDICTS}
    for r in results:
        counts[r["verdict"]] += 1
    failed_tests = [t for t in tests if t["outcome"] == "failed"]
    snapshots = [t["snapshot"] if isinstance(t["snapshot"], str) else t["nodeid"] for t in failed_tests if t.get("snapshot")]
    failed = bool(counts["FAIL"] or failed_tests)
    report = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "complete": status == "complete",
        "status": status,
        "interrupted_by": interrupted_by,
        "started_at": started_at,
        "finished_at": finished_at,
        **env,
        "run": run,
        "baselines": baseline_paths or [],
        "summary": {
            "verdicts": counts,
            "examples": sum(r["examples"] for r in results),
            "seconds": round(sum(r["seconds"] for r in results), 3),
            "wall_seconds": round(wall_seconds, 3) if wall_seconds is not None else None,
            "findings": {k: sum(1 for f in findings if f["kind"] == k) for k in ("FAIL", "KNOWN", "HANG", "CRASH", "ERROR")},
            # the known failures this run matched, by class (bugs apart from
            # limitations and the rest), and the root causes they are forms of
            "known_by_class": {c: sum(1 for k in matched if k["class"] == c) for c in known_mod.CLASSES},
            "root_causes_matched": sum(1 for r in root_causes if r["matched"]),
            "tests": {
                "passed": sum(t["outcome"] == "passed" for t in tests),
                "failed": len(failed_tests),
                "skipped": sum(t["outcome"] == "skipped" for t in tests),
            },
            "failed": failed,
            "exit_status": 1 if failed else 0,
        },
        "results": results,
        "findings": findings,
        "known_failures": known_out,
        "root_causes": root_causes,
        "corpus": corpus_runs,
        "warnings": warnings,
        "tests": {"failed": failed_tests},
        "snapshots": {
            "failed": snapshots,
            "hint": (
                "expected-output snapshots differ: accept the new texts with "
                f"EXPECTTEST_ACCEPT=1 python -m pytest {' '.join(snapshots)}" if snapshots else None
            ),
        },
    }
    return report


# ---- loading -------------------------------------------------------------------


def load(path: str | os.PathLike, what: str = "report") -> dict:
    """A report (or baseline) from disk, checked enough to compare and render;
    ReportError (one line) otherwise."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ReportError(f"cannot read {what} {p}: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ReportError(f"{what} {p} is not valid JSON ({e})") from None
    return validate(data, f"{what} {p}")


def validate(data, where: str = "report") -> dict:
    if not isinstance(data, dict):
        raise ReportError(f"{where} must be a JSON object")
    if data.get("schema") != SCHEMA:
        raise ReportError(f"{where} is not an fsdp-conformance report (schema {data.get('schema')!r})")
    ver = data.get("schema_version")
    if not isinstance(ver, int) or ver > SCHEMA_VERSION or ver < 1:
        raise ReportError(f"{where} has schema_version {ver!r}; this suite reads 1..{SCHEMA_VERSION}")
    results = data.get("results")
    if not isinstance(results, list):
        raise ReportError(f"{where} has no 'results' list")
    for i, r in enumerate(results):
        if not isinstance(r, dict):
            raise ReportError(f"{where}: results[{i}] is not an object")
        for k, typ in (("invariant", str), ("api", str), ("tier", str), ("verdict", str), ("examples", int)):
            if not isinstance(r.get(k), typ):
                raise ReportError(f"{where}: results[{i}] lacks {k!r} ({typ.__name__})")
        if r["verdict"] not in VERDICTS:
            raise ReportError(f"{where}: results[{i}] has unknown verdict {r['verdict']!r}")
    if not isinstance(data.get("findings", []), list):
        raise ReportError(f"{where}: 'findings' is not a list")
    return data


def write_json(path: Path, data, *, indent: int | None = 1) -> None:
    """Write atomically: a reader sees the old file or the new one, never half.
    ``indent=None``: compact, for files only the suite reads (json's C
    encoder runs only without an indent: a full run's worker partial takes
    about 15 ms that way, 90 ms indented)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    text = json.dumps(data, indent=indent, sort_keys=False) if indent is not None else json.dumps(data, separators=(",", ":"))
    tmp.write_text(text + "\n")
    os.replace(tmp, path)


def write_text(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def finding_by_id(report: dict, fid: str) -> dict:
    for f in report.get("findings", []):
        if f.get("id") == fid:
            return f
    raise ReportError(f"no finding {fid!r} in the report (it has: {', '.join(f.get('id', '?') for f in report.get('findings', [])) or 'none'})")


if __name__ == "__main__":  # pragma: no cover
    json.dump({"suite": suite_info(), "torch": torch_info(), "platform": platform_info()}, sys.stdout, indent=1)
