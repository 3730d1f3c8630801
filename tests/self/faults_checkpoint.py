"""Faults for the checkpoint invariants, applied inside the ranks through
test-only scenarios (a monkeypatch in the driver does not reach a pool's
rank processes): FSDP / torch.distributed.checkpoint regressions that each
invariant must turn red, and engine faults (an unwritable checkpoint
directory, a rank that hangs in the load, a rank that dies in the save)."""

from __future__ import annotations

import os
import time
from unittest import mock

from conformance.case.spec import CaseSpec
from conformance.engine.scenarios import scenario

FAULTS = {}


def fault(name):
    def add(fn):
        FAULTS[name] = fn
        return fn

    return add


@fault("full-sd-perturbed")
def full_sd_perturbed():
    """The full model state dict gathers one value wrong (a shard offset bug)."""
    import torch.distributed.checkpoint.state_dict as sd

    orig = sd._get_model_state_dict

    def wrong(*a, **k):
        out = orig(*a, **k)
        for key in sorted(out)[-1:]:
            out[key] = out[key] + 1.0
        return out

    return mock.patch.object(sd, "_get_model_state_dict", wrong)


@fault("buffers-not-upcast")
def buffers_not_upcast():
    """FSDP1's state dicts no longer cast the buffers back from
    MixedPrecision's buffer_dtype: a checkpoint holds them in bf16."""
    from torch.distributed.fsdp import _state_dict_utils

    return mock.patch.object(_state_dict_utils, "_cast_buffers_to_dtype_and_device", lambda *a, **k: None)


@fault("params-unsharded-low-precision")
def params_unsharded_low_precision():
    """FSDP1's state dict unshards the parameters in param_dtype (the
    handle no longer forces full precision outside forward and backward)."""
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    return mock.patch.object(FlatParamHandle, "_force_full_precision", property(lambda self: False))


@fault("fsdp2-state-dict-not-resharded")
def fsdp2_state_dict_not_resharded():
    """FSDP2 registers no pre-save hook: a group that kept its parameters
    unsharded after forward (the root's) hands state_dict the unsharded
    param_dtype tensors, not the sharded float32 DTensors."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    return mock.patch.object(FSDPParamGroup, "_register_state_dict_hooks", lambda self: None)


@fault("frozen-not-ignored")
def frozen_not_ignored():
    """ignore_frozen_params is dropped on the way to FSDP."""
    import torch.distributed.checkpoint.state_dict as sd

    orig = sd._verify_options

    def verify(model, optims, optim_only, *, submodules=None, options=None):
        if options is not None and options.ignore_frozen_params:
            import dataclasses

            options = dataclasses.replace(options, ignore_frozen_params=False)
        return orig(model, optims, optim_only, submodules=submodules, options=options)

    return mock.patch.object(sd, "_verify_options", verify)


@fault("load-assigns")
def load_assigns():
    """set_model_state_dict loads with assign=True (new Parameter per name)."""
    import torch.nn as nn

    orig = nn.Module.load_state_dict

    def load(self, state_dict, strict=True, assign=False):
        return orig(self, state_dict, strict=strict, assign=True)

    return mock.patch.object(nn.Module, "load_state_dict", load)


@fault("lazy-init-keeps-old-shards")
def lazy_init_keeps_old_shards():
    """FSDP2's lazy init no longer re-reads the sharded parameters: one that
    load_state_dict(assign=True) replaced before the first forward is not
    picked up, and the all-gathers keep reading the old shards."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    return mock.patch.object(FSDPParam, "reset_sharded_param", lambda self: None)


@fault("load-post-hook-keeps-old-shards")
def load_post_hook_keeps_old_shards():
    """FSDPParam's load_state_dict post-hook no longer re-reads the sharded
    parameter: after a load with assign=True into a model that has run (lazy
    init done), the all-gathers keep reading the old shards."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    orig = FSDPParam.reset_sharded_param

    def reset(self):
        import traceback

        if any(f.name == "_load_from_state_dict" or "load_state_dict" in f.name for f in traceback.extract_stack()[:-1]):
            return None
        return orig(self)

    return mock.patch.object(FSDPParam, "reset_sharded_param", reset)


@fault("fsdp1-low-precision-shard-kept")
def fsdp1_low_precision_shard_kept():
    """FSDP1 keeps the param_dtype copy of each shard between forwards and
    casts it once (a saved cast): a load after the first forward writes the
    full-precision shard, and the next forward computes with the old copy."""
    from torch.distributed.fsdp._flat_param import FlatParamHandle
    from torch.distributed.utils import _alloc_storage

    cast = set()

    def use(self):
        flat = self.flat_param
        if id(flat) not in cast:
            cast.add(id(flat))
            _alloc_storage(flat._mp_shard, flat._local_shard.size())
            flat._mp_shard.copy_(flat._local_shard)
        flat.data = flat._mp_shard

    return mock.patch.multiple(FlatParamHandle, _use_low_precision_shard=use, _free_low_precision_sharded_param=lambda self: None)


@fault("fsdp2-cast-shard-kept")
def fsdp2_cast_shard_kept():
    """FSDP2 keeps each group's all-gather inputs cast to param_dtype (cast
    once, a saved cast): a load after the first forward writes the float32
    shards, and the all-gathers keep sending the old bf16 copies."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    orig = _fsdp_collectives._get_param_all_gather_inputs
    kept: dict[tuple, list] = {}

    def inputs(fsdp_params):
        if not any(p.param_dtype is not None for p in fsdp_params):
            return orig(fsdp_params)
        key = tuple(id(p) for p in fsdp_params)
        if key not in kept:
            kept[key] = [[t.clone() for t in ts] for ts in orig(fsdp_params)]
        return kept[key]

    return mock.patch.object(_fsdp_collectives, "_get_param_all_gather_inputs", inputs)


@fault("hyperparameters-as-built")
def hyperparameters_as_built():
    """set_state_dict keeps each param group's hyperparameters as the load
    side built its optimizer (lr, weight_decay ...), not the saved ones: a
    learning-rate schedule's progress is lost at every resume."""
    import torch.distributed.checkpoint.state_dict as sd

    orig = sd._split_optim_state_dict

    def split(model, optim, optim_state_dict, info):
        out = orig(model, optim, optim_state_dict, info)
        for got, built in zip(out["param_groups"], optim.param_groups):
            got.update({k: v for k, v in built.items() if k != "params"})
        return out

    return mock.patch.object(sd, "_split_optim_state_dict", split)


@fault("param-groups-hyperparameters-reversed")
def param_groups_hyperparameters_reversed():
    """set_state_dict hands the saved param groups' hyperparameters to the
    optimizer's groups in reverse order (a group mapping bug): each group
    trains on with another group's learning rate."""
    import torch.distributed.checkpoint.state_dict as sd

    orig = sd._split_optim_state_dict

    def split(model, optim, optim_state_dict, info):
        out = orig(model, optim, optim_state_dict, info)
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in out["param_groups"]]
        for g, h in zip(out["param_groups"], reversed(hyper)):
            g.update(h)
        return out

    return mock.patch.object(sd, "_split_optim_state_dict", split)


@fault("load-skips-model")
def load_skips_model():
    """dcp.load reads the optimizer but leaves the model's tensors as the
    fresh model had them (restoring one would not do: the first in order
    may be one training never changed, e.g. a frozen one)."""
    import torch
    import torch.distributed.checkpoint as dcp

    orig = dcp.load

    def local(t):  # this rank's part: DTensor (FSDP2), ShardedTensor (FSDP1), plain
        if hasattr(t, "to_local"):
            return t.to_local()
        if hasattr(t, "local_tensor"):
            return t.local_tensor()
        return t

    def load(state_dict, *a, **k):
        model = state_dict.get("model", {})
        fresh = {key: local(v).detach().clone() for key, v in model.items() if isinstance(v, torch.Tensor)}
        out = orig(state_dict, *a, **k)
        with torch.no_grad():
            for key, v in fresh.items():
                local(model[key]).copy_(v)
        return out

    return mock.patch.object(dcp, "load", load)


@fault("optim-state-dropped")
def optim_state_dropped():
    """set_state_dict forgets the optimizer state of one parameter."""
    import torch.distributed.checkpoint.state_dict as sd

    orig = sd.set_state_dict

    def set_state_dict(model, optimizers, *a, **k):
        out = orig(model, optimizers, *a, **k)
        for p in list(optimizers.state)[:1]:
            optimizers.state.pop(p)
        return out

    return mock.patch.object(sd, "set_state_dict", set_state_dict)


@fault("grads-summed")
def grads_summed():
    """FSDP2's gradient reduce-scatter sums where it averages (a lost divide
    factor): every sharded gradient is world-size times too large."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll

    orig = coll.DefaultReduceScatter.__call__

    def call(self, output_tensor, input_tensor, group, op, async_op=False):
        work = orig(self, output_tensor, input_tensor, group, op, async_op=async_op)
        if work is not None:
            work.wait()
        output_tensor.mul_(dist.get_world_size(group))
        return work

    return mock.patch.object(coll.DefaultReduceScatter, "__call__", call)


# ---- test-only scenarios ----------------------------------------------------------


def _adapter():
    from conformance.areas.checkpoint import adapter as checkpoint

    return checkpoint


@scenario("fault:ckpt-full:full-sd-perturbed", test_only=True)
def full_perturbed(spec: CaseSpec) -> dict:
    with FAULTS["full-sd-perturbed"]():
        return _adapter().observe_full(spec).to_dict()


@scenario("fault:ckpt-full:frozen-not-ignored", test_only=True)
def full_frozen_kept(spec: CaseSpec) -> dict:
    with FAULTS["frozen-not-ignored"]():
        return _adapter().observe_full(spec).to_dict()


def _full_under(name: str):
    def observe(spec: CaseSpec) -> dict:
        with FAULTS[name]():
            return _adapter().observe_full(spec).to_dict()

    return observe


for _name in ("buffers-not-upcast", "params-unsharded-low-precision", "fsdp2-state-dict-not-resharded"):
    scenario(f"fault:ckpt-full:{_name}", test_only=True)(_full_under(_name))


@scenario("fault:ckpt-ties:load-assigns", test_only=True)
def ties_assign(spec: CaseSpec) -> dict:
    with FAULTS["load-assigns"]():
        return _adapter().observe_ties(spec).to_dict()


@scenario("fault:ckpt-ties:lazy-init-keeps-old-shards", test_only=True)
def ties_stale(spec: CaseSpec) -> dict:
    with FAULTS["lazy-init-keeps-old-shards"]():
        return _adapter().observe_ties(spec).to_dict()


@scenario("fault:ckpt-ties:load-post-hook-keeps-old-shards", test_only=True)
def ties_stale_after_use(spec: CaseSpec) -> dict:
    with FAULTS["load-post-hook-keeps-old-shards"]():
        return _adapter().observe_ties(spec).to_dict()


def _ties_under(name: str):
    def observe(spec: CaseSpec) -> dict:
        with FAULTS[name]():
            return _adapter().observe_ties(spec).to_dict()

    return observe


for _name in ("fsdp1-low-precision-shard-kept", "fsdp2-cast-shard-kept"):
    scenario(f"fault:ckpt-ties:{_name}", test_only=True)(_ties_under(_name))


@scenario("fault:ckpt-load:load-skips-model", test_only=True)
def load_skips(spec: CaseSpec, dir: str) -> dict:
    with FAULTS["load-skips-model"]():
        return _adapter().load(spec, dir)


def _load_under(name: str):
    def load(spec: CaseSpec, dir: str) -> dict:
        with FAULTS[name]():
            return _adapter().load(spec, dir)

    return load


for _name in ("hyperparameters-as-built", "param-groups-hyperparameters-reversed"):
    scenario(f"fault:ckpt-load:{_name}", test_only=True)(_load_under(_name))


@scenario("fault:ckpt-load:optim-state-dropped", test_only=True)
def load_drops_optim(spec: CaseSpec, dir: str) -> dict:
    with FAULTS["optim-state-dropped"]():
        return _adapter().load(spec, dir)


@scenario("fault:ckpt-save:grads-summed", test_only=True)
def save_grads_summed(spec: CaseSpec, dir: str) -> dict:
    with FAULTS["grads-summed"]():
        return _adapter().save(spec, dir)


@scenario("fault:ckpt-save:unwritable", test_only=True)
def save_unwritable(spec: CaseSpec, dir: str) -> dict:
    """The checkpoint path cannot be made: a plain file stands where the
    directory goes (not a permission: the ranks may run as root)."""
    import torch.distributed as dist

    from conformance.areas.checkpoint.adapter import ckpt_dir

    if dist.get_rank() == 0:
        with open(ckpt_dir(dir), "w") as f:
            f.write("not a directory")
    dist.barrier()
    return _adapter().save(spec, dir)


@scenario("fault:ckpt-load:hang", test_only=True, fault=True)
def load_hangs(spec: CaseSpec, dir: str) -> dict:
    """Rank 1 never starts its load; rank 0 waits in the load's collectives."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        while True:
            time.sleep(3600)
    return _adapter().load(spec, dir)


@scenario("fault:ckpt-save:dies", test_only=True, fault=True)
def save_dies(spec: CaseSpec, dir: str) -> dict:
    """Rank 1 exits while writing its part of the checkpoint."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    orig = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if dist.get_rank() == 1:
            os._exit(7)
        return orig(self, plan, planner)

    with mock.patch.object(FileSystemWriter, "write_data", write_data):
        return _adapter().save(spec, dir)

