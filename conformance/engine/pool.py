"""RankPool: W rank processes that form a real process group once and run
examples until closed; a hung or dead rank is reported and the pool rebuilt.

Only JSON crosses the pipes: the driver sends ``spec.to_json()`` and receives
one result record per rank (see ``scenarios.run_scenario``). The driver never
imports torch for gloo; ranks import it once.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field

from conformance.engine.errors import (
    BackendUnavailable,
    EngineError,
    ExampleFailed,
    PoolStartError,
    RankCrash,
    RankHang,
    RankState,
)
from conformance.engine.scenarios import get_scenario
from conformance.spec import CaseSpec

BACKENDS = ("auto", "gloo", "nccl", "fake")
# Torchrun / launcher variables a rank must not mistake for its own.
_LAUNCHER_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
)


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
    if gpus < world_size:
        raise BackendUnavailable(
            f"backend 'nccl' needs {world_size} GPUs (one per rank), this machine has {gpus}; "
            f"use backend='gloo' or world_size<={gpus}"
        )
    return "nccl"


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen
    cmd_w: int  # driver -> rank
    res_r: int  # rank -> driver
    log_path: str
    buf: bytes = b""
    eof: bool = False
    inbox: list = field(default_factory=list)

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


class RankPool:
    """``world_size`` rank processes in one process group, kept across examples.

    ``run(scenario, spec)`` returns one result record per rank, in rank
    order, or raises RankHang / RankCrash (ExampleFailed) when a rank gives no
    result by the deadline or dies; the pool then rebuilds itself (new ranks
    start at once, the next run waits for them). A scenario that raises is an
    error record, not a failure of the pool.

    Ranks run in their own session and die with the driver: at once by
    PR_SET_PDEATHSIG when spawned from the main thread, within half a second
    by a parent-pid poll otherwise; the driver closes every pool at exit and
    kills their ranks on SIGTERM.
    """

    def __init__(
        self,
        world_size: int = 2,
        backend: str = "gloo",
        deadline: float = 60.0,
        *,
        startup_deadline: float = 120.0,
        preload: tuple[str, ...] = (),
        threads: int = 1,
    ) -> None:
        self.backend = resolve_backend(backend, world_size)
        if self.backend == "fake":
            raise EngineError("the fake backend runs in-process: use conformance.engine.fake.FakeEngine")
        if deadline <= 0:
            raise EngineError(f"deadline must be > 0 seconds, got {deadline!r}")
        self.world_size = world_size
        self.deadline = float(deadline)
        self.startup_deadline = float(startup_deadline)
        self.preload = tuple(preload)
        self.threads = threads
        self.generation = 0  # how many times ranks were started
        self.rebuilds = 0  # restarts after a hang, crash or lost sync
        self.events: list[str] = []  # one line per rebuild, why
        self.startup_seconds: float | None = None  # the last start, spawn to ready
        self._dir = tempfile.mkdtemp(prefix="fsdp-conformance-pool-")
        self._ranks: list[_Rank] = []
        self._procs: list[subprocess.Popen] = []  # every process not yet reaped
        self._spawned_at = 0.0
        self._ready = False
        self._closed = False
        self._next_id = 0
        _live_pools.add(self)
        _install_exit_handlers()
        try:
            self._spawn()
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    # ---- public ----------------------------------------------------------

    @property
    def pids(self) -> list[int]:
        return [r.proc.pid for r in self._ranks]

    def run(self, scenario: str, spec: CaseSpec, *, deadline: float | None = None) -> list[dict]:
        """Run ``scenario`` on every rank with ``spec``; one record per rank."""
        if self._closed:
            raise EngineError("this RankPool is closed")
        sc = get_scenario(scenario)
        if sc.module == "__main__":
            raise EngineError(f"scenario {scenario!r} is defined in __main__; ranks cannot import it")
        if not isinstance(spec, CaseSpec):
            raise TypeError(f"spec must be a CaseSpec, got {type(spec).__name__}")
        deadline = self.deadline if deadline is None else float(deadline)
        self._ensure_ready()
        self._next_id += 1
        msg_id = self._next_id
        line = (json.dumps({"op": "run", "id": msg_id, "scenario": scenario, "module": sc.module,
                            "spec": spec.to_json()}) + "\n").encode()
        offsets = [r.log_size() for r in self._ranks]
        start = time.monotonic()
        try:
            dead = self._send_all(line)
            got, died = self._collect("result", msg_id, start + deadline, stop_on_death=True)
            dead |= died
            if dead or len(got) < self.world_size:
                raise self._give_up(
                    RankCrash if dead else RankHang, scenario, spec, deadline, start, got, dead, offsets
                )
        except ExampleFailed:
            raise
        except BaseException:
            # Ctrl-C or a driver bug mid-example: the ranks are out of step.
            self._teardown()
            raise
        records = [_strip(got[r]) for r in range(self.world_size)]
        if not all(rec.get("ok") for rec in records):
            self._resync(msg_id)
        return records

    def close(self) -> None:
        """Stop the ranks (barrier, destroy the group, exit); kill any that do
        not stop within a few seconds. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._ranks and self._ready and all(r.proc.poll() is None for r in self._ranks):
                dead = self._send_all(b'{"op": "stop"}\n')
                if not dead:
                    self._collect("bye", None, time.monotonic() + 10.0, stop_on_death=False)
                    end = time.monotonic() + 5.0
                    for r in self._ranks:
                        try:
                            r.proc.wait(timeout=max(0.0, end - time.monotonic()))
                        except subprocess.TimeoutExpired:
                            pass
            self._teardown()
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

    def _spawn(self) -> None:
        """Start a fresh generation of ranks; does not wait for them."""
        self.generation += 1
        self._ready = False
        self._spawned_at = time.monotonic()
        store = os.path.join(self._dir, f"store-{self.generation}")
        env = dict(os.environ)
        for k in _LAUNCHER_VARS:
            env.pop(k, None)
        env["PYTHONUNBUFFERED"] = "1"
        env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS") or str(self.threads)
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        pg_timeout = max(300.0, 2 * self.deadline)
        # PR_SET_PDEATHSIG fires when the spawning *thread* ends: ask for it
        # only from the main thread, whose end is the driver's.
        pdeathsig = int(threading.current_thread() is threading.main_thread())
        for r in range(self.world_size):
            cmd_r, cmd_w = os.pipe()
            res_r, res_w = os.pipe()
            log_path = os.path.join(self._dir, f"gen{self.generation}-rank{r}.log")
            args = [
                sys.executable, "-m", "conformance.engine.rank",
                "--rank", str(r), "--world-size", str(self.world_size), "--backend", self.backend,
                "--store", store, "--cmd-fd", str(cmd_r), "--res-fd", str(res_w),
                "--parent", str(os.getpid()), "--timeout", str(pg_timeout), "--preload", ",".join(self.preload),
                "--pdeathsig", str(pdeathsig),
            ]
            env.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(self.world_size),
                       LOCAL_WORLD_SIZE=str(self.world_size))
            try:
                with open(log_path, "ab") as log:
                    proc = subprocess.Popen(
                        args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                        pass_fds=(cmd_r, res_w), start_new_session=True,
                    )
            except BaseException:
                for fd in (cmd_r, cmd_w, res_r, res_w):
                    os.close(fd)
                raise
            os.close(cmd_r)
            os.close(res_w)
            self._procs.append(proc)
            self._ranks.append(_Rank(r, proc, cmd_w, res_r, log_path))

    def _wait_ready(self) -> None:
        got, dead = self._collect("ready", None, self._spawned_at + self.startup_deadline, stop_on_death=True)
        if dead or len(got) < self.world_size:
            missing = sorted(dead or set(range(self.world_size)) - set(got))
            r = self._ranks[missing[0]]
            how = "exited" if r.proc.poll() is not None else f"not ready after {self.startup_deadline:g}s"
            tail = [ln for ln in r.read_log(0).splitlines() if ln.strip()][-1:]
            self._teardown()
            raise PoolStartError(
                f"{self.backend} rank {r.rank} of {self.world_size} did not start ({how})"
                + (f": {tail[0].strip()}" if tail else "")
            )
        self._ready = True
        self.startup_seconds = time.monotonic() - self._spawned_at

    def _ensure_ready(self) -> None:
        if not self._ranks:
            self._spawn()
        if not self._ready:
            self._wait_ready()
        gone = [r for r in self._ranks if r.proc.poll() is not None or r.eof]
        if gone:
            self._rebuild(f"rank {gone[0].rank} (pid {gone[0].proc.pid}) died between examples "
                          f"(exit code {gone[0].proc.returncode})")
            self._wait_ready()

    def _rebuild(self, why: str) -> None:
        self.rebuilds += 1
        self.events.append(why)
        self._teardown()
        self._spawn()

    def _teardown(self) -> None:
        """Kill this generation's ranks and reap them."""
        for r in self._ranks:
            for fd in (r.cmd_w, r.res_r):
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._ranks = []
        self._ready = False
        self._kill_procs()

    def _kill_procs(self) -> None:
        procs, self._procs = self._procs, []
        for p in procs:
            if p.poll() is None:
                try:
                    p.kill()
                except OSError:
                    pass
        for p in procs:
            try:
                p.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass

    # ---- messages ----------------------------------------------------------

    def _send_all(self, line: bytes) -> set[int]:
        dead = set()
        for r in self._ranks:
            view = memoryview(line)
            try:
                while view:
                    n = os.write(r.cmd_w, view)
                    view = view[n:]
            except (BrokenPipeError, OSError):
                dead.add(r.rank)
        return dead

    def _collect(
        self, op: str, msg_id: int | None, until: float, *, stop_on_death: bool, grace: float = 1.0
    ) -> tuple[dict[int, dict], set[int]]:
        """Messages ``op`` (with ``msg_id``) from every rank, until ``until``.
        After a rank dies, waits at most ``grace`` more seconds for the rest."""
        got: dict[int, dict] = {}
        dead: set[int] = set()
        by_fd = {r.res_r: r for r in self._ranks}
        pending = {r.rank for r in self._ranks}

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

    def _give_up(self, cls, scenario, spec, deadline, start, got, dead, offsets) -> ExampleFailed:
        elapsed = time.monotonic() - start
        live = [r for r in self._ranks if r.rank not in dead and r.proc.poll() is None]
        before = {r.rank: r.log_size() for r in live}
        for r in live:
            try:
                os.kill(r.proc.pid, signal.SIGUSR1)
            except OSError:
                pass
        _wait_quiet(live, before)
        states = []
        for r in self._ranks:
            if r.rank in got:
                state = "returned"
            elif r.rank in dead or r.proc.poll() is not None:
                state = "exited"
            else:
                state = "running"
            code = None
            if state == "exited":
                try:
                    code = r.proc.wait(timeout=2.0)
                except subprocess.TimeoutExpired:
                    pass
            if r.rank in before:
                stack = r.read_log(before[r.rank])
                log = r.read_log(offsets[r.rank], before[r.rank])
            else:
                log = r.read_log(offsets[r.rank])
                fatal = log.find("Fatal Python error")
                stack = log[fatal:] if fatal >= 0 else ""
            record = _strip(got[r.rank]) if r.rank in got else None
            states.append(RankState(r.rank, r.proc.pid, state, code, record, stack, log))
        failure = cls(
            scenario=scenario, spec=spec, backend=self.backend, world_size=self.world_size,
            deadline=deadline, elapsed=elapsed, ranks=tuple(states),
        )
        self._rebuild(str(failure))
        return failure


def _strip(msg: dict) -> dict:
    return {k: v for k, v in msg.items() if k not in ("op", "id")}


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
    for pool in list(_live_pools):
        try:
            pool.close()
        except Exception:
            pool._kill_procs()


def _kill_all_pools() -> None:
    for pool in list(_live_pools):
        pool._kill_procs()


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
