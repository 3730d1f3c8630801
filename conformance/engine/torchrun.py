"""The torchrun entry: every process launched by torchrun joins one group;
rank 0 draws the specs, broadcasts each, every rank runs the scenario, rank 0
gathers the records and checks that the ranks agree.

    torchrun --standalone --nproc-per-node 2 -m conformance.engine.torchrun \\
        --scenario fsdp1 --specs specs.jsonl [--examples N] [--seed S]

Python callers use ``TorchrunEngine`` (``run(scenario, spec)`` on rank 0,
``serve()`` on the others: the same records as RankPool.run) or
``drive(spec_source, scenario)``, which plugs any source of CaseSpecs
(a Hypothesis-driven one included) into that loop. There is no per-example
deadline here: a hang lasts until the process group's timeout.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import json
import os
import sys
import time
from datetime import timedelta
from typing import Callable, Iterable

from conformance.case.spec import CaseSpec
from conformance.engine.errors import EngineError
from conformance.engine.pool import resolve_backend
from conformance.engine.scenarios import get_scenario, json_roundtrip, run_scenario

SpecSource = Iterable[CaseSpec] | Callable[[], Iterable[CaseSpec]]


class TorchrunEngine:
    """This process's rank in the torchrun world (joined from the torchrun
    environment variables unless a default group already exists)."""

    def __init__(self, backend: str = "auto", timeout: float = 300.0) -> None:
        import torch
        import torch.distributed as dist

        self._dist = dist
        self._owns_group = False
        if not dist.is_initialized():
            missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
            if missing:
                raise EngineError(f"not launched by torchrun: {', '.join(missing)} unset")
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
            self.backend = resolve_backend(backend, local_world)
            if self.backend == "fake":
                raise EngineError("the fake backend runs in-process: use conformance.engine.fake.FakeEngine")
            kwargs = {}
            if self.backend == "nccl":
                device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
                torch.cuda.set_device(device)
                kwargs["device_id"] = device
            dist.init_process_group(self.backend, timeout=timedelta(seconds=timeout), **kwargs)
            self._owns_group = True
        else:
            self.backend = dist.get_backend()
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def _broadcast(self, obj):
        box = [obj]
        self._dist.broadcast_object_list(box, src=0)
        return box[0]

    def _run_here(self, msg: dict) -> list[dict] | None:
        record = run_scenario(msg["scenario"], msg["spec"], rank=self.rank, module=msg["module"])
        record = json_roundtrip(record)  # the same shape as through a pool's pipe
        out = [None] * self.world_size if self.rank == 0 else None
        self._dist.gather_object(record, out, dst=0)
        return out

    def run(self, scenario: str, spec: CaseSpec) -> list[dict]:
        """Rank 0 only: run ``scenario`` on every rank; one record per rank."""
        if self.rank != 0:
            raise EngineError("TorchrunEngine.run is for rank 0; other ranks call serve()")
        sc = get_scenario(scenario)
        msg = {"scenario": scenario, "module": sc.module, "spec": spec.to_json()}
        self._broadcast(msg)
        return self._run_here(msg)

    def serve(self) -> None:
        """Ranks other than 0: run what rank 0 sends until it calls stop()."""
        while True:
            msg = self._broadcast(None)
            if msg is None:
                return
            self._run_here(msg)

    def stop(self) -> None:
        """Rank 0: release the ranks in serve()."""
        self._broadcast(None)

    def shutdown(self) -> None:
        """Every rank: leave the group together (barrier, then destroy)."""
        if self._owns_group and self._dist.is_initialized():
            self._dist.barrier()
            self._dist.destroy_process_group()


@dataclasses.dataclass
class Summary:
    scenario: str
    backend: str
    world_size: int
    examples: int = 0
    agree: int = 0
    disagree: int = 0
    errors: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.examples == self.agree

    def line(self) -> str:
        rate = self.examples / self.seconds if self.seconds > 0 else 0.0
        verdict = "OK" if self.ok else "FAILED"
        return (
            f"conformance torchrun {verdict}: scenario={self.scenario} backend={self.backend} "
            f"world_size={self.world_size} examples={self.examples} agree={self.agree} "
            f"disagree={self.disagree} errors={self.errors} ({rate:.1f} examples/s)"
        )


def drive(
    spec_source: SpecSource | None,
    scenario: str = "fsdp1",
    *,
    engine: TorchrunEngine | None = None,
    on_result: Callable[[CaseSpec, list[dict], bool], None] | None = None,
) -> Summary | None:
    """Call on every rank. Rank 0 takes specs from ``spec_source`` (an
    iterable, or a callable returning one; ignored elsewhere), runs each on
    every rank and checks agreement; returns the Summary on rank 0, None on
    the others. ``on_result(spec, records, agreed)`` sees each example."""
    engine = engine or TorchrunEngine()
    if engine.rank != 0:
        engine.serve()
        return None
    sc = get_scenario(scenario)
    summary = Summary(scenario, engine.backend, engine.world_size)
    source = spec_source() if callable(spec_source) else (spec_source or ())
    start = time.perf_counter()
    try:
        for spec in source:
            records = engine.run(scenario, spec)
            agreed = records_agree(sc, records)
            summary.examples += 1
            summary.errors += sum(not r["ok"] for r in records)
            if agreed:
                summary.agree += 1
            else:
                summary.disagree += 1
            if on_result is not None:
                on_result(spec, records, agreed)
    finally:
        engine.stop()
    summary.seconds = time.perf_counter() - start
    return summary


def records_agree(sc, records: list[dict]) -> bool:
    """Every rank returned, and their comparable values are equal."""
    if not all(r["ok"] for r in records):
        return False
    first = sc.comparable_value(records[0]["value"])
    return all(sc.comparable_value(r["value"]) == first for r in records[1:])


def specs_from_file(path: str) -> list[CaseSpec]:
    """CaseSpecs from a JSON-lines file (one ``CaseSpec.to_json()`` a line)."""
    with open(path) as f:
        return [CaseSpec.from_json(line) for line in f if line.strip()]


def _load_callable(ref: str) -> Callable:
    mod, _, name = ref.partition(":")
    if not name:
        raise EngineError(f"--spec-source must be 'module:function', got {ref!r}")
    return getattr(importlib.import_module(mod), name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m conformance.engine.torchrun", description=__doc__.splitlines()[0])
    p.add_argument("--scenario", default="fsdp1")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--specs", metavar="FILE", help="JSON-lines file of CaseSpecs")
    src.add_argument("--spec-source", metavar="MODULE:FUNCTION",
                     help="a function (examples, seed) -> iterable of CaseSpecs, on rank 0")
    p.add_argument("--examples", type=int, default=None, help="run at most N examples")
    p.add_argument("--seed", type=int, default=None, help="give example i the seed S+i")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    p.add_argument("--timeout", type=float, default=300.0, help="process-group timeout, seconds")
    p.add_argument("--out", metavar="FILE", help="rank 0 writes one JSON line per example")
    a = p.parse_args(argv)

    engine = TorchrunEngine(a.backend, a.timeout)
    get_scenario(a.scenario)  # fail fast, on every rank, on an unknown name
    out = open(a.out, "w") if a.out and engine.rank == 0 else None

    def source() -> Iterable[CaseSpec]:
        if a.specs:
            specs: Iterable[CaseSpec] = specs_from_file(a.specs)
        else:
            specs = _load_callable(a.spec_source)(a.examples, a.seed)
        specs = itertools.islice(specs, a.examples) if a.examples is not None else specs
        for i, spec in enumerate(specs):
            yield spec if a.seed is None else dataclasses.replace(spec, seed=a.seed + i)

    def record(spec: CaseSpec, records: list[dict], agreed: bool) -> None:
        if out is not None:
            out.write(json.dumps({"spec": spec.to_json(), "agree": agreed, "records": records}) + "\n")
        if not agreed:
            print(f"DISAGREE seed={spec.seed}: " + json.dumps(records)[:2000], flush=True)

    summary = drive(source, a.scenario, engine=engine, on_result=record)
    if out is not None:
        out.close()
    code = 0
    if summary is not None:
        print(summary.line(), flush=True)
        code = 0 if summary.ok else 1
    code = engine._broadcast(code)  # every rank exits with rank 0's verdict
    engine.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip gloo's teardown at interpreter exit


if __name__ == "__main__":
    main()
