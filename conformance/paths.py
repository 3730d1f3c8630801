"""Where the files the package ships live (the conformance suite, the
baselines, known failures), and where a run writes by default: all relative
to the installed package or the current directory, never to a checkout."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
SUITE = PACKAGE / "suite"  # the conformance tests, one module per area
# the committed baselines (reports/baselines in a checkout links here)
BASELINES = PACKAGE / "baselines"
KNOWN_FAILURES = PACKAGE / "known_failures.toml"


def default_report_dir(base: Path | None = None) -> Path:
    """reports/latest under ``base`` (default: the current directory)."""
    return (base or Path.cwd()) / "reports" / "latest"


def shown(p) -> str:
    """``p`` relative to the current directory where it lies below it, else
    absolute (for messages and the report's baseline paths)."""
    p = Path(p).resolve()
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return str(p)


# Where the checkpoints of a run's drawn examples go (a round trip's DCP
# directory, HSDP's and TP's save-and-load): a RAM-backed filesystem where
# the machine has one with room. DCP's FileSystemWriter writes and fsyncs a
# file per rank and the metadata; the drawn models' checkpoints are
# kilobytes, and a save and load of one (eight 16x16 tensors, one process)
# took 6.3-6.9 ms on /dev/shm against 7.9-10.3 ms on this machine's disk
# (2026-12-07, three rounds of 40). A real model's checkpoint (``small=False``)
# goes to $TMPDIR: it can be gigabytes, and a container's /dev/shm is 64 MiB
# by default (a full one would make the save raise: a false deviation).
# FSDP_CONFORMANCE_SCRATCH names the directory for both.
SCRATCH_ENV = "FSDP_CONFORMANCE_SCRATCH"
_RAM_DIRS = ("/dev/shm",)
_RAM_MIN_FREE = 1 << 30  # bytes free in a RAM directory for it to be used


def scratch_root(*, small: bool = True) -> str | None:
    """The directory checkpoint scratch directories are made in:
    $FSDP_CONFORMANCE_SCRATCH, else for ``small`` checkpoints the first
    writable RAM-backed directory with 1 GiB free, else None (tempfile's
    default, $TMPDIR)."""
    chosen = os.environ.get(SCRATCH_ENV)
    if chosen:
        return chosen
    for d in _RAM_DIRS if small else ():
        if os.path.isdir(d) and os.access(d, os.W_OK | os.X_OK) and _free(d) >= _RAM_MIN_FREE:
            return d
    return None


def _free(path: str) -> int:
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def scratch_dir(prefix: str, *, small: bool = True) -> str:
    """A new, empty directory for one example's checkpoint (the caller
    removes it; ``small``: a drawn case's, see scratch_root), named
    ``<prefix><pid>-``: the first call of a process also removes the
    ``prefix`` directories of processes no longer alive there (a run killed
    with SIGKILL removes none of its own, and on /dev/shm they would hold
    memory until the machine restarts)."""
    root = scratch_root(small=small)
    _sweep_once(root if root is not None else tempfile.gettempdir(), prefix)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=root)


_swept: set[tuple[str, str]] = set()


def _sweep_once(root: str, prefix: str) -> None:
    if (root, prefix) in _swept:
        return
    _swept.add((root, prefix))
    try:
        names = os.listdir(root)
    except OSError:
        return
    now = time.time()
    for name in names:
        pid = name[len(prefix):].split("-", 1)[0] if name.startswith(prefix) else ""
        path = os.path.join(root, name)
        # and untouched for STALE_AFTER: a pid this process cannot see may be
        # a live run's in another PID namespace sharing the directory, whose
        # examples end within their deadlines
        if pid.isdigit() and not _alive(int(pid)) and _age(path, now) > STALE_AFTER:
            shutil.rmtree(path, ignore_errors=True)


STALE_AFTER = 600.0  # seconds


def _age(path: str, now: float) -> float:
    try:
        return now - os.stat(path).st_mtime
    except OSError:
        return 0.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
