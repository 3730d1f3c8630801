"""Faults injected into gradient clipping (torch.nn.utils.clip_grad and
FSDP1's clip_grad_norm_), as context managers, and test-only scenarios
that apply one inside a rank of the pool (a monkeypatch in the driver does
not reach rank processes)."""

from __future__ import annotations

import contextlib
import functools
from unittest import mock

from conformance.case.spec import CaseSpec
from conformance.engine.scenarios import scenario

FAULTS = {}


def fault(name):
    def add(fn):
        FAULTS[name] = fn
        return fn

    return add


@fault("dtensor-norm-rank-local")
def dtensor_norm_rank_local():
    """get_total_norm over DTensor gradients returns this rank's local norm
    (replicated), as if the norms' Partial placement were dropped: the
    classic rank-local norm of pytorch#170862."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate
    from torch.nn.utils import clip_grad

    orig = clip_grad._get_total_norm

    def local(tensors, *args, **kwargs):
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        mesh = next((t.device_mesh for t in tensors if isinstance(t, DTensor)), None)
        out = orig([t.to_local() if isinstance(t, DTensor) else t for t in tensors], *args, **kwargs)
        return out if mesh is None else DTensor.from_local(out, mesh, [Replicate()])

    return mock.patch.object(clip_grad, "_get_total_norm", local)


@fault("clip-coef-not-applied")
def clip_coef_not_applied():
    """The gradients are never scaled (clip_grads_with_norm_ does nothing)."""
    import torch.nn.utils as utils
    from torch.nn.utils import clip_grad

    # torch.nn.utils.clip_grads_with_norm_ is the public name of the same function
    return _both(mock.patch.object(clip_grad, "_clip_grads_with_norm_", lambda *a, **k: None),
                 mock.patch.object(utils, "clip_grads_with_norm_", lambda *a, **k: None))


def _fsdp1_method_with(patches):
    """FSDP1's clip_grad_norm_ run with ``patches()`` (context managers) active."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    orig = FSDP.clip_grad_norm_

    @functools.wraps(orig)
    def method(self, *args, **kwargs):
        with contextlib.ExitStack() as stack:
            for p in patches():
                stack.enter_context(p)
            return orig(self, *args, **kwargs)

    return mock.patch.object(FSDP, "clip_grad_norm_", method)


@fault("fsdp1-norm-not-all-reduced")
def fsdp1_norm_not_all_reduced():
    """FSDP1's clip_grad_norm_ skips the all-reduce of the sharded norm:
    every rank returns (and clips with) its own shard's norm."""
    from torch.distributed.fsdp import fully_sharded_data_parallel as fsdp_mod

    def patches():
        return [mock.patch.object(fsdp_mod.dist, "all_reduce", lambda *a, **k: None)]

    return _fsdp1_method_with(patches)


@fault("fsdp1-nonsharded-norm-counted-per-rank")
def fsdp1_nonsharded_norm_counted_per_rank():
    """FSDP1's clip_grad_norm_ counts the non-sharded gradients (NO_SHARD
    units, ignored parameters) once per rank, as all-reducing their local
    norm would (the method's own comment warns of it)."""
    import math

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_sharded_data_parallel as fsdp_mod

    orig = fsdp_mod._get_grad_norm

    def patches():
        calls = []

        def counted(params, norm_type, *args, **kwargs):
            out = orig(params, norm_type, *args, **kwargs)
            calls.append(1)
            if len(calls) == 2 and norm_type != math.inf:  # the second call: the non-sharded norm
                out = out * dist.get_world_size() ** (1.0 / norm_type)
            return out

        return [mock.patch.object(fsdp_mod, "_get_grad_norm", counted)]

    return _fsdp1_method_with(patches)


@fault("fsdp1-clip-coef-not-clamped")
def fsdp1_clip_coef_not_clamped():
    """FSDP1's clip_grad_norm_ drops the clamp of its coefficient at 1: a
    norm below max_norm scales the gradients up."""
    import torch

    def patches():
        return [mock.patch.object(torch, "clamp", lambda t, *a, **k: t)]

    return _fsdp1_method_with(patches)


@fault("fsdp1-summon-with-grads-raises")
def fsdp1_summon_with_grads_raises():
    """FSDP1's summon_full_params(with_grads=True) cannot gather the
    gradients (FlatParamHandle.unshard_grad raises): the documented way to
    read them whole before the clip fails."""
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    def unshard_grad(self):
        raise RuntimeError("unshard_grad: the sharded gradient has no flat view")

    return mock.patch.object(FlatParamHandle, "unshard_grad", unshard_grad)


@fault("fsdp1-norm-returned-in-bf16")
def fsdp1_norm_returned_in_bf16():
    """FSDP1's clip_grad_norm_ returns the total norm in the compute dtype
    (bf16) where its parameters and gradients are fp32, as taking the
    dtype from the mixed-precision policy instead of the gradients would."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    orig = FSDP.clip_grad_norm_

    @functools.wraps(orig)
    def method(self, *args, **kwargs):
        return orig(self, *args, **kwargs).to(torch.bfloat16)

    return mock.patch.object(FSDP, "clip_grad_norm_", method)


@fault("rank1-norm-raises")
def rank1_norm_raises():
    """The norm raises on rank 1 only, before any collective (as an empty
    local shard makes the inf norm do)."""
    import torch.distributed as dist
    from torch.nn.utils import clip_grad

    orig = clip_grad._get_total_norm

    def failing(*args, **kwargs):
        if dist.get_rank() == 1:
            raise RuntimeError("injected: this rank's local norm fails")
        return orig(*args, **kwargs)

    # torch.nn.utils.get_total_norm is the public name of the same function
    import torch.nn.utils as utils

    return _both(mock.patch.object(clip_grad, "_get_total_norm", failing), mock.patch.object(utils, "get_total_norm", failing))


@contextlib.contextmanager
def _both(*patches):
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


@fault("fsdp1-summon-params-raises")
def fsdp1_summon_params_raises():
    """FSDP1's summon_full_params raises unless asked for gradients: the
    clip itself (FSDP.clip_grad_norm_) runs, the read of the stepped
    model's full values after it fails."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    orig = FSDP.summon_full_params

    @contextlib.contextmanager
    def broken(*args, **kwargs):
        if not kwargs.get("with_grads"):
            raise RuntimeError("summon_full_params: injected failure")
        with orig(*args, **kwargs):
            yield

    return mock.patch.object(FSDP, "summon_full_params", staticmethod(broken))


def _faulty(name: str):
    def run(spec: CaseSpec) -> dict:
        from conformance.areas.clip import adapter

        with FAULTS[name]():
            return adapter.observe(spec).to_dict()

    run.__name__ = run.__qualname__ = f"faulty_clip_{name}".replace("-", "_")
    return run


def _borrowed():
    from tests.self.faults_training import FAULTS as TRAINING_FAULTS

    FAULTS["fsdp2-frozen-get-zero-grads"] = TRAINING_FAULTS["fsdp2-frozen-get-zero-grads"]


_borrowed()

for _name in FAULTS:
    scenario(f"fault:clip:{_name}", test_only=True)(_faulty(_name))
