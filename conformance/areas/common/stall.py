"""A hang seen as it happens: every rank of the example blocked in a
collective of a gloo group of the example's own, none using CPU.

A rank-divergent case (a collective one rank never enters) used to show
its hang at its group's timeout only, seconds per example that waited on
nothing: while every rank sleeps in a collective and none uses CPU, no rank
can ever wake another. ``StallGuard`` watches the ranks (all on this host)
from a thread of each rank and, once they have all slept that way for
``stall`` seconds, shuts the group's connections down: each rank's pending
collective on the group then raises at once, as its timeout would have
made it raise later. A rank that is slow, not blocked, is runnable or uses
CPU, so it is never taken for a hang: a sample counts only when every
rank's main thread sleeps (state S) and no rank's CPU time grew, and a gap
between samples (a machine that stopped running this thread) starts the
count again. The group's timeout stays the fallback (another backend,
ranks on several hosts, a rank that cannot be read).

gloo only: closing a pair's socket is how gloo learns that its peer went
away ("Connection closed by peer"); NCCL groups keep their timeout."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

import torch.distributed as dist

from conformance.engine.pool import cpu_of, proc_stat

INTERVAL = 0.05  # seconds between samples
STALL = 1.0  # seconds every rank must sleep without CPU before the group is shut
# CPU seconds a rank may gain over a stall and still count as asleep: the
# clock tick (10 ms) that another thread of it (this guard's) may be charged
CPU_SLACK = 0.02
_PEERS: list = []  # [the default group, the ranks' pids or None]


def _socket_fds() -> set[int]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                out.add(int(fd))
        except (OSError, ValueError):
            pass
    return out


def new_group(timeout) -> tuple[object, tuple[int, ...]]:
    """``dist.new_group(timeout=...)`` and the socket fds it opened in this
    process (gloo connects its pairs when the group is made)."""
    before = _socket_fds()
    group = dist.new_group(timeout=timeout)
    return group, tuple(sorted(_socket_fds() - before))


def _rank_pids() -> tuple[int, ...] | None:
    """Every rank's pid, where every rank runs on this host (else None):
    gathered once per rank process, on the default group, by every rank at
    the same point (the first guarded example)."""
    world = dist.distributed_c10d._get_default_group()
    if not _PEERS or _PEERS[0] is not world:
        got: list = [None] * dist.get_world_size()
        dist.all_gather_object(got, (socket.gethostname(), os.getpid()))
        local = all(h == socket.gethostname() for h, _ in got)
        _PEERS[:] = [world, tuple(p for _, p in got) if local else None]
    return _PEERS[1]


def _sample(pids) -> tuple[bool, float] | None:
    """(every main thread asleep, CPU seconds of all ranks), or None where a
    rank cannot be read (gone: not a stall to judge)."""
    asleep, cpu = True, 0.0
    for pid in pids:
        fields = proc_stat(pid)
        used = cpu_of(fields)
        if used is None:
            return None
        asleep = asleep and fields[0] == b"S"
        cpu += used
    return asleep, cpu


class StallGuard:
    """While entered: watch every rank; after ``stall`` seconds of all of
    them asleep without CPU, shut the group's connections down (``fired``,
    ``stalled_for``). Inactive (never fires) on another backend than gloo,
    with no sockets, or where the ranks are not all on this host."""

    def __init__(self, group, fds: tuple[int, ...], *, stall: float = STALL, interval: float = INTERVAL) -> None:
        self.fds = fds
        self.stall = stall
        self.interval = interval
        self.fired = False
        self.stalled_for = 0.0
        gloo = group is not None and dist.get_backend(group) == "gloo"
        # every rank decides alike (the pids are a collective); its own fds after
        pids = _rank_pids() if gloo and dist.get_world_size() > 1 else None
        self.pids = pids if fds else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "StallGuard":
        if self.pids:
            self._thread = threading.Thread(target=self._watch, name="conformance-stall-guard", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        since = base = last = None
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            s = _sample(self.pids)
            gap = last is not None and now - last > 4 * self.interval
            last = now
            if s is None or not s[0] or gap or since is None or s[1] - base > CPU_SLACK * len(self.pids):
                since, base = now, (s[1] if s else 0.0)
                continue
            if now - since >= self.stall:
                self.stalled_for = now - since
                self.fired = True
                self._shut()
                return

    def _shut(self) -> None:
        """Shut down the group's connected sockets (never its listener:
        gloo aborts the process on a failed accept)."""
        for fd in self.fds:
            with contextlib.suppress(OSError):
                s = socket.socket(fileno=os.dup(fd))
                try:
                    s.getpeername()
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                finally:
                    s.close()
