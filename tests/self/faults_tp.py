"""Faults injected into tensor parallelism + FSDP2 (the parallel styles,
FSDP2's 2-D sharding and mixed precision, the full state dict's load,
clip_grad_norm_ over DTensors), as context managers, and test-only
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


@fault("colwise-shards-dim-1")
def colwise_shards_dim_1():
    """ColwiseParallel shards a Linear's weight as RowwiseParallel does (dim 1, bias replicated)."""
    from torch.distributed.tensor.parallel.style import ColwiseParallel, RowwiseParallel

    return mock.patch.object(ColwiseParallel, "_partition_linear_fn", RowwiseParallel._partition_linear_fn)


@fault("strided-shard-dropped")
def strided_shard_dropped():
    """fully_shard's 2-D path gives a TP Shard(0) parameter plain Shard(0) on dp
    instead of _StridedShard(0, split_factor=tp): the dp chunks are then read as
    if taken before the tp chunks."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param
    from torch.distributed.tensor import Shard

    return mock.patch.object(_fsdp_param, "_StridedShard", lambda dim, split_factor: Shard(dim))


@fault("rowwise-output-not-reduced")
def rowwise_output_not_reduced():
    """RowwiseParallel returns its Partial output's local part without the all-reduce."""
    from torch.distributed.tensor.parallel.style import RowwiseParallel

    def output(output_layouts, use_local_output, mod, outputs, device_mesh):
        return outputs.to_local() if use_local_output else outputs

    return mock.patch.object(RowwiseParallel, "_prepare_output_fn", staticmethod(output))


@fault("rowwise-ignores-input-layouts")
def rowwise_ignores_input_layouts():
    """RowwiseParallel reads a plain input as Replicate whatever its
    input_layouts: a colwise leaf's Shard(-1) output (a pair's hidden
    activation) is then taken for the whole tensor and sliced again."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel.style import RowwiseParallel

    orig = RowwiseParallel._prepare_input_fn

    def prepare(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        return orig((Replicate(),), desired_input_layouts, mod, inputs, device_mesh)

    return mock.patch.object(RowwiseParallel, "_prepare_input_fn", staticmethod(prepare))


@fault("full-state-dict-load-dropped")
def full_state_dict_load_dropped():
    """set_model_state_dict(full_state_dict=True) returns without loading anything."""
    from torch.distributed.checkpoint import state_dict as sd_mod

    return mock.patch.object(sd_mod, "_load_model_state_dict", lambda *a, **k: None)


@fault("param-dtype-ignored")
def param_dtype_ignored():
    """FSDP2 drops the MixedPrecisionPolicy's param_dtype: the unsharded parameters stay float32."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    orig = FSDPParam.init_dtype_attrs

    def init(self, mp_policy):
        orig(self, mp_policy)
        self.param_dtype = None

    return mock.patch.object(FSDPParam, "init_dtype_attrs", init)


@fault("clip-norm-of-local-shards")
def clip_norm_of_local_shards():
    """clip_grad_norm_ takes the norm of each rank's local shards, with no reduction across ranks."""
    from torch.nn.utils import clip_grad

    orig = clip_grad._get_total_norm

    def local(tensors, *args, **kwargs):
        if hasattr(tensors, "device_mesh") or not isinstance(tensors, (list, tuple)):
            tensors = [tensors]
        return orig([t.to_local() if hasattr(t, "device_mesh") else t for t in tensors], *args, **kwargs)

    return mock.patch.object(clip_grad, "_get_total_norm", local)


@fault("full-tensor-raises")
def full_tensor_raises():
    """DTensor.full_tensor raises (a regression in the all-gather it runs):
    the area reads the wrapped model's full values through it."""
    from torch.distributed.tensor import DTensor

    def broken(self, *args, **kwargs):
        raise RuntimeError("full_tensor: injected failure")

    return mock.patch.object(DTensor, "full_tensor", broken)


def _faulty(name: str):
    def run(spec: CaseSpec) -> dict:
        from conformance.areas.tp import adapter

        with FAULTS[name]():
            return adapter.observe(spec).to_dict()

    run.__name__ = run.__qualname__ = f"faulty_tp_{name}".replace("-", "_")
    return run


for _name in FAULTS:
    scenario(f"fault:tp:{_name}", test_only=True)(_faulty(_name))
