"""Known failures: findings against released torch, matched by invariant ID,
torch version range and the tags of a violation."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from conformance import paths
from conformance.case.violation import Violation

DEFAULT_PATH = paths.KNOWN_FAILURES
# The release matrix (ci/matrix.py) sets this: a known failure then matches at
# any torch release, so that each release's baseline names every finding it
# shows (an unrecognised FAIL would stop Hypothesis on that invariant and hide
# the others); the matrix page applies the real ranges afterwards.
ANY_RELEASE_ENV = "FSDP_CONFORMANCE_KNOWN_ANY_RELEASE"


class KnownFailuresError(ValueError):
    pass


@dataclass(frozen=True)
class Match:
    invariant: str
    when: frozenset[str]  # every tag must be on the violation


@dataclass(frozen=True)
class KnownFailure:
    id: str
    torch: SpecifierSet
    matches_: tuple[Match, ...]
    summary: str
    repro: str
    upstream: str = ""
    # why the regression corpus has no case for it (a finding seen on a real
    # model that no CaseSpec expresses yet, or that no invariant observes yet)
    no_corpus: str = ""

    @property
    def invariants(self) -> set[str]:
        return {m.invariant for m in self.matches_}

    def matches(self, v: Violation, torch_version: str) -> bool:
        return (os.environ.get(ANY_RELEASE_ENV) == "1" or in_range(torch_version, self.torch)) and self.matches_tags(v)

    def matches_tags(self, v: Violation) -> bool:
        return any(
            v.invariant == m.invariant and m.when <= v.tags for m in self.matches_
        )


def in_range(torch_version: str, spec: SpecifierSet) -> bool:
    # "2.13.0+cpu" -> 2.13.0; nightlies ("2.15.0.dev20261101") count as their release
    base = Version(torch_version.split("+")[0])
    return spec.contains(Version(base.base_version), prereleases=True)


def _upstream_link(upstream) -> str:
    """The link a report shows: a finding's ``upstream`` URL, or the first of
    its ``[[finding.upstream]]`` tables (repo, number, kind)."""
    if isinstance(upstream, list):
        if not upstream:
            return ""
        u = upstream[0]
        return f"https://github.com/{u['repo']}/{'pull' if u.get('kind') == 'pr' else 'issues'}/{u['number']}"
    return upstream


def load(path: Path = DEFAULT_PATH) -> list[KnownFailure]:
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise KnownFailuresError(f"{path}: {e}") from None
    out = []
    for i, entry in enumerate(data.get("finding", [])):
        try:
            out.append(
                KnownFailure(
                    id=entry["id"],
                    torch=SpecifierSet(entry["torch"]),
                    matches_=tuple(Match(m["invariant"], frozenset(m.get("when", []))) for m in entry["match"]),
                    summary=entry["summary"].strip(),
                    repro=entry["repro"],
                    upstream=_upstream_link(entry.get("upstream", "")),
                    no_corpus=entry.get("no_corpus", ""),
                )
            )
        except (KeyError, InvalidSpecifier) as e:
            raise KnownFailuresError(f"{path}: finding #{i + 1} is malformed ({type(e).__name__}: {e})") from None

    # the catalog imports torch and the areas: the report reads known failures without them otherwise
    from conformance.areas import CATALOG

    for k in out:
        unknown = k.invariants - set(CATALOG)
        if unknown:
            raise KnownFailuresError(f"{path}: finding {k.id} names unknown invariant(s) {sorted(unknown)}")
        if not k.matches_:
            raise KnownFailuresError(f"{path}: finding {k.id} has no [[finding.match]]")
    ids = [k.id for k in out]
    if len(set(ids)) != len(ids):
        raise KnownFailuresError(f"{path}: duplicate finding ids")
    return out


def match(v: Violation, known: list[KnownFailure], torch_version: str) -> KnownFailure | None:
    return next((k for k in known if k.matches(v, torch_version)), None)
