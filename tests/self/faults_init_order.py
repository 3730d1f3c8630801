"""Faults injected into FSDP's initialisation paths (FSDP2 lazy init,
FSDPModule._apply, FSDP1's param_init_fn materialisation, DCP's broadcast
from rank 0, FSDP1's reduce-scatter), as context managers, and test-only
scenarios that apply one inside a rank of the pool (a monkeypatch in the
driver does not reach rank processes)."""

from __future__ import annotations

from unittest import mock

from conformance.case.spec import CaseSpec
from conformance.engine.scenarios import scenario

FAULTS = {}


def fault(name):
    def add(fn):
        FAULTS[name] = fn
        return fn

    return add


@fault("lazy-init-replaces-sharded-params")
def lazy_init_replaces_sharded_params():
    """FSDP2's lazy init registers new sharded Parameter objects (copies):
    an optimizer built before the first forward then steps tensors FSDP no
    longer uses (what test_reset_sharded_param_in_lazy_init guards)."""
    import torch.nn as nn
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    orig = FSDPParamGroup.lazy_init

    def lazy_init(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        for fp in self.fsdp_params:
            old = fp.sharded_param
            new = nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad)
            setattr(fp._module_info.module, fp._module_info.param_name, new)
            for m, n in zip(fp._module_info.shared_modules, fp._module_info.shared_param_names):
                setattr(m, n, new)
            fp.reset_sharded_param()
        return out

    return mock.patch.object(FSDPParamGroup, "lazy_init", lazy_init)


@fault("lazy-init-skips-reset")
def lazy_init_skips_reset():
    """FSDPParamGroup.lazy_init no longer re-reads the modules' parameters
    (the mutant fsdp2-lazy-init-skips-reset-sharded-param): a parameter
    registered anew after fully_shard is not the one FSDP all-gathers and
    trains."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    orig = FSDPParamGroup.lazy_init

    def lazy_init(self, *args, **kwargs):
        self._reset_sharded_params = True
        return orig(self, *args, **kwargs)

    return mock.patch.object(FSDPParamGroup, "lazy_init", lazy_init)


@fault("reset-sharded-param-noop")
def reset_sharded_param_noop():
    """FSDPParam.reset_sharded_param does nothing: after model.to() or
    to_empty() (and at lazy init) FSDP's own sharded data still points at
    the tensors from before the conversion (meta ones after meta init)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    return mock.patch.object(FSDPParam, "reset_sharded_param", lambda self: None)


@fault("fsdp1-param-init-fn-not-called")
def fsdp1_param_init_fn_not_called():
    """FSDP1 materialises a meta module with to_empty only, never calling
    the user's param_init_fn: the values are whatever memory held."""
    from torch.distributed.fsdp import _init_utils

    def materialize(root_module, param_init_fn, ignored_modules):
        for module in _init_utils._get_modules_to_materialize(root_module, ignored_modules):
            module.to_empty(device="cpu", recurse=False)
            for p in module.parameters(recurse=False):
                p.data.fill_(0.125)  # deterministic, and not the seed's values

    return mock.patch.object(_init_utils, "_materialize_with_param_init_fn", materialize)


@fault("fsdp1-materialize-loses-buffers")
def fsdp1_materialize_loses_buffers():
    """FSDP1 materialises the meta modules with the user's param_init_fn,
    then allocates their buffers afresh (as a to_empty after it would; here
    filled with 0.5, deterministic and not the seed's): the parameters are
    right, every buffer is not."""
    import torch
    from torch.distributed.fsdp import _init_utils

    orig = _init_utils._materialize_with_param_init_fn

    def materialize(root_module, param_init_fn, ignored_modules):
        orig(root_module, param_init_fn, ignored_modules)
        for module in _init_utils._get_modules_to_materialize(root_module, ignored_modules):
            for name, b in module._buffers.items():
                if b is not None:
                    module._buffers[name] = torch.full_like(b, 0.5)

    return mock.patch.object(_init_utils, "_materialize_with_param_init_fn", materialize)


@fault("fsdp1-sync-allowed-on-cpu")
def fsdp1_sync_allowed_on_cpu():
    """Not a fault: FSDP1's sync_module_states without its check that the
    module is on a GPU (finding fsdp1-sync-module-states-rejects-cpu), so
    that the sync itself runs over gloo, as it does on a GPU."""
    from torch.distributed.fsdp import _init_utils

    return mock.patch.object(_init_utils, "_check_module_states_for_sync_module_states", lambda states: None)


@fault("fsdp1-sync-own-buffers-only")
def fsdp1_sync_own_buffers_only():
    """As fsdp1-sync-allowed-on-cpu, and each unit's sync broadcasts its own
    module's buffers only (buffers(recurse=False), the mutant
    fsdp1-sync-module-states-own-buffers-only): the buffers of the non-unit
    modules under a unit keep each rank's values."""
    import contextlib

    from torch.distributed.fsdp import _init_utils

    def sync(module, params, process_group):
        states = []
        for b in module.buffers(recurse=False):
            if not getattr(b, _init_utils.FSDP_SYNCED, False):
                setattr(b, _init_utils.FSDP_SYNCED, True)
                states.append(b.detach())
        states += [p.detach() for p in params]
        _init_utils._sync_params_and_buffers(process_group, states, _init_utils.PARAM_BROADCAST_BUCKET_SIZE, src=0)

    @contextlib.contextmanager
    def both():
        with fsdp1_sync_allowed_on_cpu(), mock.patch.object(_init_utils, "_sync_module_params_and_buffers", sync):
            yield

    return both()


@fault("dcp-broadcast-skipped")
def dcp_broadcast_skipped():
    """set_model_state_dict(broadcast_from_rank0=True) broadcasts nothing:
    every rank keeps its own values."""
    from torch.distributed.checkpoint import state_dict as sd

    return mock.patch.object(sd, "_broadcast_state_dict", lambda *a, **k: None)


@fault("fsdp1-reduce-scatter-not-reduced")
def fsdp1_reduce_scatter_not_reduced():
    """FSDP1's gradient reduce-scatter keeps this rank's own chunk: every
    rank trains on its own gradient."""
    import torch.distributed as dist
    from torch.distributed.fsdp import _runtime_utils

    class Dist:
        def __getattr__(self, name):
            return getattr(dist, name)

        @staticmethod
        def reduce_scatter_single(output, input, group=None, **kwargs):
            world = dist.get_world_size(group)
            output.copy_(input.chunk(world)[dist.get_rank(group)])

    return mock.patch.object(_runtime_utils, "dist", Dist())


@fault("fsdp1-summon-raises")
def fsdp1_summon_raises():
    """FSDP1's summon_full_params raises (a regression in the unshard it
    enters): the init area reads the initialised model's full values
    through it."""
    import contextlib

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    @contextlib.contextmanager
    def broken(*args, **kwargs):
        raise RuntimeError("summon_full_params: injected failure")
        yield

    return mock.patch.object(FSDP, "summon_full_params", staticmethod(broken))


def _faulty(name: str):
    def run(spec: CaseSpec) -> dict:
        from conformance.areas.init_order import adapter

        with FAULTS[name]():
            return adapter.observe(spec).to_dict()

    run.__name__ = run.__qualname__ = f"faulty_init_{name}".replace("-", "_")
    return run


for _name in FAULTS:
    scenario(f"fault:init:{_name}", test_only=True)(_faulty(_name))


@scenario("fault:autowrap:rank1-wrap-raises", test_only=True)
def autowrap_rank1_wrap_raises(spec: CaseSpec) -> dict:
    """The autowrap scenario with FullyShardedDataParallel's constructor
    raising on rank 1 only (as rank-dependent units can make it: a size
    policy that meets a rank's shard of a tied Parameter)."""
    import torch.distributed as dist

    from conformance.areas.autowrap import adapter

    real = adapter.wrap

    def wrap(*args, **kwargs):
        if dist.get_rank() == 1:
            raise AssertionError("injected: rank 1's wrap raised")
        return real(*args, **kwargs)

    with mock.patch.object(adapter, "wrap", wrap):
        return adapter.observe(spec).to_dict()
