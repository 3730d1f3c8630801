"""FakeEngine: scenarios in the driver's own process, as one rank of torch's
fake process group (any world size, no communication: right for structure,
wrong for values)."""

from __future__ import annotations

import contextlib
from typing import Iterator

from conformance.case.model_case import ModelCase
from conformance.case.spec import CaseSpec
from conformance.engine.errors import EngineError
from conformance.engine.scenarios import get_scenario, json_roundtrip, run_scenario

# (world_size, rank) of the fake default group a FakeEngine made, if any.
_fake_group: tuple[int, int] | None = None


@contextlib.contextmanager
def preserve_hypothesis_profile() -> Iterator[None]:
    """Keep the active Hypothesis profile through imports of torch's test
    utilities: torch.testing._internal.common_utils registers its own profiles
    ("dev", "debug", "pytorch_ci") and loads one at import."""
    try:
        from hypothesis import settings
    except ImportError:
        yield
        return
    name = getattr(settings, "_current_profile", None)
    profiles = dict(getattr(settings, "_profiles", {}))
    try:
        yield
    finally:
        if name is not None:
            registered = getattr(settings, "_profiles", None)
            if registered is not None:
                registered.update(profiles)  # undo overwrites of same-named profiles
            settings.load_profile(name)


_fake_pg = None


def _import_fake_pg():
    global _fake_pg
    if _fake_pg is None:
        with preserve_hypothesis_profile():
            import torch.distributed as dist
            from torch.testing._internal.distributed.fake_pg import FakeStore
        _fake_pg = (dist, FakeStore)
    return _fake_pg


def forget_meshes() -> None:
    """Drop DTensor's sharding-propagation caches. They are keyed by the
    input DTensorSpecs, and DeviceMesh equality compares ranks, layout,
    device type and dim names, not process groups: after this process's
    default group is destroyed and made again (the fake tier and the
    driver's one-rank gloo group take turns), an op on a new mesh can hit an
    entry of an old, equal mesh and give a DTensor on it, whose collectives
    then name a destroyed group ("Could not resolve the process group
    registered under the name N"; NVIDIA/Megatron-LM#7029 met the same).
    Called whenever this process destroys its default group."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor has no such cache
        return
    import torch

    prop = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        clear = getattr(getattr(prop, name, None), "cache_clear", None)
        if clear is not None:
            clear()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ dispatch fast path's own
    if native is not None:
        native()


class FakeEngine:
    """Rank ``rank`` of a fake world of ``world_size``, in this process.

    ``run(scenario, spec)`` returns ``[record]`` (one record, this rank's),
    shaped exactly like a RankPool record, JSON round trip included. There is
    no deadline: fake collectives never wait. Scenarios marked ``fault`` (they
    hang or kill their process) are refused. The engine owns the process's
    default group while open; ``close()`` destroys it.
    """

    def __init__(self, world_size: int = 4, rank: int = 0) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise EngineError(f"world_size must be a positive int, got {world_size!r}")
        if not 0 <= rank < world_size:
            raise EngineError(f"rank must be in [0, {world_size}), got {rank!r}")
        self.world_size = world_size
        self.rank = rank
        self.backend = "fake"
        self._closed = False
        self._join()

    def _join(self) -> None:
        global _fake_group
        dist, FakeStore = _import_fake_pg()
        if dist.is_initialized():
            if _fake_group == (self.world_size, self.rank) and dist.get_backend() == "fake":
                return
            if _fake_group is None:
                raise EngineError(
                    f"a {dist.get_backend()} default process group is already initialised in this process; "
                    "FakeEngine needs the default group"
                )
            dist.destroy_process_group()  # another FakeEngine's world
            forget_meshes()
            _fake_group = None
        dist.init_process_group("fake", store=FakeStore(), rank=self.rank, world_size=self.world_size)
        _fake_group = (self.world_size, self.rank)

    def run(self, scenario: str, spec: CaseSpec) -> list[dict]:
        if self._closed:
            raise EngineError("this FakeEngine is closed")
        sc = get_scenario(scenario)
        if sc.fault:
            raise EngineError(f"scenario {scenario!r} hangs or kills its process: run it in a RankPool, not in-process")
        if not isinstance(spec, (CaseSpec, ModelCase)):
            raise TypeError(f"spec must be a CaseSpec or a ModelCase, got {type(spec).__name__}")
        self._join()
        # a scenario may import torch's test utilities on first use (FSDP
        # test helpers import common_utils): the suite's profile stays
        with preserve_hypothesis_profile():
            # the spec is immutable: no need to serialise it in-process; the
            # record still makes the JSON round trip a pool's would
            record = run_scenario(scenario, spec, rank=self.rank)
        return [json_roundtrip(record)]

    def close(self) -> None:
        global _fake_group
        if self._closed:
            return
        self._closed = True
        import torch.distributed as dist

        if dist.is_initialized() and _fake_group == (self.world_size, self.rank):
            dist.destroy_process_group()
            forget_meshes()
            _fake_group = None

    def __enter__(self) -> "FakeEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FakeEngine(world_size={self.world_size}, rank={self.rank})"
