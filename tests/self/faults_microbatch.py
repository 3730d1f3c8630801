"""Faults injected into FSDP2's schedule APIs, as context managers, and the
test-only scenarios that apply one around the microbatch area's observation
inside a rank (the fake tier's in-process rank, or a pool's: a monkeypatch
in the driver does not reach rank processes)."""

from __future__ import annotations

import inspect
from unittest import mock

from conformance.case.spec import CaseSpec
from conformance.engine.scenarios import scenario

FAULTS = {}


def fault(name):
    def add(fn):
        FAULTS[name] = fn
        return fn

    return add


def _module_cls():
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def _group_cls():
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    return _fsdp_param_group.FSDPParamGroup


@fault("gradient-sync-ignored")
def gradient_sync_ignored():
    """set_requires_gradient_sync(False) does nothing: every microbatch
    reduce-scatters."""
    return mock.patch.object(_module_cls(), "set_requires_gradient_sync", lambda self, *a, **k: None)


@fault("reshard-after-backward-ignored")
def reshard_after_backward_ignored():
    """set_reshard_after_backward(False) does nothing: the groups reshard
    after every backward and all-gather again in the next forward."""
    return mock.patch.object(_module_cls(), "set_reshard_after_backward", lambda self, *a, **k: None)


@fault("reshard-after-backward-sticks")
def reshard_after_backward_sticks():
    """set_reshard_after_backward(True) after a False is ignored: the groups
    stay unsharded after the last backward."""
    cls = _module_cls()
    orig = cls.set_reshard_after_backward

    def setter(self, value, *, recurse=True):
        if not value:
            orig(self, value, recurse=recurse)

    return mock.patch.object(cls, "set_reshard_after_backward", setter)


@fault("explicit-unshard-ignored")
def explicit_unshard_ignored():
    """unshard() (sync or async) does nothing: the module all-gathers in its
    own pre-forward instead."""
    class Handle:
        def wait(self):
            return None

    return mock.patch.object(_module_cls(), "unshard", lambda self, async_op=False: Handle() if async_op else None)


@fault("shard-placement-fn-ignored")
def shard_placement_fn_ignored():
    """fully_shard's shard_placement_fn is dropped: every parameter is
    Shard(0) (padded)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    cls = _fsdp_param.FSDPParam
    orig = cls.__init__

    def init(self, param, module_info, mesh_info, post_forward_mesh_info, device, shard_placement_fn, *args, **kwargs):
        orig(self, param, module_info, mesh_info, post_forward_mesh_info, device, None, *args, **kwargs)

    return mock.patch.object(cls, "__init__", init)


@fault("unsynced-grads-dropped")
def unsynced_grads_dropped():
    """A backward without gradient sync drops the gradients it computed
    instead of accumulating them for the next synced one."""
    cls = _group_cls()
    orig = cls.post_backward

    def post_backward(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        if not self.reduce_grads:
            for fp in self.fsdp_params:
                if hasattr(fp, "_unsharded_param"):
                    fp.unsharded_param.grad = None
                fp.unsharded_accumulated_grad = None
        return out

    return mock.patch.object(cls, "post_backward", post_backward)


@fault("reset-iter-state-skipped")
def reset_iter_state_skipped():
    """reset_iter_state() does nothing: the groups an aborted iteration left
    mid-forward or mid-backward keep their training state and their
    unsharded parameters."""
    return mock.patch.object(_module_cls(), "reset_iter_state", lambda self: None)


@fault("reset-leaves-groups-unsharded")
def reset_leaves_groups_unsharded():
    """reset_iter_state() clears the per-iteration trackers but reshards no
    group: a group the aborted forward all-gathered stays unsharded, so the
    restarted sequence's first forward all-gathers nothing for it."""
    cls = _group_cls()
    return mock.patch.object(cls, "_reset_iter_state", lambda self: setattr(self, "_training_state", type(self._training_state).IDLE))


@fault("reset-keeps-post-forward-order")
def reset_keeps_post_forward_order():
    """reset_iter_state() keeps the aborted forward's post-forward order: the
    restarted backward prefetches by the stale order (the first group to
    have run forward all-gathers the aborted forward's last group again)."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    orig = FSDPState._reset_iter_state

    def reset(self):
        kept = list(self._comm_ctx.post_forward_order)
        orig(self)
        self._comm_ctx.post_forward_order[:0] = kept

    return mock.patch.object(FSDPState, "_reset_iter_state", reset)


@fault("unshard-in-backward-ignored")
def unshard_in_backward_ignored():
    """set_unshard_in_backward(False) does nothing: the group all-gathers in
    backward as any other."""
    return mock.patch.object(_module_cls(), "set_unshard_in_backward", lambda self, value: None)


@fault("unshard-in-backward-skips-forward")
def unshard_in_backward_skips_forward():
    """A group told set_unshard_in_backward(False) skips its forward
    all-gather too (the early return no longer asks for PRE_BACKWARD): its
    forward reads the sharded parameters."""
    cls = _group_cls()
    orig = cls.unshard

    def unshard(self, async_op=False):
        if not self.unshard_in_backward and not self.is_unsharded:
            return None
        return orig(self, async_op)

    return mock.patch.object(cls, "unshard", unshard)


@fault("all-reduce-hook-ignored")
def all_reduce_hook_ignored():
    """set_all_reduce_hook does nothing: the hook is never called and the
    gradients are not scaled."""
    return mock.patch.object(_module_cls(), "set_all_reduce_hook", lambda self, hook, **kwargs: None)


@fault("all-reduce-hook-on-a-copy")
def all_reduce_hook_on_a_copy():
    """The all-reduce hook is given a copy of the reduce-scatter output: it
    runs, but what it does in place never reaches the gradients."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    orig = _fsdp_param_group.foreach_reduce
    signature = inspect.signature(orig)

    def foreach_reduce(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        hook = bound.arguments.get("all_reduce_hook")
        if hook is not None:
            bound.arguments["all_reduce_hook"] = lambda t: hook(t.clone())
        return orig(*bound.args, **bound.kwargs)

    return mock.patch.object(_fsdp_param_group, "foreach_reduce", foreach_reduce)


def _hooks_moved(run_before: bool):
    """FSDP2's reduce with each sharded parameter's post-accumulate-grad
    hooks hidden while it writes the gradient, after running them first
    where ``run_before`` (they then see the previous .grad)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    orig = _fsdp_param_group.foreach_reduce

    def foreach_reduce(fsdp_params, *args, **kwargs):
        params = [fp.sharded_param for fp in fsdp_params]
        saved = [getattr(p, "_post_accumulate_grad_hooks", None) for p in params]
        for p, hooks in zip(params, saved):
            for hook in (hooks or {}).values() if run_before else ():
                hook(p)
            p._post_accumulate_grad_hooks = None
        try:
            return orig(fsdp_params, *args, **kwargs)
        finally:
            for p, hooks in zip(params, saved):
                p._post_accumulate_grad_hooks = hooks

    return mock.patch.object(_fsdp_param_group, "foreach_reduce", foreach_reduce)


@fault("grad-hooks-skipped")
def grad_hooks_skipped():
    """The reduce-scatter no longer runs the sharded parameters'
    post-accumulate-grad hooks (the mutant fsdp2-post-accumulate-grad-hooks-skipped)."""
    return _hooks_moved(run_before=False)


@fault("grad-hooks-before-accumulation")
def grad_hooks_before_accumulation():
    """Each parameter's post-accumulate-grad hooks run before FSDP2 adds the
    reduced gradient to the one accumulated: they see the previous .grad."""
    return _hooks_moved(run_before=True)


@fault("custom-all-gather-ignored")
def custom_all_gather_ignored():
    """set_custom_all_gather does nothing: the group all-gathers through
    FSDP's default."""
    return mock.patch.object(_module_cls(), "set_custom_all_gather", lambda self, comm: None)


@fault("custom-reduce-scatter-ignored")
def custom_reduce_scatter_ignored():
    """set_custom_reduce_scatter does nothing: the group reduce-scatters
    through FSDP's default."""
    return mock.patch.object(_module_cls(), "set_custom_reduce_scatter", lambda self, comm: None)


@fault("unused-params-flag-ignored")
def unused_params_flag_ignored():
    """set_reduce_scatter_unused_params(True) does nothing: a rank that
    passed over some modules reduce-scatters fewer elements than the others."""
    return mock.patch.object(_module_cls(), "set_reduce_scatter_unused_params", lambda self, value, **kwargs: None)


@fault("unused-params-nonzero-grad")
def unused_params_nonzero_grad():
    """The gradient a rank reduce-scatters for a parameter it did not use is
    ones, not zeros: the other ranks' gradients come out shifted."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    cls = _fsdp_param.FSDPParam

    def ones(self):
        import torch

        return self._get_grad_inner_tensor(torch.ones_like(self.unsharded_param))

    return mock.patch.object(cls, "unsharded_zero_grad_data", property(ones))


@fault("separate-rs-group-ignored")
def separate_rs_group_ignored():
    """set_separate_reduce_scatter_group does nothing: reduce-scatters stay
    on the shard group."""
    return mock.patch.object(_module_cls(), "set_separate_reduce_scatter_group", lambda self, enable=True, **kwargs: None)


@fault("separate-rs-group-per-group")
def separate_rs_group_per_group():
    """Each parameter group makes a reduce-scatter group of its own (the
    call's cache by shard ranks lost): one per group, not one per call."""
    cls = _group_cls()
    orig = cls._set_separate_reduce_scatter_group
    return mock.patch.object(cls, "_set_separate_reduce_scatter_group", lambda self, enable, new_groups: orig(self, enable, {}))


@fault("separate-rs-group-disable-ignored")
def separate_rs_group_disable_ignored():
    """set_separate_reduce_scatter_group(False) is ignored: reduce-scatters
    stay on the separate group."""
    cls = _group_cls()
    orig = cls._set_separate_reduce_scatter_group

    def setter(self, enable, new_groups):
        if enable:
            orig(self, enable, new_groups)

    return mock.patch.object(cls, "_set_separate_reduce_scatter_group", setter)


@fault("all-reduce-flag-ignored")
def all_reduce_flag_ignored():
    """set_requires_all_reduce(False) does nothing: HSDP all-reduces over the
    replicate dim in every synced microbatch."""
    return mock.patch.object(_module_cls(), "set_requires_all_reduce", lambda self, value, **kwargs: None)


@fault("partial-reduce-dropped")
def partial_reduce_dropped():
    """HSDP: what the reductions without all-reduce accumulated (the partial
    reduce output) is dropped: the all-reducing microbatch reduces its own
    gradients only."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    orig = _fsdp_param_group.foreach_reduce
    signature = inspect.signature(orig)

    def foreach_reduce(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("all_reduce_grads"):
            bound.arguments["partial_reduce_output"] = None
        return orig(*bound.args, **bound.kwargs)

    return mock.patch.object(_fsdp_param_group, "foreach_reduce", foreach_reduce)


def _grad_element_nan():
    """One element of every reduced gradient comes out NaN (the training
    faults' fsdp2-grad-element-nan): MB-GRADS must count it as an infinite
    error, not a pass."""
    from tests.self.faults_training import fsdp2_grad_element_nan

    return fsdp2_grad_element_nan()


FAULTS["grad-element-nan"] = _grad_element_nan


def _full_tensor_raises():
    """Reading a sharded gradient's full value raises (faults_fsdp2's
    full-tensor-raises): the read of the accumulated gradients' full values
    after the last microbatch."""
    from tests.self.faults_fsdp2 import FAULTS as FSDP2_FAULTS

    return FSDP2_FAULTS["full-tensor-raises"]()


FAULTS["full-tensor-raises"] = _full_tensor_raises


def _faulty(name: str):
    def run(spec: CaseSpec) -> dict:
        from conformance.areas.microbatch import adapter

        with FAULTS[name]():
            return adapter.observe(spec).to_dict()

    run.__name__ = run.__qualname__ = f"faulty_microbatch_{name}".replace("-", "_")
    return run


for _name in FAULTS:
    scenario(f"fault:microbatch:{_name}", test_only=True)(_faulty(_name))
