"""One rank process of a RankPool: joins the group once, then runs examples
read from its command pipe until told to stop.

Protocol (one JSON object per line): the driver sends
``{"op": "run", "id", "scenario", "module", "spec"}``, ``{"op": "sync", "id"}``
or ``{"op": "stop"}``; the rank answers ``{"op": "ready", ...}`` once,
``{"op": "result", "id", **record}`` per run, ``{"op": "synced", "id",
"value"}`` per sync, and ``{"op": "bye"}`` before it exits.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import gc
import json
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int, pdeathsig: bool) -> None:
    # The kernel kills us when the driver dies, even by SIGKILL. PDEATHSIG
    # follows the thread that spawned us, so the driver asks for it only from
    # its main thread; a poll of the parent pid backs it either way.
    if pdeathsig:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--backend", required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--cmd-fd", type=int, required=True)
    p.add_argument("--res-fd", type=int, required=True)
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--timeout", type=float, required=True)
    p.add_argument("--preload", default="")
    p.add_argument("--pdeathsig", type=int, default=1)
    a = p.parse_args(argv)
    started = time.perf_counter()
    _die_with_parent(a.parent, bool(a.pdeathsig))
    # The ranks run in their own session, so a terminal Ctrl-C reaches only the
    # driver; ignore a stray SIGINT rather than die mid-collective.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.enable(all_threads=True)  # fatal signals: stack to stderr (the rank's log)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver asks for stacks

    cmd = os.fdopen(a.cmd_fd, "rb", buffering=0)
    res = os.fdopen(a.res_fd, "wb", buffering=0)

    def send(obj: dict) -> None:
        res.write((json.dumps(obj) + "\n").encode())

    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from conformance.engine.scenarios import run_scenario

    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    kwargs = {}
    device = torch.device("cpu")
    if a.backend == "nccl":
        device = torch.device("cuda", a.rank)
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    dist.init_process_group(
        a.backend,
        store=dist.FileStore(a.store, a.world_size),
        rank=a.rank,
        world_size=a.world_size,
        timeout=timedelta(seconds=a.timeout),
        **kwargs,
    )
    for mod in filter(None, a.preload.split(",")):
        __import__(mod)
    # Everything imported so far lives as long as the rank: keep it out of the
    # garbage collector's full passes, which would otherwise rescan torch's
    # objects during examples.
    gc.collect()
    gc.freeze()
    send({"op": "ready", "rank": a.rank, "pid": os.getpid(), "startup_seconds": time.perf_counter() - started})

    lines = _lines(cmd)
    for line in lines:
        msg = json.loads(line)
        op = msg["op"]
        if op == "run":
            record = run_scenario(
                msg["scenario"], msg["spec"], rank=a.rank, module=msg.get("module"), catch=(BaseException,)
            )
            try:
                out = json.dumps({"op": "result", "id": msg["id"], **record})
            except (TypeError, ValueError) as e:
                from conformance.engine.scenarios import error_record

                out = json.dumps(
                    {"op": "result", "id": msg["id"], "rank": a.rank, "ok": False,
                     "error": error_record(e), "seconds": record["seconds"]}
                )
            res.write((out + "\n").encode())
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
