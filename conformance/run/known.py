"""Known failures: findings against released torch, matched by invariant ID,
torch version range and the tags of a violation; each with its class (bug,
implicit, diagnostic, limitation, enhancement) and evidence, its root cause
(shared by the findings that are its forms) and its upstream issues and PRs."""

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


# What a finding is, as an FSDP maintainer triages it (known_failures.toml's header)
CLASSES = ("bug", "implicit", "diagnostic", "limitation", "enhancement")
# the classes that break a promise FSDP makes (documented or reasonably implied);
# the others are documented limitations, unhelpful errors or wishes
PROMISE_CLASSES = ("bug", "implicit")
UPSTREAM_KINDS = ("issue", "pr")
UPSTREAM_STATES = ("open", "closed", "merged")


@dataclass(frozen=True)
class Upstream:
    repo: str  # "pytorch/pytorch"
    number: int
    kind: str  # issue | pr
    title: str
    state: str  # open | closed | merged
    fixed_in: str = ""  # the release that fixed it, "" where none did

    @property
    def url(self) -> str:
        return f"https://github.com/{self.repo}/{'pull' if self.kind == 'pr' else 'issues'}/{self.number}"

    @property
    def label(self) -> str:
        return f"{self.repo.split('/')[-1]}#{self.number}"

    def to_dict(self) -> dict:
        return {"repo": self.repo, "number": self.number, "kind": self.kind, "title": self.title, "state": self.state,
                "fixed_in": self.fixed_in, "url": self.url}


@dataclass(frozen=True)
class RootCause:
    id: str
    explanation: str  # the mechanism, pointing into torch's source
    source: str  # file: function, ...


@dataclass(frozen=True)
class KnownFailure:
    id: str
    torch: SpecifierSet
    matches_: tuple[Match, ...]
    summary: str
    repro: str
    cls: str = "bug"  # one of CLASSES
    title: str = ""  # as a GitHub issue's: [API] what goes wrong
    evidence: str = ""
    evidence_source: str = ""
    root_cause: RootCause | None = None
    upstream: tuple[Upstream, ...] = ()
    upstream_searched: str = ""  # the date upstream was searched
    upstream_note: str = ""
    # why the regression corpus has no case for it (a finding seen on a real
    # model that no CaseSpec expresses yet, or that no invariant observes yet)
    no_corpus: str = ""

    @property
    def breaks_promise(self) -> bool:
        """A bug or an implicit promise broken; otherwise a documented
        limitation, a diagnostic or an enhancement (reported under its class)."""
        return self.cls in PROMISE_CLASSES

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


def _upstream(fid: str, u: dict) -> Upstream:
    out = Upstream(u["repo"], int(u["number"]), u["kind"], u["title"], u["state"], u.get("fixed_in", ""))
    if out.kind not in UPSTREAM_KINDS or out.state not in UPSTREAM_STATES or "/" not in out.repo:
        raise KnownFailuresError(f"finding {fid}: upstream {out.label}: kind one of {UPSTREAM_KINDS}, state one of {UPSTREAM_STATES}, "
                                 "repo owner/name")
    return out


_LOADED: dict[tuple, list[KnownFailure]] = {}


def load(path: Path = DEFAULT_PATH) -> list[KnownFailure]:
    """The findings of ``path``, validated; parsed once per content (a file
    edited since is read again): the file is ~5,000 lines, 0.3-0.5 s to
    parse and check, and a test process asks for it hundreds of times."""
    try:
        st = Path(path).stat()
    except OSError as e:
        raise KnownFailuresError(f"{path}: {e}") from None
    key = (str(Path(path).resolve()), st.st_mtime_ns, st.st_size)
    if key not in _LOADED:
        _LOADED[key] = _load(path)
    return list(_LOADED[key])  # the entries are frozen; the list is the caller's


def _load(path: Path) -> list[KnownFailure]:
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise KnownFailuresError(f"{path}: {e}") from None
    try:
        roots = {r["id"]: RootCause(r["id"], r["explanation"].strip(), r["source"].strip()) for r in data.get("root_cause", [])}
    except KeyError as e:
        raise KnownFailuresError(f"{path}: a [[root_cause]] lacks {e}") from None
    out = []
    for i, entry in enumerate(data.get("finding", [])):
        try:
            fid = entry["id"]
            if entry["class"] not in CLASSES:
                raise KnownFailuresError(f"{path}: finding {fid}: class {entry['class']!r} is not one of {', '.join(CLASSES)}")
            if entry["root_cause"] not in roots:
                raise KnownFailuresError(f"{path}: finding {fid}: root_cause {entry['root_cause']!r} has no [[root_cause]]")
            if not entry["evidence"].strip() or not entry["upstream_searched"] or not entry["title"].strip():
                raise KnownFailuresError(f"{path}: finding {fid}: title, evidence and upstream_searched must not be empty")
            out.append(
                KnownFailure(
                    id=fid,
                    torch=SpecifierSet(entry["torch"]),
                    matches_=tuple(Match(m["invariant"], frozenset(m.get("when", []))) for m in entry["match"]),
                    summary=entry["summary"].strip(),
                    repro=entry["repro"],
                    cls=entry["class"],
                    title=entry["title"].strip(),
                    evidence=entry["evidence"].strip(),
                    evidence_source=entry.get("evidence_source", "").strip(),
                    root_cause=roots[entry["root_cause"]],
                    upstream=tuple(_upstream(fid, u) for u in entry.get("upstream", [])),
                    upstream_searched=str(entry["upstream_searched"]),
                    upstream_note=entry.get("upstream_note", "").strip(),
                    no_corpus=entry.get("no_corpus", ""),
                )
            )
        except (KeyError, InvalidSpecifier, TypeError, ValueError) as e:
            if isinstance(e, KnownFailuresError):
                raise
            raise KnownFailuresError(f"{path}: finding #{i + 1} is malformed ({type(e).__name__}: {e})") from None
    unused = set(roots) - {k.root_cause.id for k in out}
    if unused:
        raise KnownFailuresError(f"{path}: [[root_cause]] {sorted(unused)} named by no finding")

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
    """The first finding in file order that explains ``v`` at this release.
    Matching at every release (the release matrix, ANY_RELEASE_ENV), a finding
    whose range holds the release still wins over one whose range does not: a
    broad out-of-range form (a gloo collective bug fixed two releases back)
    must not take a violation that an in-range finding explains."""
    here = next((k for k in known if in_range(torch_version, k.torch) and k.matches_tags(v)), None)
    if here is not None or os.environ.get(ANY_RELEASE_ENV) != "1":
        return here
    return next((k for k in known if k.matches_tags(v)), None)


def forms(known: list[KnownFailure]) -> dict[str, list[KnownFailure]]:
    """Root cause id -> the findings that are its forms, in file order."""
    out: dict[str, list[KnownFailure]] = {}
    for k in known:
        out.setdefault(k.root_cause.id if k.root_cause else k.id, []).append(k)
    return out


def findings_summary(known: list[KnownFailure] | None = None) -> str:
    """The README's findings block (Markdown): the findings by class, the
    root causes they are forms of, and the upstream links recorded; made
    from known_failures.toml, checked against the README by a test."""
    known = load() if known is None else known
    by_class = {c: [k for k in known if k.cls == c] for c in CLASSES}
    roots: dict[str, list[KnownFailure]] = {}
    for k in known:
        roots.setdefault(k.root_cause.id if k.root_cause else k.id, []).append(k)
    several = {r: ks for r, ks in roots.items() if len(ks) > 1}
    links = {u.url for k in known for u in k.upstream}
    lines = [f"{len(known)} findings in `conformance/known_failures.toml`: "
             + ", ".join(f"{len(ks)} {c}" for c, ks in by_class.items() if ks)
             + f" ({sum(len(by_class[c]) for c in PROMISE_CLASSES)} break a promise FSDP makes, documented or implied);"
             f" forms of {len(roots)} root causes, {len(several)} of them with several forms;"
             f" {len(links)} upstream issues and PRs linked, {sum(1 for k in known if not k.upstream)} findings with none found.",
             "", "| root cause | its forms |", "| --- | --- |"]
    for r, ks in sorted(several.items(), key=lambda x: (-len(x[1]), x[0])):
        lines.append(f"| `{r}` | " + ", ".join(f"`{k.id}` ({k.cls})" for k in ks) + " |")
    return "\n".join(lines) + "\n"
