"""Faults injected into FSDP2 and into register_fsdp_forward_method, as
context managers, and test-only scenarios that apply one inside a rank (a
monkeypatch in the driver does not reach the pool's rank processes)."""

from __future__ import annotations

import contextlib
import functools
from unittest import mock

from conformance.case.spec import CaseSpec
from conformance.engine.scenarios import scenario


def _fsdp():
    import torch.distributed.fsdp as fsdp
    from torch.distributed.fsdp._fully_shard import _fsdp_init, _fsdp_param_group, _fsdp_state, _fully_shard

    return fsdp, _fsdp_init, _fsdp_param_group, _fsdp_state, _fully_shard


def _register_with(wrapper_factory, *, check_fsdp=True, check_missing=True, on_class=False):
    """A register_fsdp_forward_method built like torch's, with ``wrapper_factory(orig)`` as the wrapped method."""
    fsdp, *_ = _fsdp()

    def register(module, method_name):
        if check_fsdp and not isinstance(module, fsdp.FSDPModule):
            return
        if not hasattr(module, method_name):
            if check_missing:
                raise ValueError(f"{type(module)} does not have a method {method_name}")
            return
        orig = getattr(module, method_name)
        wrapped = wrapper_factory(orig)
        if on_class:  # the user's own class (FSDP2 puts FSDP<cls> in front of it)
            cls = type(module).__mro__[2] if isinstance(module, fsdp.FSDPModule) else type(module)
            setattr(cls, method_name, wrapped)
        else:
            setattr(module, method_name, wrapped.__get__(module, type(module)))

    return register


def _hooked(orig, *, drop_kwargs=False):
    @functools.wraps(orig)
    def wrapped(self, *args, **kwargs):
        state = self._get_fsdp_state()
        args, kwargs = state._pre_forward(self, args, kwargs)
        out = orig(*args) if drop_kwargs else orig(*args, **kwargs)
        return state._post_forward(self, args, out)

    return wrapped


@contextlib.contextmanager
def patched_register(register):
    fsdp, *_ = _fsdp()
    with mock.patch.object(fsdp, "register_fsdp_forward_method", register):
        yield


FAULTS = {}


def fault(name):
    def add(fn):
        FAULTS[name] = fn
        return fn

    return add


@fault("register-without-hooks")
def register_without_hooks():
    """Registration that patches the method but runs no FSDP hook around it."""
    return patched_register(_register_with(lambda orig: functools.wraps(orig)(lambda self, *a, **k: orig(*a, **k))))


@fault("register-drops-kwargs")
def register_drops_kwargs():
    return patched_register(_register_with(lambda orig: _hooked(orig, drop_kwargs=True)))


@fault("register-non-fsdp-too")
def register_non_fsdp_too():
    return patched_register(_register_with(lambda orig: functools.wraps(orig)(lambda self, *a, **k: orig(*a, **k)), check_fsdp=False))


@fault("register-ignores-missing")
def register_ignores_missing():
    return patched_register(_register_with(_hooked, check_missing=False))


@fault("register-on-class")
def register_on_class():
    return patched_register(_register_with(_hooked, on_class=True))


@fault("register-on-fsdp-class")
def register_on_fsdp_class():
    """torch's wrapper bound to the module but set on type(module), FSDP's
    FSDP<cls>: every FSDP module of the class then runs this one's method
    (the user's class and the reference model are untouched)."""
    fsdp, *_ = _fsdp()

    def register(module, method_name):
        if not isinstance(module, fsdp.FSDPModule):
            return
        if not hasattr(module, method_name):
            raise ValueError(f"{type(module)} does not have a method {method_name}")
        wrapped = _hooked(getattr(module, method_name))
        setattr(type(module), method_name, wrapped.__get__(module, type(module)))

    return patched_register(register)


@fault("managed-states-drop-last")
def managed_states_drop_last():
    _, init, *_ = _fsdp()
    orig = init._get_managed_states

    def drop_last(modules, ignored_params=None):
        params, buffers = orig(modules, ignored_params)
        return params[:-1], buffers

    return mock.patch.object(init, "_get_managed_states", drop_last)


@fault("ignored-params-managed")
def ignored_params_managed():
    _, init, *_ = _fsdp()
    orig = init._get_managed_states

    def manage_all(modules, ignored_params=None):
        return orig(modules, None)

    return mock.patch.object(init, "_get_managed_states", manage_all)


@fault("frozen-made-trainable")
def frozen_made_trainable():
    _, init, *_ = _fsdp()
    orig = init._get_managed_states

    def thaw(modules, ignored_params=None):
        params, buffers = orig(modules, ignored_params)
        for p in params:
            p.requires_grad_(True)
        return params, buffers

    return mock.patch.object(init, "_get_managed_states", thaw)


@fault("no-duplicate-check")
def no_duplicate_check():
    *_, state, _ = _fsdp()
    return mock.patch.object(state.FSDPState, "_validate_no_duplicate_params", lambda self: None)


@fault("never-reshard")
def never_reshard():
    _, _, group, *_ = _fsdp()
    orig = group.FSDPParamGroup.reshard

    def reshard(self):
        if self._training_state == group.TrainingState.FORWARD:
            return
        return orig(self)

    return mock.patch.object(group.FSDPParamGroup, "reshard", reshard)


@fault("post-forward-state-not-reset")
def post_forward_state_not_reset():
    """FSDPState._post_forward leaves the state in FORWARD (the mutant
    fwd-post-forward-state-not-reset): until backward, a later forward or
    registered method skips the root pre-forward, claims no iteration root,
    and nothing completes a list group it runs in part."""
    *_, state, _ = _fsdp()
    orig = state.FSDPState._post_forward

    def post_forward(self, module, input, output):
        out = orig(self, module, input, output)
        self._training_state = state.TrainingState.FORWARD
        return out

    return mock.patch.object(state.FSDPState, "_post_forward", post_forward)


@fault("nested-groups-stay-sharded")
@contextlib.contextmanager
def nested_groups_stay_sharded():
    """Inside a registered method, groups other than the method's own skip
    their unshard (a pre-forward that thinks the method's unshard covers them)."""
    _, _, group, *_ = _fsdp()
    current = []
    orig_unshard = group.FSDPParamGroup.unshard

    def unshard(self, *a, **k):
        if current and current[-1] not in self.modules:
            return
        return orig_unshard(self, *a, **k)

    def factory(orig):
        hooked = _hooked(orig)

        @functools.wraps(orig)
        def wrapped(self, *args, **kwargs):
            current.append(self)
            try:
                return hooked(self, *args, **kwargs)
            finally:
                current.pop()

        return wrapped

    with mock.patch.object(group.FSDPParamGroup, "unshard", unshard), patched_register(_register_with(factory)):
        yield


@fault("registered-output-noise")
def registered_output_noise():
    """Registration that runs FSDP's hooks around the method, as torch's
    does, and returns its output plus noise: a deviation of a registered
    method that has nothing to do with a self-call."""
    import torch

    def factory(orig):
        hooked = _hooked(orig)

        @functools.wraps(orig)
        def wrapped(self, *args, **kwargs):
            out = hooked(self, *args, **kwargs)
            return out + 0.1 * torch.rand_like(out)

        return wrapped

    return patched_register(_register_with(factory))


@fault("summon-does-nothing")
def summon_does_nothing():
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return mock.patch.object(FSDP, "summon_full_params", staticmethod(lambda *a, **k: contextlib.nullcontext()))


@fault("gradients-doubled")
def gradients_doubled():
    _, _, group, *_ = _fsdp()
    orig = group.foreach_reduce

    def doubled(fsdp_params, unsharded_grads, *a, **k):
        for g in unsharded_grads:
            g.mul_(2.0)
        return orig(fsdp_params, unsharded_grads, *a, **k)

    return mock.patch.object(group, "foreach_reduce", doubled)


@fault("sum-reduction-not-divided")
def sum_reduction_not_divided():
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll

    orig = coll._get_gradient_divide_factors

    def no_post_divide(*a, **k):
        pre, post, rs_op, ar_op = orig(*a, **k)
        return pre, (None if pre is None else post), rs_op, ar_op

    return mock.patch.object(coll, "_get_gradient_divide_factors", no_post_divide)


@fault("full-tensor-raises")
def full_tensor_raises():
    """Reading a sharded parameter's or gradient's full value raises (FSDP2
    leaves it unreadable, or the all-gather of the read fails): the
    adapters' read of the full values after backward, both ways it reads
    them: DTensor.full_tensor (the tp faults' own, reused) and the list
    all-gather that fsdp2_adapter.full_tensors gathers FSDP2's Shard(0)
    values with (FSDP2 itself all-gathers into one tensor, not a list)."""
    import torch.distributed as dist

    from tests.self.faults_tp import FAULTS as TP_FAULTS

    def broken(*args, **kwargs):
        raise RuntimeError("all_gather: injected failure")

    stack = contextlib.ExitStack()
    stack.enter_context(TP_FAULTS["full-tensor-raises"]())
    stack.enter_context(mock.patch.object(dist, "all_gather", broken))
    return stack


@fault("fsdp1-sequential-unit-not-unsharded")
def fsdp1_sequential_unit_not_unsharded():
    """FSDP1 takes a unit that is torch's Sequential for a container it only
    iterates and skips its pre-forward unshard: its children then run on the
    rank's own shard."""
    import torch.nn as nn
    from torch.distributed.fsdp import _runtime_utils as rt
    from torch.distributed.fsdp import fully_sharded_data_parallel as fsdp1

    orig = rt._pre_forward_unshard

    def skipping(state, handle):
        if handle is not None and type(handle._fully_sharded_module) is nn.Sequential:
            handle._needs_pre_forward_unshard = False
            return None
        return orig(state, handle)

    stack = contextlib.ExitStack()
    for mod in (fsdp1, rt):  # FullyShardedDataParallel.forward's own import, and the composable path's
        stack.enter_context(mock.patch.object(mod, "_pre_forward_unshard", skipping))
    return stack


@fault("fsdp2-sequential-group-not-unsharded")
def fsdp2_sequential_group_not_unsharded():
    """fully_shard takes a group of torch's Sequential for a container it
    only iterates and never unshards it: its children run on the rank's
    shards."""
    from conformance.case.build import is_torch_sequential

    _, _, group, *_ = _fsdp()
    orig = group.FSDPParamGroup.unshard

    def unshard(self, *args, **kwargs):
        if self.modules and all(is_torch_sequential(m) for m in self.modules):
            return None
        return orig(self, *args, **kwargs)

    return mock.patch.object(group.FSDPParamGroup, "unshard", unshard)


# ---- test-only scenarios: the fault applied inside each rank ----------------


def _faulty(name: str, kind: str):
    def run(spec: CaseSpec) -> dict:
        from conformance.areas.fully_shard import adapter as fsdp2
        from conformance.areas.parity import adapter as training
        from conformance.areas.summon import adapter as fsdp1_methods

        adapter = {"fsdp2": fsdp2, "fsdp1-methods": fsdp1_methods, "train": training}[kind]
        with FAULTS[name]():
            return adapter.observe(spec).to_dict()

    run.__name__ = run.__qualname__ = f"faulty_{kind}_{name}".replace("-", "_")
    return run


for _name in ("register-drops-kwargs", "gradients-doubled", "summon-does-nothing", "frozen-made-trainable", "register-on-fsdp-class",
              "sum-reduction-not-divided", "registered-output-noise", "full-tensor-raises", "fsdp1-sequential-unit-not-unsharded",
              "fsdp2-sequential-group-not-unsharded"):
    for _kind in ("fsdp2", "fsdp1-methods", "train"):
        _fn = _faulty(_name, _kind)
        globals()[_fn.__name__] = _fn
        scenario(f"fault:{_kind}:{_name}", test_only=True)(_fn)
