"""One conformance session: runs cases, records verdicts per invariant and
tier, writes repro scripts for failures and known findings."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from conformance import known as known_mod
from conformance.report.repro import repro_script
from conformance.runner import FAIL, KNOWN, PASS, CaseResult, check_case
from conformance.spec import CaseSpec, walk

EXPECTTEST_HINT = "expected-output snapshots: rerun with EXPECTTEST_ACCEPT=1 to accept new texts"


@dataclass
class Tally:
    invariant: str
    tier: str
    examples: int = 0
    verdicts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    # finding id (or "FAIL") -> (smallest spec seen, violation text)
    findings: dict[str, tuple[CaseSpec, str]] = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        for v in (FAIL, "HANG", "CRASH", KNOWN):
            if self.verdicts.get(v):
                return v
        return PASS


def size(spec: CaseSpec) -> int:
    return sum(1 for _ in walk(spec.tree))


class Session:
    def __init__(self, repro_dir: Path | None = None, known_path: Path = known_mod.DEFAULT_PATH):
        self.known = known_mod.load(known_path)
        self.tallies: dict[tuple[str, str], Tally] = {}
        self.repro_dir = repro_dir

    def tally(self, invariant: str, tier: str) -> Tally:
        return self.tallies.setdefault((invariant, tier), Tally(invariant, tier))

    def record(self, res: CaseResult, tier: str, seconds: float) -> None:
        t = self.tally(res.invariant, tier)
        t.examples += 1
        t.seconds += seconds
        t.verdicts[res.verdict] = t.verdicts.get(res.verdict, 0) + 1
        keys = [(fid, str(v)) for v, fid in res.known]
        if res.violations:
            keys.append(("FAIL", str(res.violations[0])))
        for key, text in keys:
            old = t.findings.get(key)
            if old is None or size(res.spec) < size(old[0]):
                t.findings[key] = (res.spec, text)

    def check(self, invariant: str, spec: CaseSpec, engine, tier: str) -> CaseResult:
        """Run one example; raise AssertionError (with the spec as Python and
        a repro script's path as notes) when FSDP breaks the invariant."""
        t0 = time.perf_counter()
        res = check_case(invariant, spec, engine, self.known)
        self.record(res, tier, time.perf_counter() - t0)
        if res.verdict == FAIL:
            err = AssertionError(res.describe())
            err.add_note("Case (paste into Python):\n" + spec.to_python())
            path = self.write_repro(spec, res)
            if path:
                err.add_note(f"Standalone torch-only repro: {path}")
            raise err
        return res

    def write_repro(self, spec: CaseSpec, res: CaseResult) -> Path | None:
        if self.repro_dir is None:
            return None
        self.repro_dir.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha1(spec.to_json().encode()).hexdigest()[:10]
        path = self.repro_dir / f"{res.invariant}-{digest}.py"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(repro_script(spec, res.violations + [v for v, _ in res.known], title=res.invariant))
        tmp.replace(path)
        return path

    def unused_known(self) -> list[known_mod.KnownFailure]:
        """Known failures for this torch whose invariant ran but never matched."""
        ran = {inv for inv, _ in self.tallies}
        hit = {fid for t in self.tallies.values() for fid in t.findings}
        return [
            k for k in self.known
            if k.invariants & ran and k.id not in hit and known_mod._in_range(torch.__version__, k.torch)
        ]
