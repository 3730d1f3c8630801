"""Faults injected into what FSDP communicates, as context managers, and the
test-only scenarios that apply one around the comm area's observation
inside a rank (the fake tier's in-process rank, or a pool's: a monkeypatch
in the driver does not reach rank processes)."""

from __future__ import annotations

import contextlib
from unittest import mock

from conformance.case.spec import CaseSpec
from conformance.engine.scenarios import scenario

FAULTS = {}


def fault(name):
    def add(fn):
        FAULTS[name] = fn
        return fn

    return add


def _group_cls():
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    return _fsdp_param_group.FSDPParamGroup


@fault("fsdp2-unshard-ignores-unsharded")
def fsdp2_unshard_ignores_unsharded():
    """unshard() lost its early return for an unsharded group: a group kept
    unsharded (reshard_after_forward=False) all-gathers again in backward."""
    cls = _group_cls()
    orig = cls.unshard

    def unshard(self, async_op=False):
        if self.is_unsharded and self._all_gather_result is None:
            self._to_sharded()
        return orig(self, async_op)

    return mock.patch.object(cls, "unshard", unshard)


@fault("fsdp2-frozen-reduced")
def fsdp2_frozen_reduced():
    """post_backward reduce-scatters every parameter, frozen ones with a zero
    gradient (as if reduce_scatter_unused_params ignored requires_grad)."""
    import torch

    cls = _group_cls()
    orig = cls.post_backward

    def post_backward(self, *args, **kwargs):
        for fp in self.fsdp_params:
            if hasattr(fp, "_unsharded_param") and not fp.sharded_param.requires_grad and fp.unsharded_param.grad is None:
                fp.unsharded_param.grad = torch.zeros_like(fp.unsharded_param)
        return orig(self, *args, **kwargs)

    return mock.patch.object(cls, "post_backward", post_backward)


@fault("fsdp2-reduce-in-param-dtype")
def fsdp2_reduce_in_param_dtype():
    """reduce_dtype ignored: gradients reduced in param_dtype."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    cls = _fsdp_param.FSDPParam
    orig = cls.init_dtype_attrs

    def init(self, mp_policy):
        orig(self, mp_policy)
        self.reduce_dtype = None

    return mock.patch.object(cls, "init_dtype_attrs", init)


@fault("fsdp2-one-rank-reduces")
def fsdp2_one_rank_reduces():
    """The one-rank shortcut of the gradient reduction is gone: a one-rank
    mesh reduce-scatters each group's gradients (with itself)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    orig = _fsdp_param_group.foreach_reduce

    def foreach_reduce(fsdp_params, unsharded_grads, group, *args, **kwargs):
        if group is not None and group.size() == 1:
            flat = torch.cat([g.reshape(-1) for g in unsharded_grads])
            dist.reduce_scatter_tensor(torch.empty_like(flat), flat, group=group)
        return orig(fsdp_params, unsharded_grads, group, *args, **kwargs)

    return mock.patch.object(_fsdp_param_group, "foreach_reduce", foreach_reduce)


@fault("fsdp2-int-reshard-full-mesh")
def fsdp2_int_reshard_full_mesh():
    """reshard_after_forward=<int> reshards to the full mesh: the backward
    all-gather spans every rank instead of the int's."""
    cls = _group_cls()
    return mock.patch.object(cls, "_use_post_forward_mesh", property(lambda self: False))


@fault("fsdp2-root-reshards-by-default")
def fsdp2_root_reshards_by_default():
    """reshard_after_forward=None reshards the root after forward too (the
    root's default, False, is lost)."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    orig = FSDPState._lazy_init

    def lazy_init(self):
        first = self._is_root is None
        orig(self)
        if first and self._is_root:
            for g in self._fsdp_param_groups:
                g.post_forward_mesh_info = g.mesh_info

    return mock.patch.object(FSDPState, "_lazy_init", lazy_init)


@fault("fsdp2-no-backward-prefetch")
def fsdp2_no_backward_prefetch():
    """The default backward prefetch is gone: each group all-gathers in its
    own pre-backward."""
    return mock.patch.object(_group_cls(), "_backward_prefetch", lambda self: None)


@fault("fsdp2-forward-prefetch-ignored")
def fsdp2_forward_prefetch_ignored():
    """set_modules_to_forward_prefetch does nothing."""
    from torch.distributed.fsdp import FSDPModule

    return mock.patch.object(FSDPModule, "set_modules_to_forward_prefetch", lambda self, modules: None)


@fault("fsdp1-root-reshards-after-forward")
def fsdp1_root_reshards_after_forward():
    """FSDP1 frees the root unit's parameters after forward too: the root
    all-gathers again in backward."""
    from torch.distributed.fsdp import _runtime_utils as ru
    from torch.distributed.fsdp import fully_sharded_data_parallel as fsdp_module

    def post_forward_reshard(state, handle):
        if handle:
            ru._reshard(state, handle, handle._sharding_strategy in ru.RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES)

    # FullyShardedDataParallel.forward passes its own import to _post_forward
    return _both(mock.patch.object(ru, "_post_forward_reshard", post_forward_reshard),
                 mock.patch.object(fsdp_module, "_post_forward_reshard", post_forward_reshard))


@fault("fsdp1-no-sync-frees-unsharded")
def fsdp1_no_sync_frees_unsharded():
    """Inside no_sync, SHARD_GRAD_OP frees the unsharded parameters after
    backward as when syncing (the mutant of the same name): the next
    forward all-gathers them again."""
    from torch.distributed.fsdp import _runtime_utils as ru

    return mock.patch.object(ru, "_should_free_in_backward", lambda state, handle: handle.uses_sharded_strategy)


@fault("fsdp1-no-sync-ignored")
def fsdp1_no_sync_ignored():
    """no_sync() no longer disables gradient synchronization: every
    backward inside it reduce-scatters."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return mock.patch.object(FSDP, "no_sync", lambda self: contextlib.nullcontext())


@contextlib.contextmanager
def _both(a, b):
    with a, b:
        yield


@fault("fsdp1-reduce-in-param-dtype")
def fsdp1_reduce_in_param_dtype():
    """FSDP1 ignores reduce_dtype: gradients reduced in param_dtype."""
    from torch.distributed.fsdp import _flat_param

    orig = _flat_param.FlatParamHandle.__init__

    def init(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        if self._fwd_bwd_param_dtype is not None:
            self._reduce_dtype = self._fwd_bwd_param_dtype

    return mock.patch.object(_flat_param.FlatParamHandle, "__init__", init)


@fault("fsdp1-backward-prefetch-ignored")
def fsdp1_backward_prefetch_ignored():
    """backward_prefetch ignored: nothing is prefetched in backward."""
    from torch.distributed.fsdp import _runtime_utils as ru
    from torch.distributed.fsdp._flat_param import HandleTrainingState

    orig = ru._get_handle_to_prefetch

    def get(state, handle):
        if handle._training_state in (HandleTrainingState.BACKWARD_PRE, HandleTrainingState.BACKWARD_POST):
            return None
        return orig(state, handle)

    return mock.patch.object(ru, "_get_handle_to_prefetch", get)


@fault("fsdp1-forward-prefetch-ignored")
def fsdp1_forward_prefetch_ignored():
    """forward_prefetch=True ignored: each unit all-gathers in its own pre-forward."""
    from torch.distributed.fsdp import _runtime_utils as ru
    from torch.distributed.fsdp._flat_param import HandleTrainingState

    orig = ru._get_handle_to_prefetch

    def get(state, handle):
        if handle._training_state == HandleTrainingState.FORWARD:
            return None
        return orig(state, handle)

    return mock.patch.object(ru, "_get_handle_to_prefetch", get)


@fault("fsdp1-backward-prefetch-off-by-one")
def fsdp1_backward_prefetch_off_by_one():
    """Backward prefetch off by one: a unit prefetches the unit two before
    it in post-forward order, not the next to run backward."""
    from torch.distributed.fsdp._exec_order_utils import _ExecOrderData

    def get(self, current_handle):
        i = current_handle._post_forward_index
        return None if i is None or i < 2 else self.handles_post_forward_order[i - 2]

    return mock.patch.object(_ExecOrderData, "get_handle_to_backward_prefetch", get)


@fault("fsdp1-backward-pre-prefetches-post")
def fsdp1_backward_pre_prefetches_post():
    """BACKWARD_PRE treated as BACKWARD_POST: the next unit is prefetched
    in the post-backward hook, after the current gradient computation."""
    from torch.distributed.fsdp import BackwardPrefetch
    from torch.distributed.fsdp import _runtime_utils as ru
    from torch.distributed.fsdp._flat_param import HandleTrainingState

    orig = ru._get_handle_to_prefetch

    def get(state, handle):
        if state.backward_prefetch == BackwardPrefetch.BACKWARD_PRE and handle._training_state == HandleTrainingState.BACKWARD_PRE:
            return None
        if state.backward_prefetch == BackwardPrefetch.BACKWARD_PRE and handle._training_state == HandleTrainingState.BACKWARD_POST:
            state.backward_prefetch = BackwardPrefetch.BACKWARD_POST
            try:
                return orig(state, handle)
            finally:
                state.backward_prefetch = BackwardPrefetch.BACKWARD_PRE
        return orig(state, handle)

    return mock.patch.object(ru, "_get_handle_to_prefetch", get)


@fault("fsdp1-unit-given-a-view-of-its-input")
def fsdp1_unit_given_a_view_of_its_input():
    """FSDP1's pre-forward hands each unit a view of its input tensors (a
    copy or cast that always makes a new tensor): a frozen unit's
    reshard-only hook then sits on the view and fires before the
    pre-backward hooks on the activation itself, so BACKWARD_POST prefetches
    the outer of two nested units before the inner one, which runs backward
    first."""
    import torch
    from torch.distributed.fsdp import _runtime_utils as ru
    from torch.distributed.fsdp import fully_sharded_data_parallel as fsdp_mod

    orig = ru._pre_forward

    def pre_forward(state, handle, unshard_fn, module, args, kwargs):
        args = tuple(a.view_as(a) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args)
        return orig(state, handle, unshard_fn, module, args, kwargs)

    return mock.patch.object(fsdp_mod, "_pre_forward", pre_forward)


@fault("fsdp1-sequential-unit-kept-after-forward")
def fsdp1_sequential_unit_kept_after_forward():
    """FSDP1 takes a unit that is torch's Sequential for a container and
    skips its post-forward reshard: it stays unsharded into backward, which
    then gathers nothing for it."""
    import torch.nn as nn
    from torch.distributed.fsdp import _runtime_utils as ru
    from torch.distributed.fsdp import fully_sharded_data_parallel as fsdp_module

    orig = ru._post_forward_reshard

    def post_forward_reshard(state, handle):
        if handle is not None and type(handle._fully_sharded_module) is nn.Sequential:
            return None
        return orig(state, handle)

    return _both(mock.patch.object(ru, "_post_forward_reshard", post_forward_reshard),
                 mock.patch.object(fsdp_module, "_post_forward_reshard", post_forward_reshard))


@fault("fsdp2-sequential-group-never-resharded")
def fsdp2_sequential_group_never_resharded():
    """fully_shard takes a group of torch's Sequential for a container and
    never reshards it: it stays unsharded, so neither its backward nor the
    next forward gathers for it."""
    from conformance.case.build import is_torch_sequential

    cls = _group_cls()
    orig = cls.reshard

    def reshard(self, *args, **kwargs):
        if self.modules and all(is_torch_sequential(m) for m in self.modules):
            return None
        return orig(self, *args, **kwargs)

    return mock.patch.object(cls, "reshard", reshard)


@fault("fsdp1-flat-param-keeps-requires-grad")
def fsdp1_flat_param_keeps_requires_grad():
    """use_orig_params=True: a FlatParameter that once required grad keeps
    requiring it after its unit's original parameters were all frozen (the
    mutant fsdp1-flat-param-requires-grad-not-reset): the frozen unit's
    gradient is still computed and reduce-scattered."""
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    orig = FlatParamHandle._reset_flat_param_grad_info_if_needed

    def reset(self):
        was = self.flat_param.requires_grad
        orig(self)
        self.flat_param.requires_grad = self.flat_param.requires_grad or was

    return mock.patch.object(FlatParamHandle, "_reset_flat_param_grad_info_if_needed", reset)


@fault("fsdp2-unsharded-param-keeps-requires-grad")
def fsdp2_unsharded_param_keeps_requires_grad():
    """FSDP2's all-gather no longer copies the sharded parameter's
    requires_grad to the unsharded one: a parameter frozen between
    iterations still gets a gradient, reduce-scattered with its group."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    return mock.patch.object(_fsdp_param, "set_requires_grad_if_needed", lambda src, dst: None)


def _faulty(name: str):
    def run(spec: CaseSpec) -> dict:
        from conformance.areas.comm import adapter

        with FAULTS[name]():
            return adapter.observe(spec).to_dict()

    run.__name__ = run.__qualname__ = f"faulty_comm_{name}".replace("-", "_")
    return run


for _name in FAULTS:
    scenario(f"fault:comm:{_name}", test_only=True)(_faulty(_name))
