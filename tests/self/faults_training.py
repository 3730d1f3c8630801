"""Faults injected into FSDP's mixed precision and gradient accumulation,
as context managers, and test-only scenarios that apply one inside a rank
of the pool (a monkeypatch in the driver does not reach rank processes)."""

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


def _fsdp2_param():
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    return _fsdp_param.FSDPParam


@fault("fsdp2-reduce-in-param-dtype")
def fsdp2_reduce_in_param_dtype():
    """reduce_dtype ignored: gradients reduced in param_dtype."""
    cls = _fsdp2_param()
    orig = cls.init_dtype_attrs

    def init(self, mp_policy):
        orig(self, mp_policy)
        self.reduce_dtype = None

    return mock.patch.object(cls, "init_dtype_attrs", init)


@fault("fsdp2-grad-element-nan")
def fsdp2_grad_element_nan():
    """One element of every reduced gradient comes out NaN (a reduction that
    reads uninitialised padding, say): a NaN compares below any tolerance,
    so the invariants must count it as an infinite error."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

    orig = group.foreach_reduce

    def nan_first(fsdp_params, unsharded_grads, *a, **k):
        for g in unsharded_grads:
            if g.numel():
                g.view(-1)[0] = float("nan")
        return orig(fsdp_params, unsharded_grads, *a, **k)

    return mock.patch.object(group, "foreach_reduce", nan_first)


@fault("fsdp2-param-dtype-ignored")
def fsdp2_param_dtype_ignored():
    """param_dtype ignored: forward computes in the original dtype."""
    cls = _fsdp2_param()
    orig = cls.init_dtype_attrs

    def init(self, mp_policy):
        orig(self, mp_policy)
        self.param_dtype = None

    return mock.patch.object(cls, "init_dtype_attrs", init)


@fault("fsdp2-sync-ignored")
def fsdp2_sync_ignored():
    """set_requires_gradient_sync(False) does nothing: every microbatch reduces."""
    import torch.distributed.fsdp as fsdp

    return mock.patch.object(fsdp.FSDPModule, "set_requires_gradient_sync", lambda self, *a, **k: None)


@fault("fsdp2-unsynced-grads-dropped")
def fsdp2_unsynced_grads_dropped():
    """Gradients of microbatches without sync are dropped instead of accumulated."""
    cls = _fsdp2_param()

    def drop(self):
        if hasattr(self, "_unsharded_param"):
            self._unsharded_param.grad = None
        self.unsharded_accumulated_grad = None

    return mock.patch.object(cls, "to_accumulated_grad_if_needed", drop)


@fault("fsdp2-unsynced-grads-accumulate-in-param-dtype")
def fsdp2_unsynced_grads_accumulate_in_param_dtype():
    """With gradient sync off, the unsharded gradients stay in param_dtype
    (bf16) and accumulate there, not in reduce_dtype (fp32): a bf16 rounding
    per microbatch, inside MP-DTYPES' dtype-aware tolerance."""
    return mock.patch.object(_fsdp2_param(), "to_accumulated_grad_if_needed", lambda self: None)


@fault("fsdp2-accumulated-grad-rounded-to-param-dtype")
def fsdp2_accumulated_grad_rounded_to_param_dtype():
    """The reduce_dtype (fp32) running sum of unsynced gradients is rounded
    to the gradient's param_dtype (bf16) before each microbatch's gradient is
    added: the selfcheck mutant of the same name, as a fault."""

    def accumulate(self):
        if self.unsharded_accumulated_grad is not None and self.unsharded_param.grad is not None:
            acc = self.unsharded_accumulated_grad
            acc.copy_(acc.to(self.unsharded_param.grad.dtype) + self.unsharded_param.grad)
            self.unsharded_param.grad = None

    return mock.patch.object(_fsdp2_param(), "accumulate_unsharded_grad_if_needed", accumulate)


@fault("fsdp2-frozen-get-zero-grads")
def fsdp2_frozen_get_zero_grads():
    """Frozen parameters of a group that reduced get a (zero) gradient, as if
    reduce_scatter_unused_params ignored requires_grad."""
    import torch
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    cls = _fsdp_param_group.FSDPParamGroup
    orig = cls.post_backward

    def post_backward(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        if self.reduce_grads:
            for fp in self.fsdp_params:
                if not fp.sharded_param.requires_grad and fp.sharded_param.grad is None:
                    fp.sharded_param.grad = torch.zeros_like(fp.sharded_param)
        return out

    return mock.patch.object(cls, "post_backward", post_backward)


@fault("fsdp2-cast-forward-inputs-ignored")
def fsdp2_cast_forward_inputs_ignored():
    """FSDP2 casts floating forward inputs to param_dtype whatever
    MixedPrecisionPolicy.cast_forward_inputs says."""
    import functools

    from torch.distributed.fsdp._fully_shard import _fsdp_state
    from torch.distributed.utils import _apply_to_tensors

    def cast(self, args, kwargs):
        if not self._mp_policy.param_dtype:
            return args, kwargs
        fn = functools.partial(_fsdp_state._cast_fp_tensor, self._mp_policy.param_dtype)
        return _apply_to_tensors(fn, args), _apply_to_tensors(fn, kwargs)

    return mock.patch.object(_fsdp_state.FSDPState, "_cast_forward_inputs", cast)


@fault("fsdp1-cast-root-forward-inputs-ignored")
def fsdp1_cast_root_forward_inputs_ignored():
    """FSDP1's root casts its forward inputs to param_dtype whatever
    MixedPrecision.cast_root_forward_inputs says."""
    from torch.distributed.fsdp import _runtime_utils
    from torch.distributed.utils import _cast_forward_inputs

    def root_cast(state, module, args, kwargs):
        return _cast_forward_inputs(state.mixed_precision.param_dtype, *args, **kwargs)

    return mock.patch.object(_runtime_utils, "_root_cast_forward_input", root_cast)


@fault("fsdp1-buffers-not-cast")
def fsdp1_buffers_not_cast():
    """FSDP1 ignores buffer_dtype."""
    from torch.distributed.fsdp import _runtime_utils

    orig = _runtime_utils._cast_buffers_to_dtype_and_device

    def cast(buffers, buffer_dtypes, device):
        return orig(buffers, [None] * len(buffer_dtypes), device)

    return mock.patch.object(_runtime_utils, "_cast_buffers_to_dtype_and_device", cast)


@fault("fsdp1-grads-not-upcast")
def fsdp1_grads_not_upcast():
    """FSDP1 keeps low-precision gradients although keep_low_precision_grads=False."""
    from torch.distributed.fsdp import _flat_param

    orig = _flat_param.FlatParamHandle.__init__

    def init(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        self._keep_low_precision_grads = True

    return mock.patch.object(_flat_param.FlatParamHandle, "__init__", init)


@fault("fsdp1-no-sync-ignored")
def fsdp1_no_sync_ignored():
    """FSDP1's no_sync() is a no-op: every microbatch reduces."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return mock.patch.object(FSDP, "no_sync", lambda self: contextlib.nullcontext())


@fault("fsdp1-no-shard-grad-not-all-reduced")
def fsdp1_no_shard_grad_not_all_reduced():
    """NO_SHARD's post-backward skips the all-reduce: each rank keeps its
    own gradient (divided as if averaged) and steps with it."""
    from torch.distributed.fsdp import _runtime_utils as ru

    def no_all_reduce(state, handle):
        flat_param = handle.flat_param
        ru._div_if_needed(flat_param.grad, state._gradient_predivide_factor)
        ru._div_if_needed(flat_param.grad, state._gradient_postdivide_factor)
        if not handle._keep_low_precision_grads:
            ru._cast_grad_to_param_dtype(state, flat_param.grad, flat_param)
        ru._post_reduce_grad_callback(state, handle, flat_param.grad.data)

    return mock.patch.object(ru, "_reduce_grad_no_shard", no_all_reduce)


@fault("fsdp1-reduce-dtype-ignored")
def fsdp1_reduce_dtype_ignored():
    """FSDP1 ignores reduce_dtype (and its param_dtype default): gradients
    are reduced in float32 where a low precision was asked (MP-DTYPES sees
    the collective's dtype; MP-PIPELINE the values, a bf16 rounding off)."""
    import torch
    from torch.distributed.fsdp import _flat_param

    orig = _flat_param.FlatParamHandle.__init__

    def init(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        self._reduce_dtype = torch.float32

    return mock.patch.object(_flat_param.FlatParamHandle, "__init__", init)


@fault("fsdp1-reduce-in-param-dtype")
def fsdp1_reduce_in_param_dtype():
    """FSDP1 skips the cast to reduce_dtype: gradients reduced in param_dtype."""
    from torch.distributed.fsdp import _flat_param

    orig = _flat_param.FlatParamHandle.__init__

    def init(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        if self._fwd_bwd_param_dtype is not None:
            self._reduce_dtype = self._fwd_bwd_param_dtype

    return mock.patch.object(_flat_param.FlatParamHandle, "__init__", init)


@fault("fsdp1-reduced-grads-rounded-to-param-dtype")
def fsdp1_reduced_grads_rounded_to_param_dtype():
    """FSDP1 casts the reduced sharded gradient back to the parameter's
    dtype through param_dtype (keep_low_precision_grads' cast applied
    unconditionally first): with reduce_dtype=float32 the gradient ends in
    float32, as promised, but rounded to bf16 once more. Inside MP-DTYPES'
    dtype-aware tolerance, outside MP-PIPELINE's."""
    from torch.distributed.fsdp import _runtime_utils

    orig = _runtime_utils._cast_grad_to_param_dtype

    def cast(state, sharded_grad, param):
        low = state._handle._fwd_bwd_param_dtype
        if sharded_grad.dtype != low:
            sharded_grad.data = sharded_grad.data.to(low)
        return orig(state, sharded_grad, param)

    return mock.patch.object(_runtime_utils, "_cast_grad_to_param_dtype", cast)


# --- one rank fails, the others go on (the suite must not wait for it) ---
def _on_rank_1(orig):
    def fail_on_rank_1(*args, **kwargs):
        import torch.distributed as dist

        if dist.get_rank() == 1:
            raise RuntimeError("injected: this rank fails, the others go on")
        return orig(*args, **kwargs)

    return fail_on_rank_1


@fault("rank1-post-backward-raises")
def rank1_post_backward_raises():
    """FSDP1's post-backward callback raises on rank 1 only, after every
    collective of the backward (as a gradient that lives on one rank's shard
    can make it)."""
    from torch.distributed.fsdp import _flat_param

    cls = _flat_param.FlatParamHandle
    return mock.patch.object(cls, "prepare_gradient_for_optim", _on_rank_1(cls.prepare_gradient_for_optim))


@fault("rank1-optimizer-raises")
def rank1_optimizer_raises():
    """The optimizer step raises on rank 1 only."""
    import torch

    return mock.patch.object(torch.optim.SGD, "step", _on_rank_1(torch.optim.SGD.step))



def _faulty(name: str):
    def run(spec: CaseSpec) -> dict:
        from conformance.areas.schedule import adapter as schedule

        with FAULTS[name]():
            return schedule.observe(spec).to_dict()

    run.__name__ = run.__qualname__ = f"faulty_schedule_{name}".replace("-", "_")
    return run


for _name in FAULTS:
    scenario(f"fault:schedule:{_name}", test_only=True)(_faulty(_name))


# FSDP2 faults of the PARITY tests that ACCUM and MP-DTYPES must catch too.
def _borrowed():
    from tests.self.faults_fsdp2 import FAULTS as FSDP2_FAULTS

    for name in ("gradients-doubled",):
        FAULTS[name] = FSDP2_FAULTS[name]
        scenario(f"fault:schedule:{name}", test_only=True)(_faulty(name))


_borrowed()


@scenario("fault:train:adam-default-eps", test_only=True)
def _train_with_default_adam_eps(spec: CaseSpec) -> dict:
    """PARITY's training with Adam's default eps (1e-8) instead of the suite's
    (tests/self/test_parity_numerics.py: rounding noise then moves a
    parameter whose exact gradient is zero by a whole lr)."""
    from conformance.areas.common import training as common_training
    from conformance.areas.parity import adapter as training

    with mock.patch.object(common_training, "ADAM_EPS", 1e-8):
        return training.observe(spec).to_dict()


@scenario("fault:train:fsdp1-summon-raises", test_only=True)
def _train_with_summon_raising(spec: CaseSpec) -> dict:
    """PARITY's training with FSDP1's summon_full_params raising (the read
    of the trained values goes through it)."""
    from conformance.areas.parity import adapter as training
    from tests.self.faults_init_order import FAULTS as INIT_FAULTS

    with INIT_FAULTS["fsdp1-summon-raises"]():
        return training.observe(spec).to_dict()
