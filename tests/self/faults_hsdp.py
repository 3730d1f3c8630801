"""Faults injected into HSDP (FSDP2's 2-D mesh path, FSDP1's hybrid
strategies, the full state dict's load), as context managers, and test-only
scenarios that apply one inside a rank of the pool (a monkeypatch in the
driver does not reach rank processes)."""

from __future__ import annotations

import contextlib
from unittest import mock

from conformance.case.spec import CaseSpec
from conformance.engine.scenarios import scenario
from tests.self import faults_init_order

FAULTS = {}


def fault(name):
    def add(fn):
        FAULTS[name] = fn
        return fn

    return add


class _WithoutAllReduce:
    """torch.distributed as one module sees it, all_reduce a no-op."""

    def __init__(self, dist):
        self._dist = dist

    def __getattr__(self, name):
        return getattr(self._dist, name)

    @staticmethod
    def all_reduce(*args, **kwargs):
        return None


@fault("no-replicate-all-reduce")
def no_replicate_all_reduce():
    """The gradients are never all-reduced over the replicate dim: FSDP2's
    foreach_reduce and FSDP1's _reduce_grad (its inter-node all-reduce after
    the intra-node reduce-scatter) skip their all_reduce."""
    import torch.distributed as dist
    from torch.distributed.fsdp import _runtime_utils
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    return _both(mock.patch.object(_fsdp_collectives, "dist", _WithoutAllReduce(dist)),
                 mock.patch.object(_runtime_utils, "dist", _WithoutAllReduce(dist)))


@fault("mesh-dims-swapped")
def mesh_dims_swapped():
    """FSDP2 takes a 2-D mesh's dim 0 as its shard dim and dim 1 as its
    replicate dim (the (replicate, shard) order reversed)."""
    from torch.distributed.fsdp._fully_shard import _fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo

    orig = _fully_shard._get_mesh_info

    def swapped(mesh, dp_mesh_dims=None):
        if mesh.ndim == 2 and dp_mesh_dims is None:
            return HSDPMeshInfo(mesh, shard_mesh_dim=0, replicate_mesh_dim=1)
        return orig(mesh, dp_mesh_dims)

    from conformance.areas.hsdp import adapter

    def no_state_dict(*args, **kwargs):
        raise RuntimeError("injected: no state dict round trip under swapped mesh dims")

    def no_sync(spec):
        return "injected: no sync from rank 0 under swapped mesh dims", (), ()

    # the full state dict's gathers (and the sync's) pair up the wrong ranks
    # under this fault and hang: the observation stops before them (LAYOUT
    # reads the layout)
    return _both(mock.patch.object(_fully_shard, "_get_mesh_info", swapped), mock.patch.object(adapter, "_sd_differs", no_state_dict),
                 mock.patch.object(adapter, "sync_from_rank0", no_sync))


@fault("one-rank-replicate-all-reduces-world")
def one_rank_replicate_all_reduces_world():
    """FSDP2 all-reduces over the whole world where the replicate dim has one
    rank (a process-group mix-up of the (1, n) mesh): shards of different
    shard positions are summed into each other."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    orig = FSDPParamGroup._all_reduce_process_group

    def group(self):
        pg = orig.fget(self)
        return dist.group.WORLD if pg.size() == 1 else pg

    return mock.patch.object(FSDPParamGroup, "_all_reduce_process_group", property(group))


@fault("fsdp1-pg-pair-swapped")
def fsdp1_pg_pair_swapped():
    """FSDP1 reads process_group=(shard group, replicate group) the other way
    round: it shards over the replicate group and replicates over the shard
    group."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    orig = FSDP.__init__

    def init(self, module, process_group=None, *args, **kwargs):
        if isinstance(process_group, tuple):
            process_group = (process_group[1], process_group[0])
        return orig(self, module, process_group, *args, **kwargs)

    return mock.patch.object(FSDP, "__init__", init)


@fault("full-state-dict-load-dropped")
def full_state_dict_load_dropped():
    """set_model_state_dict(full_state_dict=True) returns without loading
    anything into the model."""
    from torch.distributed.checkpoint import state_dict as sd_mod

    return mock.patch.object(sd_mod, "_load_model_state_dict", lambda *a, **k: None)


@fault("dcp-load-dropped")
def dcp_load_dropped():
    """torch.distributed.checkpoint.load returns without reading the
    checkpoint into the state dict it is given."""
    import torch.distributed.checkpoint as dcp

    return mock.patch.object(dcp, "load", lambda *a, **k: None)


@fault("sync-buffers-first-replica-only")
def sync_buffers_first_replica_only():
    """set_model_state_dict(broadcast_from_rank0=True) broadcasts the
    plain tensors (buffers) to rank 0's replica only: on a (2, 2) mesh the
    ranks of the second replica (ranks 2 and 3) keep their own buffers, as
    FSDP1's HYBRID_SHARD sync_module_states once synced within the shard
    group only."""
    import torch
    import torch.distributed as dist
    from torch.distributed import _state_dict_utils as sdu

    orig = sdu._broadcast_tensors

    def broadcast(full_state_dict, local_state_dict, keys, device, pg=None):
        keep = {k: v for k, v in local_state_dict.items() if k in keys and isinstance(v, torch.Tensor) and not hasattr(v, "placements")}
        orig(full_state_dict, local_state_dict, keys, device, pg)
        if dist.get_rank() >= dist.get_world_size() // 2:
            local_state_dict.update(keep)

    return mock.patch.object(sdu, "_broadcast_tensors", broadcast)


@contextlib.contextmanager
def _both(*patches):
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


# FSDP1's sync_module_states with its GPU check off, whole or syncing each
# unit's own buffers only (tests/self/faults_init_order.py)
FAULTS["fsdp1-sync-allowed-on-cpu"] = faults_init_order.fsdp1_sync_allowed_on_cpu
FAULTS["fsdp1-sync-own-buffers-only"] = faults_init_order.fsdp1_sync_own_buffers_only


def _faulty(name: str):
    def run(spec: CaseSpec) -> dict:
        from conformance.areas.hsdp import adapter

        with FAULTS[name]():
            return adapter.observe(spec).to_dict()

    run.__name__ = run.__qualname__ = f"faulty_hsdp_{name}".replace("-", "_")
    return run


for _name in FAULTS:
    scenario(f"fault:hsdp:{_name}", test_only=True)(_faulty(_name))
