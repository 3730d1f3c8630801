"""What several commands share: the torch they need, the tiers and engines they run on."""

from __future__ import annotations

from conformance.cli.errors import UsageError
from conformance.engine.errors import EngineError
from conformance.engine.pool import resolve_backend

BACKENDS = ("fake", "gloo", "nccl", "auto")


def need_distributed() -> None:
    try:
        import torch
    except ImportError:
        raise UsageError("torch is not installed in this Python") from None
    try:
        import torch.distributed as dist

        ok = dist.is_available()
    except ImportError:
        ok = False
    if not ok:
        raise UsageError(f"this torch build ({torch.__version__}) has no torch.distributed; FSDP needs it")


def tier_names(ns) -> list[str]:
    """The tiers --backend / --tiers name, checked without torch."""
    if ns.backend and ns.tiers:
        raise UsageError("give --backend or --tiers, not both")
    tiers = [t for t in (ns.tiers or ns.backend or "fake,gloo").split(",") if t]
    bad = [t for t in tiers if t not in BACKENDS]
    if bad:
        raise UsageError(f"unknown backend {bad[0]!r}; choose from {', '.join(BACKENDS)}")
    return tiers


def resolve_tiers(ns) -> list[str]:
    """--backend picks one tier (auto: nccl with a GPU per rank, else gloo);
    --tiers lists them; neither: fake,gloo."""
    out = []
    for t in tier_names(ns):
        try:
            t = resolve_backend(t, ns.world_size) if t != "fake" else t
        except EngineError as e:
            raise UsageError(str(e)) from None
        if t not in out:
            out.append(t)
    return out


def start_engine(backend: str, world_size: int):
    """A pool for a command that checks one case (check, repro), started
    before the command imports the areas (and, for gloo, torch): its fork
    server imports them meanwhile, on another core (RankPool(wait=False);
    check_case_file waits for it). None on the fake tier, which runs in this
    process. The caller closes it."""
    if backend == "fake":
        return None
    if backend != "gloo":  # resolve_backend imports torch to count GPUs
        need_distributed()
    from conformance.engine.pool import RankPool

    try:
        return RankPool(world_size=world_size, backend=resolve_backend(backend, world_size), wait=False)
    except EngineError as e:
        raise UsageError(str(e)) from None


def make_engine(backend: str, world_size: int):

    try:
        if backend == "fake":
            from conformance.engine.fake import FakeEngine

            return FakeEngine(world_size=world_size)
        from conformance.engine.pool import RankPool, resolve_backend

        return RankPool(world_size=world_size, backend=resolve_backend(backend, world_size))
    except EngineError as e:
        raise UsageError(str(e)) from None
