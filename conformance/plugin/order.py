"""Slowest first (``--slowest-first``, which ``fsdp-conformance run -n N``
passes): the conformance tests in the order of the durations recorded in
conformance/suite/durations.json (``--store-durations``), the longest first.
A run's wall time is its busiest xdist worker's: with the long tests last,
one worker idles while the other finishes them (measured: 18 s of an 84 s
``run --profile ci -n 2`` with test_schedule[gloo] last). A test the file
does not name keeps its place after those it does; a stale file makes the
order worse, never a result different.

Only xdist workers sort: in one process the order changes no wall time,
only what a run cut short reaches first (a hunt's time limit, a mutant's
first failing test). ci/test.sh does not ask: its self-tests and
conformance tests were balanced on its two workers already, and sorted,
the long multi-process tests running side by side made it slower (498 and
510 s against 447 s)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from conformance import paths

DURATIONS = paths.SUITE / "durations.json"
# shorter tests are not recorded: where they run does not change the wall time
MIN_SECONDS = 0.5


def key(path: str | os.PathLike, nodeid: str) -> str:
    """A test's name in the file whatever pytest's rootdir: its file relative
    to the directory that holds the package (a checkout's root), then the
    rest of its node id (``conformance/suite/test_schedule.py::test_schedule_fsdp2[gloo]``)."""
    rel = os.path.relpath(Path(path).resolve(), paths.PACKAGE.parent).replace(os.sep, "/")
    return "::".join([rel, *nodeid.split("::")[1:]])


def load(path: Path = DURATIONS) -> dict[str, float]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(v, (int, float))} if isinstance(data, dict) else {}


def order(items: list, durations: dict[str, float]) -> None:
    """Sort ``items`` in place, longest recorded duration first (stable: the
    rest keep pytest's order). Every xdist worker sorts the same way, as
    xdist requires."""
    if durations:
        items.sort(key=lambda it: -durations.get(key(it.path, it.nodeid), 0.0))


def _exists(k: str) -> bool:
    """Whether the test a key names is still in its file: the file, and a
    function of that name defined in it (read, not imported)."""
    file, _, rest = k.partition("::")
    try:
        text = (paths.PACKAGE.parent / file).read_text()
    except OSError:
        return False
    name = rest.split("::")[-1].split("[")[0]
    return re.search(rf"^\s*(?:async\s+)?def {re.escape(name)}\(", text, re.MULTILINE) is not None


def store(measured: dict[str, float], path: Path = DURATIONS) -> dict[str, float]:
    """Merge ``measured`` (key -> seconds) into the file: a run of some
    tests leaves the others' entries; an entry whose test is gone (its file,
    or its function in the file: a renamed or split test), or that is now
    shorter than MIN_SECONDS, is dropped."""
    merged = {k: v for k, v in load(path).items() if _exists(k)}
    merged.update(measured)
    merged = {k: round(v, 2) for k, v in sorted(merged.items()) if v >= MIN_SECONDS}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(merged, indent=1) + "\n")
    os.replace(tmp, path)
    return merged


class Recorder:
    """Sums each test's setup, call and teardown durations as the reports
    reach the controller (or the only process), and stores them at the end."""

    def __init__(self, rootpath: Path, path: Path = DURATIONS) -> None:
        self.rootpath, self.path = rootpath, path
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report) -> None:
        k = key(self.rootpath / report.nodeid.split("::")[0], report.nodeid)
        self.seconds[k] = self.seconds.get(k, 0.0) + report.duration

    def pytest_sessionfinish(self, session) -> None:
        if not hasattr(session.config, "workerinput"):  # the controller writes, not each xdist worker
            store(self.seconds, self.path)
