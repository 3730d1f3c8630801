"""The suite's own agreement between the ranks of a pool, beside the
process group: each rank sends a number to every other rank and gets
theirs (conformance.areas.common.ranks: whether any rank failed at a point
of the schedule, whether every rank saw the same thing).

A pool's ranks run on one host, so this goes over Unix datagram sockets
(abstract names on Linux, files in the pool's folder elsewhere) instead of a gloo all-reduce: about 15 µs a round
against gloo's 0.3 ms on an idle machine here and 1-2 ms under the suite's
load (its TCP loop thread has to be scheduled), and an autowrap example
agrees once, a schedule one about nine times. Elsewhere (torchrun, the
driver's own world, a default group made after the pool's) ``channel()``
is None and the callers all-reduce on a gloo group as before.

Every rank calls ``exchange`` at the same points, in the same order (as
an all-reduce would need); each message carries its round, so a rank one
round ahead never mixes with the round before."""

from __future__ import annotations

import os
import socket
import struct
import sys

_MSG = struct.Struct("<qqq")  # round, rank, value
_CHANNEL: list = []  # [the default group it was made for, the channel]


class AgreementError(RuntimeError):
    pass


class Channel:
    def __init__(self, rank: int, world_size: int, paths: list[str], sock: socket.socket, timeout: float) -> None:
        self.rank, self.world_size, self.paths, self.sock = rank, world_size, paths, sock
        self.sock.settimeout(timeout)
        self.round = 0
        self.early: dict[int, dict[int, int]] = {}  # round -> {rank: value} of rounds not reached yet

    def exchange(self, value: int) -> list[int]:
        """Every rank's ``value`` (an int64), in rank order."""
        self.round += 1
        r = self.round
        msg = _MSG.pack(r, self.rank, value)
        for peer, path in enumerate(self.paths):
            if peer != self.rank:
                try:
                    self.sock.sendto(msg, path)
                except OSError as e:
                    raise AgreementError(f"the suite's agreement: rank {peer} is gone ({e})") from e
        got = self.early.pop(r, {})
        got[self.rank] = value
        while len(got) < self.world_size:
            try:
                data = self.sock.recv(_MSG.size)
            except TimeoutError as e:
                missing = sorted(set(range(self.world_size)) - set(got))
                raise AgreementError(f"the suite's agreement, round {r}: timed out waiting for ranks {missing}") from e
            mr, src, v = _MSG.unpack(data)
            if mr == r:
                got[src] = v
            elif mr > r:
                self.early.setdefault(mr, {})[src] = v
            else:
                raise AgreementError(f"the suite's agreement: rank {src} sent round {mr} during round {r}")
        return [got[i] for i in range(self.world_size)]


def address(folder: str) -> str:
    """This rank's socket address: on Linux an abstract name (no file, and
    no limit from sun_path's 108 bytes: under a $TMPDIR of 70 characters the
    pool folder's path was too long to bind, and no pool started); elsewhere
    a file in ``folder``."""
    if sys.platform.startswith("linux"):
        return f"\0fsdp-conformance-agree-{os.getpid()}"
    return os.path.join(folder, f"agree-{os.getpid()}")


def setup(store, rank: int, world_size: int, folder: str, timeout: float) -> None:
    """A pool rank's channel, made after its process group: a socket
    (``address``), its address published on ``store`` and the others' read
    from it (the store's get waits for them). Where some rank cannot bind
    its socket (a path too long for sun_path) no rank has a channel: every
    caller all-reduces on the gloo group instead, all ranks alike."""
    import torch.distributed as dist

    _CHANNEL.clear()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = address(folder)
    try:
        sock.bind(path)
    except OSError:
        sock.close()
        path = ""
    store.set(f"conformance-agree/{rank}", path)
    paths = [store.get(f"conformance-agree/{r}").decode() for r in range(world_size)]
    if not all(paths):
        if path:
            sock.close()
        return
    _CHANNEL[:] = [dist.distributed_c10d._get_default_group(), Channel(rank, world_size, paths, sock, timeout)]


def channel() -> Channel | None:
    """This rank's channel, while the default group is the one it was made
    with (None elsewhere)."""
    if not _CHANNEL:
        return None
    import torch.distributed as dist

    if not dist.is_initialized() or dist.distributed_c10d._get_default_group() is not _CHANNEL[0]:
        return None
    return _CHANNEL[1]
