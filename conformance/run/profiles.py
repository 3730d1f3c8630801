"""Hypothesis profiles (dev, ci, thorough, hunt), the example database, and
the one place that loads them."""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase, MultiplexedDatabase, ReadOnlyDatabase

ENV_VAR = "FSDP_CONFORMANCE_PROFILE"
DATABASE_VAR = "FSDP_CONFORMANCE_DATABASE"  # where found examples are kept (see database_from)
SHRINK_VAR = "FSDP_CONFORMANCE_SHRINK"  # "0": no shrinking (mutant runs, conformance.selfcheck.mutants)
REPLAY_VAR = "FSDP_CONFORMANCE_REPLAY"  # "1": only the corpus and the database's examples, nothing drawn
PROFILES = ("dev", "ci", "thorough", "hunt")
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
GITHUB_ARTIFACT = "fsdp-conformance-examples"


class DatabaseError(ValueError):
    pass


def database_from(url: str):
    """An ExampleDatabase from a string: a directory; ``github:OWNER/REPO``
    (the examples a CI workflow uploaded as the artifact
    fsdp-conformance-examples, read-only, over a local directory
    $FSDP_CONFORMANCE_DATABASE_CACHE or .fsdp-conformance-db that new finds go
    to); ``redis://HOST:PORT[/N]`` (a fleet sharing one Redis; needs the redis
    package); ``none``."""

    if url == "none":
        return None
    if url.startswith("github:"):
        from hypothesis.database import GitHubArtifactDatabase

        owner, _, repo = url[len("github:"):].partition("/")
        if not owner or not repo or "/" in repo:
            raise DatabaseError(f"example database {url!r}: expected github:OWNER/REPO")
        local = DirectoryBasedExampleDatabase(os.environ.get(f"{DATABASE_VAR}_CACHE", ".fsdp-conformance-db"))
        return MultiplexedDatabase(local, ReadOnlyDatabase(GitHubArtifactDatabase(owner, repo, artifact_name=GITHUB_ARTIFACT)))
    if url.startswith("redis://"):
        try:
            import redis
            from hypothesis.extra.redis import RedisExampleDatabase
        except ImportError:
            raise DatabaseError(f"example database {url!r}: needs the redis package (pip install redis)") from None
        return RedisExampleDatabase(redis.Redis.from_url(url), key_prefix=b"fsdp-conformance:")
    if "://" in url:
        raise DatabaseError(f"example database {url!r}: expected a directory, github:OWNER/REPO, redis://HOST:PORT or none")
    path = Path(url)
    if path.exists() and not path.is_dir():
        raise DatabaseError(f"example database {url!r} is a file, not a directory")
    return DirectoryBasedExampleDatabase(str(path))


def register() -> None:
    settings.register_profile("dev", max_examples=30, deadline=None, suppress_health_check=_SLOW_OK)
    # Hypothesis's own "ci" profile (derandomized, no database, print_blob)
    # with the suite's example budget.
    settings.register_profile(
        "ci",
        parent=settings.get_profile("ci"),
        max_examples=500,
        deadline=None,
        suppress_health_check=_SLOW_OK,
    )
    settings.register_profile("thorough", max_examples=3000, deadline=None, suppress_health_check=_SLOW_OK)
    # Hunting: random whatever CI says (Hypothesis derandomizes under CI=true),
    # a round's budget per test, every phase (the database's finds replay first).
    settings.register_profile(
        "hunt",
        max_examples=50,
        deadline=None,
        derandomize=False,
        print_blob=True,
        suppress_health_check=_SLOW_OK,
    )


def selected(option: str | None = None) -> str:
    name = option or os.environ.get(ENV_VAR) or "dev"
    if name not in PROFILES:
        raise ValueError(f"unknown Hypothesis profile {name!r} (choose from {', '.join(PROFILES)})")
    return name


def activate(name: str, *, seeded: bool = False) -> None:
    """Load ``name``. Import torch's test utilities first: importing them
    registers and loads torch's own profile, which must not win. With
    $FSDP_CONFORMANCE_DATABASE set, the profile keeps its examples there.
    ``seeded``: a seed was given (--hypothesis-seed): the profile is not
    derandomized, or Hypothesis would ignore the seed and draw the same
    examples whatever it is (the ci profile)."""
    import torch.testing._internal.common_utils  # noqa: F401

    register()
    if seeded and settings.get_profile(name).derandomize:
        settings.register_profile(f"{name}-seeded", parent=settings.get_profile(name), derandomize=False)
        name = f"{name}-seeded"
    url = os.environ.get(DATABASE_VAR)
    if url:
        settings.register_profile(f"{name}-db", parent=settings.get_profile(name), database=database_from(url))
        name = f"{name}-db"
    if os.environ.get(REPLAY_VAR) == "1":
        from hypothesis import Phase

        settings.register_profile(f"{name}-replay", parent=settings.get_profile(name), phases=[Phase.explicit, Phase.reuse])
        name = f"{name}-replay"
    if os.environ.get(SHRINK_VAR) == "0":  # a mutant is killed by one failing example, not the smallest
        from hypothesis import Phase

        settings.register_profile(f"{name}-noshrink", parent=settings.get_profile(name),
                                  phases=[p for p in Phase if p not in (Phase.shrink, Phase.explain)])
        name = f"{name}-noshrink"
    settings.load_profile(name)
