"""The regression corpus: the minimal case of every known finding (and of
every case that once exposed a suite bug), stored as data and checked first
on every run, whatever the profile or seed.

Each case is one JSON file in this directory:

    {"finding": "<known failure id>" | null, "invariants": ["ID", ...],
     "tier": "fake" | "ranks", "why": "...", "spec": {CaseSpec JSON}}

The conformance tests attach the cases of their invariants as Hypothesis
explicit examples (``@corpus.examples(...)``). Explicit examples run before
any drawn example, in every profile and under every seed (the ``explicit``
phase is never skipped by ``derandomize`` or by the database), and a failing
one fails its test like any other example; the example database, by
contrast, may be absent (the ci profile has none) or hold other cases.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from hypothesis import example

from conformance.case.spec import CaseSpec, SpecError

DEFAULT_DIR = Path(__file__).resolve().parent
ENV_VAR = "FSDP_CONFORMANCE_CORPUS"  # another corpus directory (tests of the suite)
TIERS = ("fake", "ranks")  # "ranks": real rank processes (gloo / nccl)


class CorpusError(ValueError):
    pass


@dataclass(frozen=True)
class CorpusCase:
    name: str  # file stem
    finding: str | None  # the known failure this case reproduces; None: a suite-bug case
    invariants: tuple[str, ...]  # the invariants whose tests run it
    tier: str  # where it reproduces: "fake" (any tier) or "ranks" (real ranks only)
    why: str
    spec: CaseSpec

    @property
    def digest(self) -> str:
        return spec_digest(self.spec)


def spec_digest(spec: CaseSpec) -> str:
    return hashlib.sha1(spec.to_json().encode()).hexdigest()


def directory() -> Path:

    return Path(os.environ.get(ENV_VAR) or DEFAULT_DIR)


@lru_cache(maxsize=None)
def load(path: Path | None = None) -> tuple[CorpusCase, ...]:
    """Every case in ``path`` (default: this package's), sorted by name."""
    root = Path(path) if path is not None else directory()
    out = []
    for f in sorted(root.glob("*.json")):
        try:
            d = json.loads(f.read_text())
            spec = CaseSpec.from_json(json.dumps(d["spec"]))
            case = CorpusCase(f.stem, d.get("finding"), tuple(d["invariants"]), d.get("tier", "fake"), d.get("why", ""), spec)
        except (OSError, ValueError, KeyError, TypeError, SpecError) as e:
            raise CorpusError(f"corpus case {f}: {type(e).__name__}: {e}") from None
        if case.tier not in TIERS:
            raise CorpusError(f"corpus case {f}: tier must be one of {TIERS}, got {case.tier!r}")
        out.append(case)
    return tuple(out)


def by_spec() -> dict[CaseSpec, CorpusCase]:
    """The corpus by its (hashable, immutable) specs: an example's case is
    found without encoding it."""
    return {c.spec: c for c in load()}


def cases_for(*invariants: str) -> list[CorpusCase]:
    wanted = set(invariants)
    return [c for c in load() if wanted & set(c.invariants)]


def examples(*invariants: str, argname: str = "spec", api: str | None = None):
    """A decorator adding the corpus cases of ``invariants`` to a @given test
    as explicit examples (apply it above @given); ``api``: only the cases
    whose plan is that API's (a test that draws one API)."""

    def deco(test):
        for case in reversed(cases_for(*invariants)):
            if api is None or case.spec.plan.api == api:
                test = example(**{argname: case.spec})(test)
        return test

    return deco


def write(case_dir: Path, name: str, spec: CaseSpec, invariants: list[str], finding: str | None, tier: str, why: str) -> Path:
    """Store a case (atomically), e.g. a report finding's case (README: the regression corpus)."""
    case_dir = Path(case_dir)
    case_dir.mkdir(parents=True, exist_ok=True)
    path = case_dir / f"{name}.json"
    body = {"finding": finding, "invariants": list(invariants), "tier": tier, "why": why, "spec": json.loads(spec.to_json())}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(body, indent=1, sort_keys=False) + "\n")
    tmp.replace(path)
    load.cache_clear()
    return path
