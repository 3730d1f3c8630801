"""RankPool: W rank processes that form a real process group once and run
examples until closed; a hung or dead rank is reported and the pool rebuilt.

JSON lines cross the pipes: the driver sends the case (pickled, base64: see
``ship``) and receives one JSON result record per rank (see
``scenarios.run_scenario``). The driver does
not import torch for gloo; the pool's fork server imports it once, and every
rank, first or rebuilt, is a fork of it.
"""

from __future__ import annotations

import atexit
import base64
import json
import os
import pickle
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections import deque
from dataclasses import dataclass, field

from conformance.case.model_case import ModelCase
from conformance.case.spec import CaseSpec
from conformance.engine.errors import (
    BackendUnavailable,
    EngineError,
    ExampleFailed,
    PoolStartError,
    RankCrash,
    RankHang,
    RankState,
)
from conformance.engine.scenarios import default_preload, get_scenario

BACKENDS = ("auto", "gloo", "nccl", "fake")
# --preload of a server that imports what the registered scenarios need
# (scenarios.default_preload) itself, as the driver would have listed it
DEFAULT_PRELOAD = "@default"
# Torchrun / launcher variables a rank must not mistake for its own.
_LAUNCHER_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
)


# A record's value with this key true: the scenario's collectives failed in a
# group of its own and left the ranks' process-group state spent; the pool
# rebuilds its ranks after the example.
SPENT = "spent_process_groups"


def ship(spec: CaseSpec | ModelCase) -> str:
    """The case as a run message carries it: the driver's object pickled
    (base64). A rank rebuilds it as it was, validated once in the driver;
    from its JSON, each rank would decode and validate it again, 0.8 ms an
    example of a 6 kB case, most of the pool's round trip."""
    return base64.b64encode(pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")


def unship(text: str) -> CaseSpec | ModelCase:
    return pickle.loads(base64.b64decode(text))


def resolve_backend(backend: str, world_size: int) -> str:
    """The concrete backend for ``world_size`` ranks on this machine: "auto"
    is nccl when there is one GPU per rank, gloo otherwise. Raises
    BackendUnavailable (one line) for nccl without enough GPUs."""
    if backend not in BACKENDS:
        raise EngineError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if not isinstance(world_size, int) or world_size < 1:
        raise EngineError(f"world_size must be a positive int, got {world_size!r}")
    if backend in ("gloo", "fake"):
        return backend
    import torch
    import torch.distributed as dist

    gpus = torch.cuda.device_count()
    nccl = dist.is_available() and dist.is_nccl_available()
    if backend == "auto":
        return "nccl" if nccl and gpus >= world_size else "gloo"
    if not nccl:
        raise BackendUnavailable(
            f"backend 'nccl' is not available in this torch build ({torch.__version__}); use backend='gloo'"
        )
    if gpus == 0:
        raise BackendUnavailable("backend 'nccl' needs one GPU per rank and this machine has none; use backend='gloo'")
    if gpus < world_size:
        raise BackendUnavailable(
            f"backend 'nccl' needs {world_size} GPUs (one per rank), this machine has {gpus}; "
            f"use backend='gloo' or world_size<={gpus}"
        )
    return "nccl"


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (a killed rank can linger as
    one until its parent reaps it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return os.path.exists(f"/proc/{pid}") or not os.path.isdir("/proc")


@dataclass
class _Rank:
    rank: int
    pid: int
    cmd_w: int  # driver -> rank
    res_r: int  # rank -> driver
    log_path: str
    buf: bytes = b""
    eof: bool = False
    inbox: list = field(default_factory=list)
    # its /proc/<pid>/stat, held open: a pread tells its state and CPU time
    # in 3 us where opening the file took 17 (twice per example, for every
    # rank); it names this process even after its pid is reused
    stat_fd: int | None = None

    def open_stat(self) -> None:
        try:
            self.stat_fd = os.open(f"/proc/{self.pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # not Linux, or already gone: pid_alive and _cpu_seconds by path
            self.stat_fd = None

    def close_stat(self) -> None:
        if self.stat_fd is not None:
            try:
                os.close(self.stat_fd)
            except OSError:
                pass
            self.stat_fd = None

    def stat(self) -> list[bytes] | None:
        """The fields of the held /proc/<pid>/stat after the command name
        (state first); None once the process was reaped, or without the file."""
        if self.stat_fd is None:
            return None
        try:
            return os.pread(self.stat_fd, 1024, 0).rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            return None

    def alive(self) -> bool:
        """Exists and is not a zombie (pid_alive, from the held file)."""
        if self.stat_fd is None:
            return pid_alive(self.pid)
        fields = self.stat()
        return bool(fields) and fields[0] not in (b"Z", b"X")

    def cpu_seconds(self) -> float | None:
        """User + system CPU time of every thread (_cpu_seconds)."""
        if self.stat_fd is None:
            return _cpu_seconds(self.pid)
        return cpu_of(self.stat())

    def log_size(self) -> int:
        try:
            return os.stat(self.log_path).st_size
        except OSError:
            return 0

    def read_log(self, start: int, end: int | None = None) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(start)
                data = f.read() if end is None else f.read(max(0, end - start))
        except OSError:
            return ""
        return data.decode("utf-8", "replace")


class _ForkServer:
    """The driver's end of a pool's fork server (conformance.engine.rank):
    one process that imports torch once and forks every generation of ranks,
    so that a rebuild costs a fork and a group init, not an interpreter."""

    def __init__(self, pool: "RankPool", log_path: str) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ)
        for k in _LAUNCHER_VARS:
            env.pop(k, None)
        env["PYTHONUNBUFFERED"] = "1"
        env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS") or str(pool.threads)
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        # PR_SET_PDEATHSIG fires when the spawning *thread* ends: ask for it
        # only from the main thread, whose end is the driver's.
        pdeathsig = int(threading.current_thread() is threading.main_thread())
        args = [
            sys.executable, "-m", "conformance.engine.rank",
            "--world-size", str(pool.world_size), "--backend", pool.backend,
            "--ctl-fd", str(theirs.fileno()), "--parent", str(os.getpid()),
            "--timeout", str(pool.rank_timeout), "--preload", ",".join(pool.preload_arg()),
            "--pdeathsig", str(pdeathsig), "--dir", pool._dir,
        ]
        self.log_path = log_path
        try:
            with open(log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                    pass_fds=(theirs.fileno(),), start_new_session=True,
                )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock = ours
        self.started_at = time.monotonic()
        self.ready = False
        self.eof = False
        self.exits: dict[int, int] = {}  # rank pid -> exit code (negative: signal)
        self.forked: dict[int, int] = {}  # rank -> pid, latest fork

    def alive(self) -> bool:
        return not self.eof and self.proc.poll() is None

    def drain(self, timeout: float = 0.0, until=None) -> None:
        """Take the server's messages for up to ``timeout`` seconds, or until
        ``until()`` holds."""
        end = time.monotonic() + timeout
        while not self.eof and not (until is not None and until()):
            remaining = end - time.monotonic()
            try:
                readable, _, _ = select.select([self.sock], [], [], max(0.0, remaining))
            except (OSError, ValueError):  # socket closed under us (interrupted teardown)
                self.eof = True
                return
            if not readable:
                if remaining <= 0:
                    return
                continue
            try:
                data = self.sock.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                self.eof = True
                return
            msg = json.loads(data)
            if msg["op"] == "exited":
                self.exits[msg["pid"]] = msg["code"]
            elif msg["op"] == "forked":
                self.forked[msg["rank"]] = msg["pid"]
            elif msg["op"] == "ready":
                self.ready = True

    def wait_ready(self, until: float) -> None:
        self.drain(until - time.monotonic(), lambda: self.ready)
        if not self.ready:
            how = "exited" if not self.alive() else "not ready in time"
            tail = _last_line(self.log_path)
            raise PoolStartError(f"the pool's fork server did not start ({how})" + (f": {tail}" if tail else ""))

    def fork(self, rank: int, store: str, log: str, cmd_r: int, res_w: int, pool: "RankPool | None" = None) -> int:
        m = {"op": "fork", "rank": rank, "store": store, "log": log}
        if pool is not None:  # a pool that shares this server: its own world and folder
            m.update(world_size=pool.world_size, backend=pool.backend, timeout=pool.rank_timeout, dir=pool._dir)
        msg = json.dumps(m).encode()
        self.forked.pop(rank, None)
        try:
            socket.send_fds(self.sock, [msg], [cmd_r, res_w])
        except OSError:
            self.eof = True
        self.drain(30.0, lambda: rank in self.forked)
        if rank not in self.forked:
            raise PoolStartError(f"the pool's fork server did not fork rank {rank}")
        return self.forked[rank]

    def kill(self) -> None:
        # SIGKILL before closing the socket: a server that saw the socket
        # close would clean up the pool's folder, which a new server may use.
        if self.proc.poll() is None:
            try:
                self.proc.kill()
                self.proc.wait(timeout=5.0)
            except (OSError, subprocess.TimeoutExpired):
                pass
        try:
            self.sock.close()
        except OSError:
            pass

    def close(self, wait: float = 5.0) -> None:
        """Closing the socket tells the server to kill its ranks and exit. A
        server still importing torch (a pool made with wait=False, closed
        before it was used: a command's bad input) has forked nothing and
        would notice only once ready, seconds later: it is killed."""
        self.drain(0.0)
        if not self.ready and not self.forked:
            self.kill()
            return
        try:
            self.sock.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# Every start of a pool's ranks in this process, (world size, seconds from
# spawn to ready), first starts and rebuilds alike: the bench counts them as
# start-up, not as the pool's per-example overhead (a Worlds pool starts
# inside the first example that needs its world size).
STARTS: list[tuple[int, float]] = []


# seconds without CPU in every rank still running before an example is a HANG:
# past the groups of an example's own (init_order's rank-divergent cases time
# out after 8 s) and any scheduling delay on a loaded 2-core machine
IDLE_DEADLINE = 20.0
# A CRASH that does not follow its case on fresh ranks is replayed after the
# examples the crashed ranks ran before it, at most this many (the latest).
HISTORY = 32


class RankPool:
    """``world_size`` rank processes in one process group, kept across examples.

    ``run(scenario, spec)`` returns one result record per rank, in rank
    order, or raises RankHang / RankCrash (ExampleFailed) when a rank gives no
    result by the deadline or dies; the pool then rebuilds itself (new ranks
    are forked at once, the next run waits for them to join). A scenario that
    raises is an error record, not a failure of the pool.

    One fork server per pool imports torch once; every generation of ranks is
    forked from it. A pool made with ``share_server_with=other`` (another
    world size of the same driver: conformance.engine.worlds) forks its
    ranks from ``other``'s server instead of starting one, while that
    server lives and has every module it preloads. The processes run in their own session and die with the
    driver: the server by PR_SET_PDEATHSIG (when the pool is made on the main
    thread) and a parent-pid poll, the ranks by PR_SET_PDEATHSIG on the
    server; the driver also closes every pool at exit and kills their
    processes on SIGTERM. One caller at a time: a pool is not thread-safe.

    ``wait=False`` starts the fork server and returns (a command that has
    imports of its own to do meanwhile: conformance.cli.common.start_engine);
    ``wait_ready()``, or the first ``run``, forks the ranks and waits for them,
    raising PoolStartError there instead of here.
    """

    def __init__(
        self,
        world_size: int = 2,
        backend: str = "gloo",
        deadline: float = 60.0,
        *,
        startup_deadline: float = 120.0,
        preload: tuple[str, ...] | None = None,
        threads: int = 1,
        share_server_with: "RankPool | None" = None,
        idle_deadline: float | None = IDLE_DEADLINE,
        wait: bool = True,
    ) -> None:
        self.backend = resolve_backend(backend, world_size)
        if self.backend == "fake":
            raise EngineError("the fake backend runs in-process: use conformance.engine.fake.FakeEngine")
        if deadline <= 0:
            raise EngineError(f"deadline must be > 0 seconds, got {deadline!r}")
        if idle_deadline is not None and idle_deadline <= 0:
            raise EngineError(f"idle_deadline must be > 0 seconds or None, got {idle_deadline!r}")
        self.world_size = world_size
        # a HANG is declared sooner than the deadline where no rank still
        # running has used CPU for this long (None: the deadline only)
        self.idle_deadline = None if idle_deadline is None else float(idle_deadline)
        self.deadline = float(deadline)
        self.startup_deadline = float(startup_deadline)
        # None: what the registered scenarios need (scenarios.default_preload),
        # worked out by the server itself (DEFAULT_PRELOAD): the driver need
        # not import the areas, and torch, before the server starts
        self._preload = None if preload is None else tuple(preload)
        self.threads = threads
        # A pool of another world size may fork its ranks from this one's
        # server (torch imported once per driver, not once per pool): where
        # the server has every module this pool preloads, and the same
        # threads. It never closes that server; its ranks die with it.
        self._share = share_server_with
        self.generation = 0  # how many times ranks were started
        self.rebuilds = 0  # restarts after a hang, crash or lost sync
        self.events: list[str] = []  # one line per rebuild, why
        self.startup_seconds: float | None = None  # the last start, spawn to ready
        self._dir = tempfile.mkdtemp(prefix="fsdp-conformance-pool-")
        self._server: _ForkServer | None = None
        self._borrowed = False  # self._server is another pool's
        self._servers_started = 0
        self._ranks: list[_Rank] = []
        self._spawned_at = 0.0
        self._ready = False
        self._closed = False
        self._next_id = 0
        # (scenario, spec, args) of the examples this generation of ranks ran
        self._history: deque[tuple[str, CaseSpec | ModelCase, dict | None]] = deque(maxlen=HISTORY)
        _live_pools.add(self)
        _install_exit_handlers()
        try:
            if wait:
                self._spawn()
                self._wait_ready()
            else:
                self._start_server()
        except BaseException:
            self.close()
            raise

    # ---- public ----------------------------------------------------------

    @property
    def preload(self) -> tuple[str, ...]:
        """The modules the fork server imports before it forks a rank."""
        if self._preload is None:
            self._preload = default_preload()
        return self._preload

    def preload_arg(self) -> tuple[str, ...]:
        """``--preload`` for this pool's server: DEFAULT_PRELOAD while the
        driver has not worked the default out (the server does, the same way)."""
        return (DEFAULT_PRELOAD,) if self._preload is None else self._preload

    def wait_ready(self) -> None:
        """Fork the ranks and wait until they joined the group (PoolStartError
        if they do not): what ``RankPool(..., wait=True)`` does before it
        returns, and the first ``run`` of a pool made with ``wait=False``."""
        if self._closed:
            raise EngineError("this RankPool is closed")
        self._ensure_ready()

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids, in rank order."""
        return [r.pid for r in self._ranks]

    @property
    def forkserver_pid(self) -> int | None:
        return self._server.proc.pid if self._server is not None else None

    @property
    def rank_timeout(self) -> float:
        """The ranks' process-group timeout: well past the deadline, so that
        the driver, not a collective, decides when an example hangs."""
        return max(300.0, 2 * self.deadline)

    def _shared_server(self) -> "_ForkServer | None":
        src = self._share
        if src is None or src._closed or src._server is None or src._borrowed or not src._server.alive():
            return None
        if not set(self.preload) <= set(src.preload) or src.threads != self.threads:
            return None
        return src._server

    def run(self, scenario: str, spec: CaseSpec, *, deadline: float | None = None, args: dict | None = None,
            replay: bool = True) -> list[dict]:
        """Run ``scenario`` on every rank with ``spec`` (and the JSON-able
        keyword ``args``, e.g. a checkpoint directory); one record per rank.
        A CRASH is replayed once on the rebuilt ranks (``replay``), and the
        RankCrash says whether it followed (see _replay); where it did not,
        it is replayed once more after the examples the crashed ranks ran
        before it (RankCrash.history, _replay_history)."""
        if self._closed:
            raise EngineError("this RankPool is closed")
        sc = get_scenario(scenario)
        if sc.module == "__main__":
            raise EngineError(f"scenario {scenario!r} is defined in __main__; ranks cannot import it")
        if not isinstance(spec, (CaseSpec, ModelCase)):
            raise TypeError(f"spec must be a CaseSpec or a ModelCase, got {type(spec).__name__}")
        deadline = self.deadline if deadline is None else float(deadline)
        self._ensure_ready()
        history = list(self._history)
        self._next_id += 1
        msg_id = self._next_id
        line = (json.dumps({"op": "run", "id": msg_id, "scenario": scenario, "module": sc.module,
                            "spec": ship(spec), **({"args": args} if args else {})}) + "\n").encode()
        offsets = [r.log_size() for r in self._ranks]
        start = time.monotonic()
        try:
            dead = self._send_all(line)
            idle: list[float] = []
            got, died = self._collect("result", msg_id, start + deadline, stop_on_death=True,
                                      idle_after=self.idle_deadline, idle=idle)
            dead |= died
            if dead or len(got) < self.world_size:
                failure = self._give_up(
                    RankCrash if dead else RankHang, scenario, spec, deadline, start, got, dead, offsets,
                    idle=idle[0] if idle and not dead else None,
                )
                if replay and isinstance(failure, RankCrash):
                    outcome = self._replay(scenario, spec, deadline, args)
                    if outcome == _NO_CRASH_ALONE and history:
                        failure.history = history
                        outcome += "; " + self._replay_history(history, scenario, spec, deadline, args)
                    failure.note_replay(outcome)
                raise failure
        except ExampleFailed:
            raise
        except BaseException:
            # Ctrl-C or a driver bug mid-example: the ranks are out of step.
            self._teardown()
            raise
        records = [_strip(got[r]) for r in range(self.world_size)]
        self._history.append((scenario, spec, args))
        if any(isinstance(rec.get("value"), dict) and rec["value"].get(SPENT) for rec in records):
            # a collective timed out or failed in a group of the example's own:
            # what it leaves behind (pairs closed, ops pending) can meet a later
            # example's groups; fresh ranks start from a clean state
            self._rebuild(f"example {msg_id} left its ranks' process groups spent")
        elif not all(rec.get("ok") for rec in records):
            self._resync(msg_id)
        return records

    def _replay(self, scenario: str, spec: CaseSpec, deadline: float, args: dict | None) -> str:
        """The crashed example once more, on the ranks rebuilt after it
        (fresh processes from the fork server): whether the crash follows the
        case or what the old ranks ran before it (a native crash that another
        example's state set up: thorough seed 101's segfault in DCP's
        all-gather did not recur on fresh ranks, 25 times)."""
        try:
            self.run(scenario, spec, deadline=deadline, args=args, replay=False)
        except RankCrash:
            return "crashed again"
        except RankHang:
            return "hung"
        except EngineError as e:
            return f"could not run ({str(e).splitlines()[0][:200]})"
        return _NO_CRASH_ALONE

    def _replay_history(self, history: list, scenario: str, spec: CaseSpec, deadline: float, args: dict | None) -> str:
        """On fresh ranks, the examples the crashed ranks ran before the
        crash (the latest HISTORY of them), in order, then the crashed one:
        whether that sequence reproduces the crash."""
        n = len(history)
        self._rebuild(f"replaying the {n} examples run before a crash that did not follow its case")
        for i, (sc, sp, a) in enumerate(history):
            try:
                self.run(sc, sp, args=a, replay=False)
            except RankCrash:
                return f"the {n} examples before it, replayed on fresh ranks, crashed at the {_ordinal(i + 1)} ({sc})"
            except RankHang:
                return f"the {n} examples before it, replayed on fresh ranks, hung at the {_ordinal(i + 1)} ({sc})"
            except EngineError as e:
                return f"the {n} examples before it could not be replayed ({str(e).splitlines()[0][:200]})"
        try:
            self.run(scenario, spec, deadline=deadline, args=args, replay=False)
        except RankCrash:
            return f"after the {n} examples before it, replayed in order on fresh ranks, it crashed again: that sequence reproduces it"
        except RankHang:
            return f"after the {n} examples before it, replayed in order on fresh ranks, it hung"
        except EngineError as e:
            return f"could not run after the {n} examples before it ({str(e).splitlines()[0][:200]})"
        return f"nor after the {n} examples before it, replayed in order on fresh ranks"

    def close(self) -> None:
        """Stop the ranks (barrier, destroy the group, exit), then the fork
        server; kill whatever does not stop within a few seconds. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._ranks and self._ready and not any(self._rank_dead(r) for r in self._ranks):
                dead = self._send_all(b'{"op": "stop"}\n')
                if not dead:
                    self._collect("bye", None, time.monotonic() + 10.0, stop_on_death=False)
                    pids = self.pids
                    self._server.drain(5.0, lambda: all(p in self._server.exits for p in pids))
            self._teardown()
            if self._server is not None and not self._borrowed:
                self._server.close()
        finally:
            _live_pools.discard(self)
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"generation {self.generation}"
        return f"RankPool(world_size={self.world_size}, backend={self.backend!r}, deadline={self.deadline:g}; {state})"

    # ---- rank processes ----------------------------------------------------

    def _start_server(self) -> None:
        """Start the fork server (or borrow the shared one) if there is none
        alive; does not wait for it to import torch."""
        if self._server is None or not self._server.alive():
            if self._server is not None and not self._borrowed:
                self._server.kill()
            self._server, self._borrowed = self._shared_server(), True
            if self._server is None:
                self._borrowed = False
                self._servers_started += 1
                os.makedirs(self._dir, exist_ok=True)  # a shared server that shut down removed it
                self._server = _ForkServer(self, os.path.join(self._dir, f"forkserver-{self._servers_started}.log"))

    def _spawn(self) -> None:
        """Fork a fresh generation of ranks (starting the fork server first if
        there is none, and waiting until it is ready); does not wait for the
        ranks to join the group."""
        self.generation += 1
        self._history.clear()
        self._ready = False
        self._spawned_at = time.monotonic()
        self._start_server()
        if not self._server.ready:
            # a server started early (wait=False) had its start-up time meanwhile
            self._server.wait_ready(min(self._server.started_at, self._spawned_at) + self.startup_deadline)
        os.makedirs(self._dir, exist_ok=True)
        store = os.path.join(self._dir, f"store-{self.generation}")
        for r in range(self.world_size):
            cmd_r, cmd_w = os.pipe()
            res_r, res_w = os.pipe()
            log_path = os.path.join(self._dir, f"gen{self.generation}-rank{r}.log")
            try:
                pid = self._server.fork(r, store, log_path, cmd_r, res_w, self if self._borrowed else None)
            except BaseException:
                os.close(cmd_w)
                os.close(res_r)
                raise
            finally:
                os.close(cmd_r)
                os.close(res_w)
            rank = _Rank(r, pid, cmd_w, res_r, log_path)
            rank.open_stat()
            self._ranks.append(rank)

    def _wait_ready(self, retry: bool = True) -> None:
        got, dead = self._collect("ready", None, self._spawned_at + self.startup_deadline, stop_on_death=True)
        if dead or len(got) < self.world_size:
            missing = sorted(dead or set(range(self.world_size)) - set(got))
            r = self._ranks[missing[0]]
            exited = self._rank_dead(r)
            # a rank that raised wrote why to its log; one that is still
            # starting is asked where it is (its stack)
            tail = _last_line(r.log_path) if exited else self._start_stacks(missing)
            self._teardown()
            how = "exited" if exited else f"not ready after {self.startup_deadline:g}s"
            if not exited and retry:
                # no rank raised: a start that timed out (seen on 2 cores
                # under load, thorough seeds 514725939 and 304956150) is
                # tried once more on fresh ranks, said in the pool's events
                event = f"{self.backend} rank {r.rank} of {self.world_size} did not start ({how}), started again" + (f": {tail}" if tail else "")
                self.events.append(event)
                warnings.warn(f"fsdp-conformance pool: {event}", RuntimeWarning, stacklevel=2)  # in pytest's warnings summary
                self._spawn()
                self._wait_ready(retry=False)
                return
            raise PoolStartError(
                f"{self.backend} rank {r.rank} of {self.world_size} did not start ({how})"
                + (f": {tail}" if tail else "")
            )
        self._ready = True
        self.startup_seconds = time.monotonic() - self._spawned_at
        STARTS.append((self.world_size, self.startup_seconds))

    def _start_stacks(self, missing: list[int]) -> str:
        """Where the ranks that are not ready yet are: each dumps its threads'
        stacks to its log (faulthandler, SIGUSR1); the innermost frames of
        the first one's main thread, or what says it never reached that."""
        live = [self._ranks[i] for i in missing if not self._rank_dead(self._ranks[i])]
        before = _dump_stacks(live)
        for r in live:
            frames = _main_frames(r.read_log(before[r.rank]))
            if frames:
                return f"rank {r.rank} at {frames}"
        return "no stack: the rank had not reached its log (stuck before it registered its stack dump)" if live else ""

    def _rank_dead(self, r: _Rank) -> bool:
        return r.eof or self._server is None or r.pid in self._server.exits or not r.alive()

    def _ensure_ready(self) -> None:
        if not self._ranks:
            self._spawn()
        if not self._ready:
            self._wait_ready()
        self._server.drain(0.0)
        gone = [r for r in self._ranks if self._rank_dead(r)]
        if gone:
            code = self._server.exits.get(gone[0].pid)
            self._rebuild(f"rank {gone[0].rank} (pid {gone[0].pid}) died between examples (exit code {code})")
            self._wait_ready()

    def _rebuild(self, why: str) -> None:
        self.rebuilds += 1
        self.events.append(why)
        self._teardown()
        self._spawn()

    def _teardown(self) -> None:
        """Kill this generation's ranks and wait until the server reaped them."""
        ranks, self._ranks = self._ranks, []
        self._ready = False
        for r in ranks:
            for fd in (r.cmd_w, r.res_r):
                try:
                    os.close(fd)
                except OSError:
                    pass
            r.close_stat()
        server = self._server
        if server is None:
            return
        server.drain(0.0)
        for r in ranks:
            if r.pid not in server.exits:
                try:
                    os.kill(r.pid, signal.SIGKILL)
                except OSError:
                    pass
        server.drain(5.0, lambda: all(r.pid in server.exits for r in ranks))

    def _kill_procs(self) -> None:
        """Kill every process of the pool at once (SIGTERM, atexit fallback)."""
        server = self._server
        for r in list(self._ranks):
            if server is None or r.pid not in server.exits:
                try:
                    os.kill(r.pid, signal.SIGKILL)
                except OSError:
                    pass
        if server is not None and not self._borrowed:
            server.kill()

    # ---- messages ----------------------------------------------------------

    def _send_all(self, line: bytes) -> set[int]:
        dead = set()
        for r in self._ranks:
            view = memoryview(line)
            try:
                while view:
                    n = os.write(r.cmd_w, view)
                    view = view[n:]
            except OSError:
                dead.add(r.rank)
        return dead

    def _collect(
        self, op: str, msg_id: int | None, until: float, *, stop_on_death: bool, grace: float = 1.0,
        idle_after: float | None = None, idle: list | None = None,
    ) -> tuple[dict[int, dict], set[int]]:
        """Messages ``op`` (with ``msg_id``) from every rank, until ``until``.
        After a rank dies, waits at most ``grace`` more seconds for the rest.
        ``idle_after``: stop early once no rank still pending has used CPU
        for that long (each is blocked: in a collective no other rank will
        enter, a lock, a sleep), appending that time to ``idle``."""
        got: dict[int, dict] = {}
        dead: set[int] = set()
        by_fd = {r.res_r: r for r in self._ranks}
        pending = {r.rank for r in self._ranks}
        watch = _IdleWatch(self._ranks, idle_after) if idle_after is not None else None

        def take(r: _Rank) -> None:
            while r.inbox:
                msg = r.inbox.pop(0)
                if msg.get("op") == op and (msg_id is None or msg.get("id") == msg_id):
                    got[r.rank] = msg
                    pending.discard(r.rank)
                    return

        for r in self._ranks:
            take(r)
        while pending:
            remaining = until - time.monotonic()
            if remaining <= 0:
                break
            fds = [self._ranks[i].res_r for i in pending if not self._ranks[i].eof]
            if not fds:
                break
            if watch is not None:
                if watch.idle(pending):
                    idle.append(watch.quiet)
                    break
                remaining = min(remaining, watch.poll)
            readable, _, _ = select.select(fds, [], [], remaining)
            for fd in readable:
                r = by_fd[fd]
                data = os.read(fd, 1 << 16)
                if not data:
                    r.eof = True
                    dead.add(r.rank)
                    pending.discard(r.rank)
                    if stop_on_death:
                        until = min(until, time.monotonic() + grace)
                    continue
                r.buf += data
                *lines, r.buf = r.buf.split(b"\n")
                for ln in lines:
                    try:
                        r.inbox.append(json.loads(ln))
                    except ValueError:
                        continue  # not ours: ranks write only JSON to this pipe
                take(r)
        return got, dead

    def _resync(self, msg_id: int) -> None:
        """After a scenario raised: check every rank is back at the same point
        of the collective sequence; rebuild if not."""
        dead = self._send_all((json.dumps({"op": "sync", "id": msg_id}) + "\n").encode())
        got, died = self._collect("synced", msg_id, time.monotonic() + min(self.deadline, 10.0),
                                  stop_on_death=True)
        want = float(msg_id * self.world_size)
        if dead or died or len(got) < self.world_size or any(m.get("value") != want for m in got.values()):
            self._rebuild(f"ranks out of step after a scenario raised (example {msg_id})")

    def _give_up(self, cls, scenario, spec, deadline, start, got, dead, offsets, idle: float | None = None) -> ExampleFailed:
        elapsed = time.monotonic() - start
        server = self._server
        server.drain(0.0)
        live = [r for r in self._ranks if r.rank not in dead and not self._rank_dead(r)]
        before = _dump_stacks(live)
        exited = [r for r in self._ranks if r.rank not in before]
        server.drain(2.0, lambda: all(r.pid in server.exits for r in exited))
        states = []
        for r in self._ranks:
            if r.rank in got:
                state = "returned"
            elif r.rank in before:
                state = "running"
            else:
                state = "exited"
            if r.rank in before:
                stack = r.read_log(before[r.rank])
                log = r.read_log(offsets[r.rank], before[r.rank])
            else:
                log = r.read_log(offsets[r.rank])
                fatal = log.find("Fatal Python error")
                stack = log[fatal:] if fatal >= 0 else ""
            record = _strip(got[r.rank]) if r.rank in got else None
            code = server.exits.get(r.pid) if state == "exited" else None
            states.append(RankState(r.rank, r.pid, state, code, record, stack, log))
        failure = cls(
            scenario=scenario, spec=spec, backend=self.backend, world_size=self.world_size,
            deadline=deadline, elapsed=elapsed, ranks=tuple(states), idle=idle,
        )
        self._rebuild(str(failure))
        return failure


# _replay's outcome where the example ran on fresh ranks without crashing
_NO_CRASH_ALONE = "did not crash: the crash depends on what the ranks ran before this example"


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _main_frames(dump: str, most: int = 3) -> str:
    """The innermost ``most`` frames of a faulthandler dump's thread that
    runs the rank's main function (else its first thread), innermost first:
    'func (file:line) < ...'."""
    blocks = [b for b in dump.split("\n\n") if "most recent call first" in b]
    block = next((b for b in blocks if "_rank_main" in b), blocks[0] if blocks else "")
    frames = []
    for ln in block.splitlines():
        ln = ln.strip()
        if ln.startswith("File "):
            where, _, func = ln.partition(" in ")
            path, _, line = where[len("File "):].partition(", line ")
            frames.append(f"{func} ({os.path.basename(path.strip(chr(34)))}:{line})")
    return " < ".join(frames[:most])


def _last_line(path: str) -> str:
    try:
        with open(path, "rb") as f:
            lines = [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def proc_stat(pid: int) -> list[bytes] | None:
    """A process's /proc/<pid>/stat fields after its command name (the state
    first); None where that cannot be read (not Linux, or the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _cpu_seconds(pid: int) -> float | None:
    """The process's user + system CPU time (every thread), from /proc; None
    where that cannot be read (not Linux, or the process is gone)."""
    return cpu_of(proc_stat(pid))


def cpu_of(fields: list[bytes] | None) -> float | None:
    """utime + stime from a /proc/<pid>/stat's fields after the command name."""
    try:
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK
    except (TypeError, ValueError, IndexError):
        return None


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class _IdleWatch:
    """Whether every pending rank has been idle for ``quiet`` seconds: used
    under 2% of one core since the window began (a rank blocked in gloo
    still wakes a background thread now and then: about 0.5% measured here;
    a rank that computes, even on a loaded machine, uses far more), sampled
    every ``poll`` seconds. A rank whose CPU cannot be read counts as busy:
    the deadline alone decides then."""

    RATE = 0.02  # of one core
    SLACK = 0.03  # seconds: a few clock ticks

    def __init__(self, ranks: list[_Rank], quiet: float) -> None:
        self.quiet = quiet
        self.poll = min(1.0, quiet / 4)
        self._ranks = {r.rank: r for r in ranks}
        self._base: dict[int, float | None] = {}
        self._since = time.monotonic()
        # the first sample one poll in, not at once: an example that ends
        # sooner (most do) reads no rank's CPU time at all
        self._next = self._since + self.poll

    def idle(self, pending: set[int]) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.poll
        cpu = {r: self._ranks[r].cpu_seconds() for r in pending}
        allowed = self.RATE * (now - self._since) + self.SLACK
        if any(c is None or self._base.get(r) is None or c - self._base[r] > allowed for r, c in cpu.items()):
            self._since, self._base = now, cpu  # some pending rank works (or cannot be read): a new window
            return False
        return now - self._since >= self.quiet


def _strip(msg: dict) -> dict:
    return {k: v for k, v in msg.items() if k not in ("op", "id")}


def _dump_stacks(ranks: list[_Rank]) -> dict[int, int]:
    """Ask each rank for its threads' stacks (SIGUSR1: faulthandler writes
    them to its log) and wait until they are written; {rank: its log's size
    before the dump}."""
    before = {r.rank: r.log_size() for r in ranks}
    for r in ranks:
        try:
            os.kill(r.pid, signal.SIGUSR1)
        except OSError:
            pass
    _wait_quiet(ranks, before)
    return before


def _wait_quiet(ranks: list[_Rank], before: dict[int, int], limit: float = 2.0) -> None:
    """Wait until every signalled rank has written its stack dump (its log grew
    and then stopped growing)."""
    end = time.monotonic() + limit
    sizes = dict(before)
    quiet_since = time.monotonic()
    while time.monotonic() < end:
        time.sleep(0.05)
        now = {r.rank: r.log_size() for r in ranks}
        if now != sizes:
            sizes, quiet_since = now, time.monotonic()
        elif all(now[k] > before[k] for k in now) and time.monotonic() - quiet_since >= 0.1:
            return


# ---- the driver's exit: no rank left behind --------------------------------

_live_pools: "weakref.WeakSet[RankPool]" = weakref.WeakSet()
_atexit_installed = False
_sigterm_installed = False
_previous_sigterm = None


def _close_all_pools() -> None:
    # the pools that share another's fork server first: their ranks stop
    # cleanly before the server that forked them goes
    for pool in sorted(_live_pools, key=lambda p: not p._borrowed):
        try:
            pool.close()
        except Exception:
            pool._kill_procs()


def _kill_all_pools() -> None:
    for pool in list(_live_pools):
        pool._kill_procs()
        shutil.rmtree(pool._dir, ignore_errors=True)


def _on_sigterm(signum, frame) -> None:
    _kill_all_pools()
    if callable(_previous_sigterm):
        _previous_sigterm(signum, frame)
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_exit_handlers() -> None:
    """atexit closes every pool; SIGTERM kills their ranks, then does what it
    did before (by default, terminate). Ctrl-C raises KeyboardInterrupt,
    which kills the ranks of a pool mid-run and reaches atexit."""
    global _atexit_installed, _sigterm_installed, _previous_sigterm
    if not _atexit_installed:
        _atexit_installed = True
        atexit.register(_close_all_pools)
    if not _sigterm_installed and threading.current_thread() is threading.main_thread():
        _sigterm_installed = True
        prev = signal.getsignal(signal.SIGTERM)
        if prev not in (signal.SIG_IGN, None):
            _previous_sigterm = prev
            signal.signal(signal.SIGTERM, _on_sigterm)
