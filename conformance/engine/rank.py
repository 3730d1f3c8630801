"""The processes behind a RankPool: a fork server that imports torch once, and
the ranks it forks, which join the group and run examples until told to stop.

Fork server (``python -m conformance.engine.rank``): talks to the driver over
a SOCK_SEQPACKET socket, one JSON message per packet. It answers
``{"op": "ready"}`` once its imports are done; for ``{"op": "fork", "rank",
"store", "log"}`` (with the rank's two pipe ends attached as SCM_RIGHTS; and
the rank's "world_size", "backend", "timeout" and its pool's scratch "dir"
where they differ from the server's own: a pool of another world size that
shares the server) it forks a rank and answers ``{"op": "forked", "rank", "pid"}``; it reaps its
ranks and reports ``{"op": "exited", "pid", "code"}`` (negative code: killed
by that signal). It exits, killing its ranks, when the driver closes the
socket or dies.

Rank (one JSON object a line on its pipes): the driver sends ``{"op": "run",
"id", "scenario", "module", "spec"}`` (the case pickled: pool.ship), ``{"op": "sync", "id"}`` or ``{"op":
"stop"}``; the rank answers ``{"op": "ready", ...}`` once, ``{"op":
"result", "id", **record}`` per run, ``{"op": "synced", "id", "value"}`` per
sync and ``{"op": "bye"}`` before it exits.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import gc
import json
import os
import select
import shutil
import signal
import socket
import sys
import threading
import time
import traceback

PR_SET_PDEATHSIG = 1


def _set_pdeathsig(sig: int = signal.SIGKILL) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> None:
    """The fork server."""
    p = argparse.ArgumentParser()
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--backend", required=True)
    p.add_argument("--ctl-fd", type=int, required=True)
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--timeout", type=float, required=True)
    p.add_argument("--preload", default="")
    p.add_argument("--pdeathsig", type=int, default=1)
    p.add_argument("--dir", default="", help="the pool's scratch folder, removed if the driver dies")
    a = p.parse_args(argv)
    started = time.perf_counter()
    children: dict[int, int] = {}  # pid -> rank
    # the scratch folders of the pools this server forks for (a pool of
    # another world size may share it: conformance.engine.pool.RankPool)
    dirs: list[str] = [a.dir] if a.dir else []

    def shut_down(code: int) -> None:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for _ in list(children):
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
        for d in dirs:  # the driver does too, unless it died
            shutil.rmtree(d, ignore_errors=True)
        os._exit(code)

    # The kernel signals us when the driver dies, even by SIGKILL (SIGTERM,
    # so that we take our ranks along). PDEATHSIG follows the thread that
    # spawned us, so the driver asks for it only from its main thread; the
    # loop below polls the parent pid either way.
    signal.signal(signal.SIGTERM, lambda signum, frame: shut_down(1))
    if a.pdeathsig:
        _set_pdeathsig(signal.SIGTERM)
    if os.getppid() != a.parent:
        os._exit(1)
    # We run in our own session, so a terminal Ctrl-C reaches only the driver;
    # ignore a stray SIGINT rather than die mid-collective (ranks inherit it).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.enable(all_threads=True)

    import torch
    import torch.distributed  # noqa: F401

    import conformance.engine.scenarios  # noqa: F401

    try:
        # torch.optim's first optimizer imports torch._dynamo (its
        # @_disable_dynamo): ~1.2 s in each rank that trains, once per rank
        # process. Imported here, before the fork, the ranks share it.
        import torch._dynamo  # noqa: F401
    except Exception:
        pass
    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from conformance.engine.pool import DEFAULT_PRELOAD

    preload = [m for m in a.preload.split(",") if m]
    if DEFAULT_PRELOAD in preload:  # what the driver's default_preload() would have listed
        from conformance.engine.scenarios import default_preload

        try:
            preload = [m for m in preload if m != DEFAULT_PRELOAD] + list(default_preload())
        except Exception:  # the scenario that needs it will report the error
            traceback.print_exc()
            preload = [m for m in preload if m != DEFAULT_PRELOAD]
    for mod in preload:
        try:
            __import__(mod)
        except Exception:  # the scenario that needs it will report the error
            traceback.print_exc()
    # What is imported now lives as long as every rank: keep it out of the
    # garbage collector's full passes, which would rescan torch's objects
    # during examples.
    gc.collect()
    gc.freeze()

    ctl = socket.socket(fileno=a.ctl_fd)

    def tell(obj: dict) -> None:
        try:
            ctl.send(json.dumps(obj).encode())
        except OSError:
            pass

    # A rank that exits wakes the loop below at once (SIGCHLD through a
    # self-pipe): the driver's rebuild waits for the exit to be reaped, and
    # the loop's own 0.2 s poll made each rebuild of a rank-divergent
    # example (init_order: every one) cost up to 0.2 s more.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # a handler, so that the wakeup fd is written
    signal.set_wakeup_fd(wake_w)

    tell({"op": "ready", "pid": os.getpid(), "startup_seconds": time.perf_counter() - started})

    def reap() -> None:
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            children.pop(pid, None)
            tell({"op": "exited", "pid": pid, "code": os.waitstatus_to_exitcode(status)})

    while True:
        if os.getppid() != a.parent:
            shut_down(1)
        readable, _, _ = select.select([ctl, wake_r], [], [], 0.2)
        if wake_r in readable:
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
        reap()
        if ctl not in readable:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(ctl, 1 << 16, 2)
        except OSError:
            shut_down(0)
        if not data:
            shut_down(0)  # the driver closed the pool (or is gone)
        msg = json.loads(data)
        if msg["op"] != "fork" or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(wake_r)
                os.close(wake_w)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                ctl.close()
                _rank_main(msg["rank"], msg.get("world_size", a.world_size), msg.get("backend", a.backend),
                           msg["store"], msg["log"], fds[0], fds[1], msg.get("timeout", a.timeout))
            except BaseException:
                # to the rank's log (once _rank_main has opened it): the
                # driver's "did not start" then ends with its last line
                traceback.print_exc()
                sys.stderr.flush()
            finally:
                os._exit(1)  # never back into the server's loop
        for fd in fds:
            os.close(fd)
        if msg.get("dir") and msg["dir"] not in dirs:
            dirs.append(msg["dir"])
        children[pid] = msg["rank"]
        tell({"op": "forked", "rank": msg["rank"], "pid": pid})


def _rank_main(
    rank: int, world_size: int, backend: str, store: str, log: str, cmd_fd: int, res_fd: int, timeout: float
) -> None:
    started = time.perf_counter()
    server = os.getppid()
    _set_pdeathsig()  # forked by the server's main thread: dies with the server
    if os.getppid() != server:
        os._exit(1)

    def watch() -> None:  # backs PDEATHSIG
        while True:
            time.sleep(0.5)
            if os.getppid() != server:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    faulthandler.enable(all_threads=True)  # fatal signals: stack to the rank's log
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver asks for stacks
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))

    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from conformance.engine.pool import unship
    from conformance.engine.scenarios import error_record, run_scenario

    cmd = os.fdopen(cmd_fd, "rb", buffering=0)
    res = os.fdopen(res_fd, "wb", buffering=0)

    def send(obj: dict) -> None:
        res.write((json.dumps(obj) + "\n").encode())

    kwargs = {}
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    file_store = dist.FileStore(store, world_size)
    dist.init_process_group(
        backend,
        store=file_store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
        **kwargs,
    )
    if world_size > 1:  # the suite's agreement between these ranks (conformance.engine.agree)
        from conformance.engine import agree

        agree.setup(file_store, rank, world_size, os.path.dirname(store), timeout)
    send({"op": "ready", "rank": rank, "pid": os.getpid(), "startup_seconds": time.perf_counter() - started})

    for line in _lines(cmd):
        msg = json.loads(line)
        op = msg["op"]
        if op == "run":
            try:
                spec = unship(msg["spec"])
            except Exception as e:  # a case this rank's code cannot rebuild: the example's error
                record = {"rank": rank, "ok": False, "error": error_record(e), "seconds": 0.0}
            else:
                record = run_scenario(
                    msg["scenario"], spec, rank=rank, module=msg.get("module"), catch=(BaseException,),
                    args=msg.get("args"),
                )
            try:
                text = json.dumps({"op": "result", "id": msg["id"], **record})
            except (TypeError, ValueError) as e:
                text = json.dumps({"op": "result", "id": msg["id"], "rank": rank, "ok": False,
                                   "error": error_record(e), "seconds": record["seconds"]})
            res.write((text + "\n").encode())
        elif op == "sync":
            t = torch.tensor([float(msg["id"])], dtype=torch.float64, device=device)
            dist.all_reduce(t)
            send({"op": "synced", "id": msg["id"], "value": float(t.item())})
        elif op == "stop":
            # A deliberate end: every rank leaves the group together, then
            # exits without running gloo's teardown at interpreter exit.
            dist.barrier()
            dist.destroy_process_group()
            send({"op": "bye"})
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    os._exit(0)  # the driver closed the pipe without a stop: it is gone


def _lines(f):
    buf = b""
    while True:
        chunk = f.read(1 << 16)
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line


if __name__ == "__main__":
    main()
